"""benchmarks/gpu_profile.py counts the GPU's busy time from its kernel events alone: on the
H100 (2026-11-27) it summed every profiler event's self device time, host ops included (an
aten op or an autograd Function carries the time of the kernels it launched), and reported a
busy share of 1.94. Fake events in the shape of torch's FunctionEventAvg; no GPU needed."""
from types import SimpleNamespace

import pytest
from _benchmarks import load_benchmark
from torch.autograd import DeviceType


@pytest.fixture(scope="module")
def gpu_profile():
    return load_benchmark("gpu_profile")


def ev(key, count, device_us, device_type=DeviceType.CPU, cpu_us=0.0, annotation=False):
    return SimpleNamespace(key=key, count=count, self_device_time_total=device_us, self_cpu_time_total=cpu_us,
                           device_type=device_type, is_user_annotation=annotation)


def test_only_device_events_count_as_the_gpus_work(gpu_profile):
    calls = 2
    events = [
        # the host side: each op carries its kernels' device time (torch's self device time)
        ev("_ChunkedDecayBackward", 2, 3000.0, cpu_us=500.0),
        ev("aten::add_", 4, 400.0, cpu_us=80.0),
        ev("cudaLaunchKernel", 10, 0.0, cpu_us=60.0),
        # a record_function range on the GPU's timeline spans kernels too
        ev("## Call CompiledFxGraph ##", 2, 3400.0, DeviceType.CUDA, annotation=True),
        # the kernels themselves
        ev("_bwd_dkv_kernel", 2, 2000.0, DeviceType.CUDA),
        ev("_bwd_dq_kernel", 2, 1000.0, DeviceType.CUDA),
        ev("void at::native::vectorized_elementwise_kernel<add>", 4, 400.0, DeviceType.CUDA),
        ev("Memset (Device)", 2, 0.0, DeviceType.CUDA),  # no time: not listed
    ]
    assert [gpu_profile.is_kernel(e) for e in events] == [False] * 4 + [True] * 4
    s = gpu_profile.summarize(events, calls, on_device=True, top=2)
    assert s["busy_ms"] == pytest.approx(1.7)  # (2000 + 1000 + 400) µs over 2 calls, each kernel once
    assert s["launches_per_call"] == pytest.approx(4.0)  # (2 + 2 + 4) / 2: kernels with time only
    assert [k["name"] for k in s["top"]] == ["_bwd_dkv_kernel", "_bwd_dq_kernel"]
    assert s["top"][0] == {"name": "_bwd_dkv_kernel", "per_call": 1.0, "ms": 1.0}
    # the host ops by the device time they launched, apart (and no annotation among them)
    assert [k["name"] for k in s["ops"]] == ["_ChunkedDecayBackward", "aten::add_"]
    assert s["ops"][0]["ms"] == pytest.approx(1.5)


def test_without_a_device_the_cpu_ops_self_time(gpu_profile):
    events = [ev("aten::mm", 3, 0.0, cpu_us=900.0), ev("aten::add", 3, 0.0, cpu_us=300.0),
              ev("aten::empty", 3, 0.0, cpu_us=0.0)]
    s = gpu_profile.summarize(events, 3, on_device=False, top=5)
    assert s["busy_ms"] == pytest.approx(0.4) and s["launches_per_call"] == 2.0
    assert [k["name"] for k in s["top"]] == ["aten::mm", "aten::add"] and "ops" not in s


def test_the_4k_rows_are_profiled_first(gpu_profile, monkeypatch):
    import argparse

    seen = {}
    real = argparse.ArgumentParser.parse_args

    def capture(self, argv=None, namespace=None):
        seen["lengths"] = real(self, argv, namespace).lengths
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        gpu_profile.main([])
    assert seen["lengths"] == "4096,65536"
