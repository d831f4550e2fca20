"""The GPU suite's harness (`fastrpe bench --suite gpu`), run on CPU: the refusal without
CUDA, the smoke path through every competitor, the criteria checker on hand-made results,
the sampled float64 reference, and the runner's resume / out-of-memory / hard-cap rules."""
import json
import time
from dataclasses import replace

import pytest
import torch

import fastrpe as fr
from fastrpe.bench import gpu
from fastrpe.bench.registry import Problem
from fastrpe.bench.runner import run_suite
from fastrpe.cli.main import main

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@needs_no_cuda
def test_gpu_suite_refuses_without_cuda_in_one_line(tmp_path, capsys):
    rc = main(["bench", "--suite", "gpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 2 and len(out) == 1 and "needs CUDA" in out[0]
    assert not (tmp_path / "gpu.json").exists()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run through the CLI at toy sizes (shared by the tests below)."""
    out = tmp_path_factory.mktemp("gpu")
    rc = main(["bench", "--suite", "gpu", "--smoke", "--lengths", "40", "--families", "alibi,kerple_log",
               "--decode-context", "48", "--compile-mode", "reduce-overhead", "--out", str(out)])
    assert rc == 0
    return out, json.loads((out / "gpu.json").read_text())


def test_smoke_runs_every_competitor_and_labels_itself(smoke):
    out, res = smoke
    assert res["smoke"] and res["complete"] and "SMOKE" in res["note"]
    assert res["torch"] == torch.__version__ and "command" in res and "--smoke" in res["command"]
    assert res["config"]["compile_mode"] == "reduce-overhead"  # (the +compiled rows' mode, recorded)
    comps = {r["competitor"] for r in res["rows"]}
    # every registered fastrpe backend appears (timed or refused with its own reasons)
    assert {f"fastrpe-{b}" for b in fr.dispatch.BACKENDS if not b.startswith("grid")} | {"fastrpe-auto"} <= comps
    assert {"flex", "sdpa", "fla-chunk_simple_gla", "fla-chunk_linear_attn"} <= comps
    for r in res["rows"]:
        assert ("seconds" in r) != ("skipped" in r), r  # timed, or skipped with a reason
        assert ("seconds" in r) == (r.get("first_call_seconds", -1) >= 0), r  # the first call's time, compile included
        assert r["problem"]["L"] == 40
    flex = [r for r in res["rows"] if r["competitor"] == "flex"]
    assert flex and all("EAGER" in r["flex"] and "seconds" in r for r in flex)
    assert all(r["block_mask"] == "create_block_mask" for r in flex)  # causal families: a block mask
    fla = [r for r in res["rows"] if r["competitor"].startswith("fla-")]
    assert fla and all("skipped" in r for r in fla)  # no CUDA (or no fla) here: a reason, not a number
    # fla and SDPA only on their families
    assert {r["problem"]["position"] for r in res["rows"] if r["competitor"] == "sdpa"} == {"none"}
    assert {r["problem"]["position"] for r in res["rows"] if r["competitor"] == "fla-chunk_simple_gla"} == {"alibi"}
    assert (out / "gpu.md").read_text().startswith("**SMOKE RUN")
    # the SoE far field walked (triton_soe.FAR_FIELD), in float32 products and bf16 halves (the
    # Triton rows skip on a CPU: test_the_walk_rows_walk runs one in the interpreter)
    walk = {r["competitor"] for r in res["rows"] if r["competitor"].startswith("fastrpe-triton_soe+walk")}
    assert walk == {"fastrpe-triton_soe+walk", "fastrpe-triton_soe+walk+bf16x3"}


def test_criteria_rows_run_first_at_every_length(tmp_path):
    """A phase cut short by its budget still has what `check` reads: the criteria rows of every
    length come before any other row."""
    cfg = gpu.smoke_config(lengths=(32, 40), families=("alibi",), decode_context=48)
    res = gpu.run_gpu_suite(cfg, tmp_path, command="order", log=lambda *a: None)
    first = [gpu.reads(Problem(**r["problem"]), r["competitor"]) for r in res["rows"]]
    assert any(first) and not all(first)
    assert first == sorted(first, reverse=True)  # every True before every False
    assert {r["problem"]["L"] for r, f in zip(res["rows"], first) if f} == {32, 40}
    # and among them, the rows under torch.compile after the eager ones (`row_pass`)
    ranks = [gpu.row_pass(Problem(**r["problem"]), r["competitor"]) for r in res["rows"]]
    assert ranks == sorted(ranks) and 1 in ranks


def test_the_first_pass_holds_every_row_the_criteria_read():
    """`reads` leaves out only rows `check` ignores: a result without them is judged the same."""
    rows = []
    for L in gpu.DEFAULT_LENGTHS:
        for fam in ("none", *gpu.FAMILIES):
            p = Problem(position=fam, causal=gpu.family_causal(fam), L=L)
            for name in gpu.registry(gpu.GpuConfig()):
                if gpu.applies(p, name):
                    ours = name.startswith("fastrpe-")
                    rows.append(_row(fam, L, name, ms=1.0 if ours else 30.0, exact=True, max_abs_err_fp32=1e-4,
                                     peak_bytes=2**30, peak_total_bytes=2**30))
    kept = [r for r in rows if gpu.reads(Problem(**r["problem"]), r["competitor"])]
    assert 0 < len(kept) < len(rows) / 2
    assert not any(r["competitor"] == "fla-chunk_linear_attn" for r in kept)  # read by no criterion
    full, first = gpu.check(_result(rows)), gpu.check(_result(kept))
    assert [c["status"] for c in first] == [c["status"] for c in full]
    assert {c["status"] for c in full} >= {"pass"}


def test_smoke_accuracy_rows_of_exact_backends_are_exact(smoke):
    _, res = smoke
    acc = [r for r in res["rows"] if "max_abs_err_fp32" in r]
    assert acc and all(r["problem"]["L"] == 40 for r in acc)  # at the accuracy length only
    for r in acc:
        if r.get("exact"):
            assert r["max_abs_err_fp32"] < 1e-5, r
    assert any(r["competitor"] == "fastrpe-fft" for r in acc)


def test_smoke_decode_and_sync_sections(smoke):
    _, res = smoke
    kinds = {r["kind"] for r in res["decode"]}
    assert {"constant", "kv", "kv-op"} <= kinds
    lin = next(r for r in res["decode"] if r["method"].startswith("state-linear"))
    kv = next(r for r in res["decode"] if r["method"].startswith("kv-cache (alibi, nprf"))
    assert lin["seconds"] > 0 and lin["state_bytes"] > 0
    # on CPU (FUSED_STEP "cuda") neither ALiBi row takes the fused Triton step
    torch_ops = next(r for r in res["decode"] if r["method"].endswith("PyTorch ops"))
    assert lin["fused_step"] is False and torch_ops["fused_step"] is False and torch_ops["seconds"] > 0
    # the KV cache holds k and v of the whole context: 2·B·H·ctx·D floats
    assert kv["state_bytes"] == 2 * 1 * 2 * 48 * 16 * 4
    assert res["sync"] == [{"skipped": "needs CUDA (set_sync_debug_mode watches CUDA syncs)", "run": 0}]


def test_decode_rows_time_the_fused_step_and_the_pytorch_ops(monkeypatch):
    """Where the fused Triton step runs (here forced, under the interpreter), each
    constant-size row (ALiBi, T5, KERPLE-log) takes it and its "PyTorch ops" twin does not;
    the setting is restored after."""
    pytest.importorskip("triton")
    from fastrpe.nn import attention as attention_mod
    from fastrpe.ops.linear import triton_recurrent
    from fastrpe.ops.linear.triton_chunked import triton_unavailable_reason

    if triton_unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip("the Triton interpreter is off")
    monkeypatch.setattr(attention_mod, "FUSED_STEP", "always")
    cfg = gpu.smoke_config(lengths=(32,), families=("alibi",), decode_context=48)
    rows = gpu.decode_rows(cfg, torch.device("cpu"), torch.float32, log=lambda *a: None)
    by = {r["method"]: r for r in rows}
    for name in ("state-linear (alibi, nprf)", "state-band (t5, nprf)", "state-soe (kerple_log, nprf)"):
        assert by[name]["fused_step"] is True, name
        assert by[f"{name}, PyTorch ops"]["fused_step"] is False, name
        # launching the compiled binary needs a compiled kernel: not the interpreter's
        assert "fast launch: no compiled fused step" in by[f"{name}, fast launch"]["skipped"], name
    assert all(r.get("seconds") for r in rows if "fast launch" not in r["method"]), [r.get("skipped") for r in rows]
    assert attention_mod.FUSED_STEP == "always" and not triton_recurrent.FAST_LAUNCH


def test_check_prints_one_line_per_criterion(smoke, capsys):
    out, res = smoke
    rc = main(["bench", "--suite", "gpu", "--check", str(out / "gpu.json")])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("SMOKE RESULT")
    assert len(lines) == 1 + len(gpu.check(res)) + 1 and "passed" in lines[-1]
    assert rc == 1  # the sync criterion is missing on CPU


# ----------------------------------------------------------------------------- the checker


def _row(fam, L, comp, ms=None, **kw):
    p = Problem(position=fam, causal=gpu.family_causal(fam), L=L).to_dict()
    r = {"problem": p, "competitor": comp, **kw}
    if ms is None:
        r.setdefault("skipped", "n/a")
    else:
        r["seconds"] = ms / 1e3
    return r


def _result(rows, decode=(), sync=()):
    return {"smoke": False, "rows": list(rows), "decode": list(decode), "sync": list(sync)}


def _status(res, start):
    hits = [c for c in gpu.check(res) if c["criterion"].startswith(start)]
    assert len(hits) == 1, [c["criterion"] for c in gpu.check(res)]
    return hits[0]["status"]


def test_check_geometric_against_fla_and_flex():
    L = 65536
    base = [_row("alibi", L, "fla-chunk_simple_gla", 3.0), _row("alibi", L, "flex", 60.0)]
    fast = _result(base + [_row("alibi", L, "fastrpe-chunked", 2.9, exact=True)])
    assert _status(fast, "geometric (alibi), L=65536: no slower than fla") == "pass"
    assert _status(fast, "geometric (alibi), L=65536: >= 15x") == "pass"  # 60 / 2.9 = 20.7
    slow = _result(base + [_row("alibi", L, "fastrpe-chunked", 4.5, exact=True)])
    assert _status(slow, "geometric (alibi), L=65536: no slower than fla") == "fail"
    assert _status(slow, "geometric (alibi), L=65536: >= 15x") == "fail"  # 13.3x
    # the dense reference and approximate rows do not count for an exact criterion
    ref = _result(base + [_row("alibi", L, "fastrpe-dense", 0.1, exact=True),
                          _row("alibi", L, "fastrpe-soe", 0.1, exact=False)])
    assert _status(ref, "geometric (alibi), L=65536: no slower than fla") == "missing"


def test_check_competitor_absent_is_missing_but_out_of_memory_is_a_pass():
    L = 65536
    ours = _row("alibi", L, "fastrpe-chunked", 2.0, exact=True)
    absent = _result([ours, _row("alibi", L, "fla-chunk_simple_gla", skipped="fla not importable")])
    assert _status(absent, "geometric (alibi), L=65536: no slower than fla") == "missing"
    oom = _result([ours, _row("alibi", L, "flex", skipped="out of memory")])
    assert _status(oom, "geometric (alibi), L=65536: >= 15x") == "pass"


def test_check_kerple_needs_accuracy_and_takes_the_fastest_accurate_row():
    L = 65536
    rows = [_row("alibi", L, "fla-chunk_simple_gla", 3.0), _row("kerple_log", L, "flex", 200.0),
            _row("kerple_log", L, "fastrpe-soe", 1.0, exact=False, max_abs_err_fp32=5e-3),
            _row("kerple_log", L, "fastrpe-fft", 9.0, exact=True, max_abs_err_fp32=1e-6)]
    res = _result(rows)
    # soe is faster but off by 5e-3: the criteria judge fft (9 ms > 2 x 3 ms)
    assert _status(res, "kerple_log, L=65536: <= 2x") == "fail"
    assert _status(res, "kerple_log, L=65536: >= 20x") == "pass"  # 200 / 9 = 22
    assert _status(res, "kerple_log, L=65536: output within") == "pass"
    rows[2]["max_abs_err_fp32"] = 5e-4
    assert _status(_result(rows), "kerple_log, L=65536: <= 2x") == "pass"


def test_check_million_tokens_time_and_memory():
    M = 1048576
    ok = _row("alibi", M, "fastrpe-chunked", 50.0, exact=True, peak_bytes=7 * 2**30)
    assert _status(_result([ok]), "alibi, L=1048576: forward+backward") == "pass"
    big = dict(ok, peak_bytes=9 * 2**30)
    assert _status(_result([big]), "alibi, L=1048576: forward+backward") == "fail"
    slow = dict(ok, seconds=0.07)
    assert _status(_result([slow]), "alibi, L=1048576: forward+backward") == "fail"
    table = _row("learned", M, "fastrpe-fft", 900.0, exact=True, peak_bytes=30 * 2**30, peak_total_bytes=41 * 2**30)
    assert _status(_result([table]), "learned table (causal), L=1048576") == "fail"  # 41 GiB in all


def test_check_decoding_and_sync():
    dec = [{"method": "state", "kind": "constant", "context": 65536, "seconds": 1e-4},
           {"method": "kv a", "kind": "kv", "context": 65536, "seconds": 4e-4},
           {"method": "kv b", "kind": "kv", "context": 65536, "seconds": 6e-4},
           {"method": "op", "kind": "kv-op", "context": 65536, "seconds": 1e-5}]
    assert _status(_result([], dec), "decoding at 65536") == "fail"  # 4x the fastest layer KV step
    dec[1]["seconds"] = 5e-4
    assert _status(_result([], dec), "decoding at 65536") == "pass"
    sync = [{"backend": "fft", "family": "alibi", "ok": True, "ok_api": False, "error_api": "item"},
            {"backend": "soe", "family": "alibi", "ok": False, "error": "nonzero", "ok_api": False}]
    assert _status(_result([], sync=sync), "no host synchronization in any backend") == "fail"
    assert _status(_result([], sync=sync[:1]), "no host synchronization in any backend") == "pass"
    assert _status(_result([], sync=sync[:1]), "no host synchronization in fastrpe.attention") == "fail"
    assert _status(_result([]), "no host synchronization in any backend") == "missing"


def test_check_decoding_compares_graphed_steps_like_for_like():
    dec = [{"method": "state", "kind": "constant", "context": 65536, "seconds": 2e-3, "graph_seconds": 5e-5},
           {"method": "kv", "kind": "kv", "context": 65536, "seconds": 3e-3, "graph_seconds": 4e-4}]
    assert _status(_result([], dec), "decoding at 65536:") == "fail"  # eager: 1.5x, launch bound
    assert _status(_result([], dec), "decoding at 65536, CUDA-graphed") == "pass"  # 8x
    dec[0]["graph_seconds"] = 1e-4
    assert _status(_result([], dec), "decoding at 65536, CUDA-graphed") == "fail"  # 4x
    del dec[1]["graph_seconds"]
    dec[1]["graph_skipped"] = "operation not permitted when stream is capturing"
    assert not [c for c in gpu.check(_result([], dec)) if "CUDA-graphed" in c["criterion"]]
    assert "(no graph: operation not permitted" in gpu._decode_line(dict(dec[1], state_bytes=0))


# ----------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("family", ["kerple_power", "learned_full"])
def test_sampled_reference_is_eq10_on_the_sampled_rows(family, causal):
    """Eq. 10 written densely here (materialized bias, masked, normalized) against the
    sampled-row reference, at an odd length."""
    L, H, D = 37, 3, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))
    pos = gpu.make_position(family, H, L)
    kern = fr.kernels.get_kernel("nprf", head_dim=D, num_features=6)
    pq, pk = kern(q, is_query=True), kern(k, is_query=False)
    c = torch.exp(pos.materialize(L, L).double())  # (H, L, L)
    if causal:
        c = c * torch.ones(L, L, dtype=torch.float64).tril()
    w = (pq @ pk.transpose(-1, -2)) * c
    dense = (w @ v) / w.sum(-1, keepdim=True)
    rows = gpu.sample_rows(L, 7)
    assert rows[0] == 0 and rows[-1] == L - 1
    got = gpu.sampled_reference(kern, pos, q, k, v, rows, causal)
    torch.testing.assert_close(got, dense[:, :, rows], rtol=1e-10, atol=1e-12)


def test_positions_are_frozen_and_tables_cover_every_offset():
    for fam in gpu.FAMILIES:
        pos = gpu.make_position(fam, 2, 50)
        assert not any(p.requires_grad for p in pos.parameters())
    t = gpu.make_position("learned_full", 2, 50)
    b = t.materialize(50, 50)
    assert b[0, 49, 0] != b[0, 48, 0]  # offset -49 and -48 differ: nothing clipped


def test_fla_simple_gla_g_gamma_is_alibi_log_decay():
    """fla's convention as the competitor uses it: per-step log decay g = -m gives
    `o_i = Σ_{j≤i} e^{-m(i-j)} scale·(q_i·k_j) v_j` (checked with fla's own naive op)."""
    naive = pytest.importorskip("fla.ops.simple_gla.naive")
    B, T, H, K, V = 1, 19, 2, 4, 3
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, d, generator=g) for d in (K, K, V))
    m = torch.tensor(fr.positions.alibi_slopes(H))
    o, _ = naive.naive_recurrent_simple_gla(q, k, v, (-m).expand(B, T, H).contiguous(), scale=K ** -0.5)
    i = torch.arange(T)
    decay = torch.exp(-m[:, None, None] * (i[:, None] - i[None, :]).clamp_min(0)) * (i[:, None] >= i[None, :])
    s = torch.einsum("bihk,bjhk->bhij", q, k) * K ** -0.5 * decay
    torch.testing.assert_close(o, torch.einsum("bhij,bjhv->bihv", s, v), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- the runner


def test_runner_skips_longer_lengths_after_out_of_memory_and_resumes():
    calls = []

    def oom(p, device, dtype):
        def fn():
            calls.append(p.L)
            if p.L >= 16:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return fn

    probs = [Problem(L=L) for L in (8, 16, 32)]
    rows = run_suite(probs, ["oom"], repeats=1, warmup=0, registry={"oom": oom}, log=lambda *a: None)["rows"]
    assert "seconds" in rows[0] and rows[1]["skipped"] == "out of memory"
    assert rows[2]["skipped"] == "out of memory at L=16" and 32 not in calls
    # resuming: a pair already done is not run again; `select` leaves pairs out
    calls.clear()
    rows = run_suite(probs, ["oom"], repeats=1, warmup=0, registry={"oom": oom}, log=lambda *a: None,
                     done={(probs[0].tag(), "oom")}, select=lambda p, n: p.L < 32)["rows"]
    assert [r["problem"]["L"] for r in rows] == [16] and calls == [16]


def test_runner_records_errors_and_extra_and_caps_a_call():
    def broken(p, device, dtype):
        def fn():
            raise RuntimeError("kernel exploded\nsecond line")
        return fn

    def sleepy(p, device, dtype):
        def fn():
            time.sleep(60)
        fn.extra = {"note": "sleeps"}
        return fn

    reg = {"broken": broken, "sleepy": sleepy}
    with pytest.raises(RuntimeError):
        run_suite([Problem(L=8)], ["broken"], registry=reg, log=lambda *a: None)
    t0 = time.perf_counter()
    rows = run_suite([Problem(L=8), Problem(L=16)], ["broken", "sleepy"], registry=reg, log=lambda *a: None,
                     catch_errors=True, call_cap_s=0.2)["rows"]
    assert time.perf_counter() - t0 < 20  # the 60-s call was cut (full gc after each failure: ~1 s each)
    assert rows[0]["skipped"] == "error: RuntimeError: kernel exploded"
    assert rows[1]["note"] == "sleeps" and "hard cap" in rows[1]["skipped"]
    assert rows[3]["skipped"].endswith("at L=8")  # not tried at the longer length


def test_runner_stops_after_recording_a_row_that_broke_the_cuda_context(monkeypatch):
    """An illegal memory access (fla's kernels on the H100 image did it) leaves every later
    CUDA call failing: the row is recorded, then the suite stops instead of filling the table
    with the same error."""
    from fastrpe.bench import runner

    def faults(p, device, dtype):
        def fn():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return fn

    ran = []

    def fine(p, device, dtype):
        return lambda: ran.append(p.L)

    monkeypatch.setattr(runner, "context_lost", lambda device: True)
    seen = []
    with pytest.raises(runner.ContextLost, match="faults on .*illegal memory access"):
        run_suite([Problem(L=8), Problem(L=16)], ["faults", "fine"], registry={"faults": faults, "fine": fine},
                  catch_errors=True, on_row=seen.append, log=lambda *a: None, cpu_peak=False)
    assert len(seen) == 1 and seen[0]["context_lost"] and "illegal memory access" in seen[0]["skipped"]
    assert ran == []  # nothing ran after it
    # an error that leaves the context working is recorded and the suite goes on
    monkeypatch.setattr(runner, "context_lost", lambda device: False)
    rows = run_suite([Problem(L=8)], ["faults", "fine"], registry={"faults": faults, "fine": fine},
                     catch_errors=True, log=lambda *a: None, cpu_peak=False, repeats=1, warmup=0)["rows"]
    assert "context_lost" not in rows[0] and ran


def test_a_lost_context_exits_75_and_the_resumed_run_skips_that_competitor(tmp_path, monkeypatch, capsys):
    """gpu_run.sh reruns the bench with --resume while it exits 75: the new process goes on
    after the recorded row and does not run the competitor that broke the context again."""
    from fastrpe.bench import runner

    calls = []

    def faults(p, device, dtype):
        def fn():
            calls.append(p.L)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return fn

    real = gpu.registry
    monkeypatch.setattr(gpu, "registry", lambda cfg: {**real(cfg), "fla-chunk_simple_gla": faults})
    monkeypatch.setattr(runner, "context_lost", lambda device: bool(calls) and len(calls) == 1)
    args = ["bench", "--suite", "gpu", "--smoke", "--lengths", "32,40", "--families", "alibi", "--sections", "rows",
            "--out", str(tmp_path)]
    assert main(args) == gpu.CONTEXT_LOST_EXIT
    res = json.loads((tmp_path / "gpu.json").read_text())
    assert "context_lost" in res and not res["complete"]
    assert [r["competitor"] for r in res["rows"]][-1] == "fla-chunk_simple_gla" and res["rows"][-1]["context_lost"]
    assert main([*args, "--resume"]) == 0
    res = json.loads((tmp_path / "gpu.json").read_text())
    assert calls == [32] and "context_lost" not in res  # not tried at 40
    rows = [(r["problem"]["L"], r["competitor"]) for r in res["rows"]]
    assert len(rows) == len(set(rows)) and (40, "fastrpe-triton_chunked") in rows


def test_runner_limit_on_timed_separates_compilation_from_a_slow_call():
    """A slow first call (compilation) followed by fast calls: with `limit_on="timed"` the
    competitor keeps its repeats and its longer lengths; by the probe alone it is cut."""
    seen = []

    def compiles(p, device, dtype):
        state = {"first": True}

        def fn():
            seen.append(p.L)
            if state["first"]:
                state["first"] = False
                time.sleep(0.15)
        return fn

    probs = [Problem(L=8), Problem(L=16)]
    kw = dict(repeats=3, warmup=0, time_limit_s=0.1, registry={"c": compiles}, log=lambda *a: None, cpu_peak=False)
    rows = run_suite(probs, ["c"], limit_on="timed", **kw)["rows"]
    assert all(r["repeats"] == 3 and r["seconds"] < 0.1 for r in rows)
    rows = run_suite(probs, ["c"], **kw)["rows"]
    assert rows[0]["repeats"] == 1 and rows[1]["skipped"] == "exceeded 0.1 s per call at L=8"


def test_runner_runs_a_slow_competitor_on_while_its_projection_fits_the_cap():
    """limit_on="timed" with a cap: a slow linear-time call goes on to the next length while
    its projected time stays under the cap, and stops once it would not."""
    ran = []

    def linear(p, device, dtype):
        def fn():
            ran.append(p.L)
            time.sleep(0.02 * p.L / 8)
        return fn

    probs = [Problem(L=L) for L in (8, 16, 32, 64)]
    rows = run_suite(probs, ["lin"], repeats=1, warmup=0, time_limit_s=0.005, registry={"lin": linear},
                     log=lambda *a: None, cpu_peak=False, limit_on="timed", call_cap_s=0.12)["rows"]
    # 20 ms at 8, 40 ms at 16, 80 ms at 32 (projected: 80 ms < 120 ms), 160 ms projected at 64: skipped
    assert [("seconds" in r) for r in rows] == [True, True, True, False]
    assert rows[3]["skipped"] == "exceeded 0.005 s per call at L=32" and 64 not in ran


def test_resume_keeps_rows_and_refuses_another_device(smoke, tmp_path, capsys):
    import shutil

    out, res = smoke
    shutil.copy(out / "gpu.json", tmp_path / "gpu.json")
    cfg = gpu.smoke_config(lengths=(40,), families=("alibi", "kerple_log"), decode_context=48,
                           compile_mode="reduce-overhead")  # (the fixture's)
    again = gpu.run_gpu_suite(cfg, tmp_path, command="second", resume=True, log=lambda *a: None)
    assert len(again["rows"]) == len(res["rows"]) and again["decode"] == res["decode"]  # nothing ran again
    assert again["commands"] == res["commands"] + ["second"]
    # another compile mode changes the Flex baseline: its rows do not mix either
    with pytest.raises(fr.FastRPEError, match="--resume: .* compiled in mode 'reduce-overhead'"):
        gpu.run_gpu_suite(replace(cfg, compile_mode="default"), tmp_path, resume=True, log=lambda *a: None)
    other = json.loads((tmp_path / "gpu.json").read_text())
    other["device"] = "NVIDIA H200"
    (tmp_path / "gpu.json").write_text(json.dumps(other))
    with pytest.raises(fr.FastRPEError, match="--resume: .* do not mix"):
        gpu.run_gpu_suite(cfg, tmp_path, resume=True, log=lambda *a: None)


# ----------------------------------------------------------------------------- sections and budget


def test_sections_run_in_the_order_given_and_resume_where_the_budget_stopped(tmp_path):
    """A 15-minute GPU session needs the timed rows before the other sections, and a phase cut
    by its budget must pick up the rest later without running anything twice."""
    quiet = {"log": lambda *a: None}
    cfg = gpu.smoke_config(lengths=(32,), families=("alibi",), decode_context=48, sections=("rows",))
    res = gpu.run_gpu_suite(cfg, tmp_path, command="rows only", **quiet)
    assert res["rows"] and res["decode"] == [] and res["sync"] == []
    assert not res["complete"]  # not every section was asked for

    # the budget spent before the first decode row: none runs, and the run says it was cut
    cut = gpu.run_gpu_suite(replace(cfg, sections=("decode",), budget_s=0.0), tmp_path, command="cut",
                            resume=True, **quiet)
    assert cut["decode"] == [] and not cut["complete"]

    full = gpu.run_gpu_suite(replace(cfg, sections=gpu.SECTIONS), tmp_path, command="rest", resume=True, **quiet)
    assert full["complete"] and full["commands"] == ["rows only", "cut", "rest"]
    methods = [r["method"] for r in full["decode"]]
    assert len(methods) == len(set(methods)) >= 3  # every decode row once
    assert [{k: v for k, v in r.items() if k != "run"} for r in full["sync"]] == [
        {"skipped": "needs CUDA (set_sync_debug_mode watches CUDA syncs)"}]
    assert len(full["rows"]) == len(res["rows"])  # the timed rows were not run again
    # nothing left: a spent budget turns nothing away, and the run is complete
    again = gpu.run_gpu_suite(replace(cfg, sections=gpu.SECTIONS, budget_s=0.0), tmp_path, command="again",
                              resume=True, **quiet)
    assert again["decode"] == full["decode"] and again["sync"] == full["sync"] and again["complete"]


def test_a_row_is_saved_as_soon_as_it_is_measured(tmp_path):
    """gpu.json holds each decode row before the next one starts (a device call killed at its
    time limit returns what it had measured)."""
    seen = []

    def log(line):
        if line.startswith("decode"):
            seen.append(len(json.loads((tmp_path / "gpu.json").read_text())["decode"]))

    cfg = gpu.smoke_config(lengths=(32,), families=("alibi",), decode_context=48, sections=("decode",))
    gpu.run_gpu_suite(cfg, tmp_path, command="x", log=log)
    assert seen and seen == list(range(1, len(seen) + 1))


def test_sections_option_refuses_unknown_names_in_one_line(tmp_path, capsys):
    rc = main(["bench", "--suite", "gpu", "--smoke", "--sections", "rows,warp", "--out", str(tmp_path)])
    err = capsys.readouterr()
    assert rc == 2 and "--sections" in (err.out + err.err) and "warp" in (err.out + err.err)


def test_passes_option_runs_only_the_criteria_rows_and_refuses_others_in_one_line(tmp_path, capsys):
    """gpu_run.sh's priority calls take the rows the criteria read (`--passes 0,1`): a
    competitor's rows on the other families (pass 2) are left to the general call."""
    base = ["bench", "--suite", "gpu", "--smoke", "--lengths", "40", "--families", "alibi,t5", "--sections", "rows",
            "--only", "fastrpe-triton_band", "--out", str(tmp_path)]
    assert main([*base, "--passes", "0,1"]) == 0
    res = json.loads((tmp_path / "gpu.json").read_text())
    assert {r["problem"]["position"] for r in res["rows"]} == {"t5"}  # triton_band is a criteria row of t5 only
    assert main([*base, "--resume"]) == 0
    res = json.loads((tmp_path / "gpu.json").read_text())
    assert {r["problem"]["position"] for r in res["rows"]} == {"t5", "alibi"}
    capsys.readouterr()
    assert main([*base, "--passes", "0,3"]) == 2
    err = capsys.readouterr()
    msg = (err.out + err.err).strip().splitlines()
    assert len(msg) == 1 and "--passes" in msg[0]


def test_flex_baseline_takes_the_first_kernel_options_that_fit():
    """Compiled Flex with a table score_mod ran out of shared memory on the H100 with Inductor's
    tiles: the baseline then tries the next options in turn (FLEX_OPTIONS_CHAIN), says which
    ran and what was refused, and raises any other error as it is."""
    tried = []

    def call(i, fits, error="out of resource: triton_tem_fused_flex_attention_0 Required: 245760 "
                            "Hardware limit:232448 Reducing block sizes or `num_stages` may help."):
        def fn():
            tried.append(i)
            if not fits:
                raise RuntimeError("No valid triton configs. OutOfMemoryError: " + error)
            return i
        return fn

    used = {"kernel_options": "Inductor's default"}
    run = gpu.first_that_fits([call(0, False), call(1, False), call(2, True)], ["default", "2 stages", "small"], used)
    assert run() == 2 and run() == 2 and tried == [0, 1, 2, 2]  # settled: no retry on later calls
    assert used["kernel_options"] == "small" and len(used["refused"]) == 2
    assert used["refused"][0] == "out of resource: triton_tem_fused_flex_attention_0 Required: 245760 Hardware limit:232448"
    # the last one failing too, or another error: raised
    with pytest.raises(RuntimeError, match="out of resource"):
        gpu.first_that_fits([call(0, False)], ["default"], {})()
    with pytest.raises(RuntimeError, match="illegal"):
        gpu.first_that_fits([call(0, False, error="illegal memory access"), call(1, True)], ["a", "b"], {})()
    assert gpu.FLEX_OPTIONS_CHAIN[0] is None and gpu.FLEX_OPTIONS_CHAIN[-1] == fr.ops.softmax.flex.GATHER_KERNEL_OPTIONS


def test_retry_errors_measures_a_failed_problem_again_whole(tmp_path, monkeypatch):
    """A later session resumes an earlier one's JSON (15 minutes reach 64k, not 1M): with
    --retry-errors each problem where a row failed (Flex out of shared memory on the first
    H100 run) runs again whole, so its ratios come from one run; a row that broke the CUDA
    context is kept, not retried. Every row says which run measured it."""
    quiet = {"log": lambda *a: None}
    cfg = gpu.smoke_config(lengths=(32,), families=("alibi", "kerple_log"), sections=("rows",))
    first = gpu.run_gpu_suite(cfg, tmp_path, command="one", **quiet)
    assert {r["run"] for r in first["rows"]} == {0}
    res = json.loads((tmp_path / "gpu.json").read_text())
    for r in res["rows"]:
        if r["problem"]["position"] == "kerple_log" and r["competitor"] == "flex":
            r.pop("seconds", None)
            r["skipped"] = "error: InductorError: out of resource"
        if r["competitor"] == "fla-chunk_simple_gla":
            r["skipped"], r["context_lost"] = "error: AcceleratorError: illegal memory access", True
    (tmp_path / "gpu.json").write_text(json.dumps(res))
    kept = gpu.retry_errors(res["rows"])
    assert {r["problem"]["position"] for r in kept if r["competitor"] != "fla-chunk_simple_gla"} <= {"none", "alibi"}
    assert any(r["competitor"] == "fla-chunk_simple_gla" for r in kept)
    again = gpu.run_gpu_suite(cfg, tmp_path, command="two", resume=True, retry=True, **quiet)
    by = {(r["problem"]["position"], r["competitor"]): r for r in again["rows"]}
    assert len(by) == len(again["rows"]) == len(first["rows"])  # nothing twice, nothing lost
    assert by[("kerple_log", "flex")]["run"] == by[("kerple_log", "fastrpe-auto")]["run"] == 1
    assert by[("alibi", "flex")]["run"] == 0 and by[("alibi", "fla-chunk_simple_gla")]["context_lost"]
    assert again["commands"] == ["one", "two"]


def test_gpu_profile_script_profiles_the_bench_rows_on_cpu(tmp_path):
    """benchmarks/gpu_profile.py (run by gpu_run.sh before the bench) on CPU at toy sizes: each
    case's time per call and its heaviest ops; a case that cannot run here says why."""
    from _benchmarks import load_benchmark

    mod = load_benchmark("gpu_profile")
    out = tmp_path / "p.json"
    assert mod.main(["--device", "cpu", "--lengths", "48", "--calls", "1", "--cases",
                     "fastrpe-chunked:alibi,fastrpe-triton_chunked:alibi,fastrpe-triton_chunked+compiled:alibi",
                     "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    ran, refused, *compiled = res["cases"]
    assert ran["wall_ms"] > 0 and ran["top"] and all(k["ms"] >= 0 for k in ran["top"])
    assert "needs CUDA" in refused["skipped"] and "compile_mode" not in ran
    # a compiled case once per compile mode (refused here: no CUDA)
    assert [c["compile_mode"] for c in compiled] == ["default", "reduce-overhead"]
    assert all("needs CUDA" in c["skipped"] for c in compiled)
    assert mod.main(["--device", "cpu", "--compile-modes", "fast", "--out", str(out)]) == 2


def test_retry_errors_without_resume_is_a_one_line_error(tmp_path, capsys):
    rc = main(["bench", "--suite", "gpu", "--smoke", "--retry-errors", "--out", str(tmp_path)])
    out = capsys.readouterr()
    lines = (out.out + out.err).strip().splitlines()
    assert rc != 0 and len(lines) == 1 and "--retry-errors needs --resume" in lines[0]
    assert not (tmp_path / "gpu.json").exists()


def test_compiled_rows_time_the_call_under_torch_compile(monkeypatch):
    """`fastrpe-<triton backend>+compiled`: the call of its eager twin under
    `torch.compile(fullgraph=True)` (interpreted kernels here, traced by aot_eager): the same
    output and gradients, and no row beyond `compiled_max_length`."""
    from fastrpe import backends_triton

    monkeypatch.setattr(backends_triton, "INTERPRET_ON_CPU", True)
    monkeypatch.setattr(gpu, "COMPILE_BACKEND", "aot_eager")
    calls = []  # each setup's timed call and its inputs

    def closure(fn, q, k, v, backward):
        calls.append((fn, q, k, v))
        return lambda: None

    monkeypatch.setattr(gpu, "_closure", closure)
    torch._dynamo.reset()
    cfg = gpu.smoke_config(compiled_max_length=48)
    p = Problem(position="alibi", L=48, H=2, D=16, features=8)
    dev, dt = torch.device("cpu"), torch.float64
    got = []
    for compiled in (False, True):
        run = gpu.fastrpe_setup("triton_chunked", cfg, compiled=compiled)(p, dev, dt)
        assert not isinstance(run, str), run
        assert ("compiled" in run.extra) == compiled
        fn, q, k, v = calls[-1]
        out = fn(q, k, v)
        got.append((out.detach(), *torch.autograd.grad(out.sum(), (q, k, v))))
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    assert "fullgraph=True" in run.extra["compiled"]
    refused = gpu.fastrpe_setup("triton_chunked", cfg, compiled=True)(
        Problem(position="alibi", L=96, H=2, D=16, features=8), dev, dt)
    assert isinstance(refused, str) and "--compiled-max-length" in refused
    torch._dynamo.reset()


def test_a_compiled_row_takes_its_eager_twins_accuracy():
    """`best_fastrpe` with a tolerance: a `+compiled` row (never at the accuracy length) is
    judged by its eager twin's measured error, so an approximate path too far from exact does
    not count through its compiled twin."""
    L, acc = 4096, 65536
    rows = [_row("kerple_log", acc, "fastrpe-triton_soe", 10.0, exact=False, max_abs_err_fp32=5e-3),
            _row("kerple_log", L, "fastrpe-triton_soe", 2.0, exact=False),
            _row("kerple_log", L, "fastrpe-triton_soe+compiled", 1.0, exact=False)]
    assert gpu.best_fastrpe(_result(rows), "kerple_log", L, tol=1e-3) is None
    rows[0]["max_abs_err_fp32"] = 1e-5
    assert gpu.best_fastrpe(_result(rows), "kerple_log", L, tol=1e-3)[0] == "fastrpe-triton_soe+compiled"


def test_precision_variants_count_against_a_float32_tolerance_only_where_they_cost_no_bf16_error():
    """A `+bf16x3` or `+bf16-features` row's float32-input error would be its twin's (float32
    calls never take its products). Against KERPLE's 1e-3 it counts only where its own error
    with bf16 inputs is no larger than its twin's (its products then cost the bf16 call
    nothing), and it is judged by its twin's float32 error; without a twin or its errors it does
    not count. For an exact family it counts as any row."""
    L = 65536
    rows = [_row("kerple_log", L, "fastrpe-triton_soe", 10.0, exact=False, max_abs_err_fp32=1e-5, max_abs_err=1e-3),
            _row("kerple_log", L, "fastrpe-triton_soe+bf16x3", 5.0, exact=False, max_abs_err_fp32=1e-5,
                 max_abs_err=1e-3),
            _row("kerple_log", L, "fastrpe-triton_soe+bf16-features", 4.0, exact=False, max_abs_err_fp32=1e-5,
                 max_abs_err=8e-3),
            _row("kerple_log", L, "fastrpe-triton_soe+saved-states+bf16x3", 3.0, exact=False, max_abs_err=1e-3),
            _row("alibi", L, "fastrpe-triton_chunked", 6.0, exact=True),
            _row("alibi", L, "fastrpe-triton_chunked+bf16x3", 3.0, exact=True)]
    res = _result(rows)
    name, row = gpu.best_fastrpe(res, "kerple_log", L, tol=1e-3)
    assert name == "fastrpe-triton_soe+bf16x3" and row["max_abs_err_fp32"] == 1e-5  # (no saved-states twin)
    res["rows"].append(_row("kerple_log", L, "fastrpe-triton_soe+saved-states", 9.0, exact=False,
                            max_abs_err_fp32=2e-3, max_abs_err=1e-3))
    assert gpu.best_fastrpe(res, "kerple_log", L, tol=1e-3)[0] == "fastrpe-triton_soe+bf16x3"  # its twin's 2e-3
    res["rows"][-1]["max_abs_err_fp32"] = 1e-5
    assert gpu.best_fastrpe(res, "kerple_log", L, tol=1e-3)[0] == "fastrpe-triton_soe+saved-states+bf16x3"
    rows[1]["max_abs_err"] = 1.1e-3  # its products cost something: out
    res["rows"].remove(rows[3])
    assert gpu.best_fastrpe(res, "kerple_log", L, tol=1e-3)[0] == "fastrpe-triton_soe+saved-states"
    assert gpu.precision_twin("fastrpe-triton_soe+saved-states+bf16x3") == "fastrpe-triton_soe+saved-states"
    assert gpu.precision_twin("fastrpe-triton_soe+saved-states") is None
    assert gpu.best_fastrpe(res, "kerple_log", L)[0] == "fastrpe-triton_soe+bf16-features"  # no tolerance
    assert gpu.best_fastrpe(res, "alibi", L, exact_only=True)[0] == "fastrpe-triton_chunked+bf16x3"


def test_a_rows_after_hook_adds_what_its_calls_left_and_the_autotuners_choices(monkeypatch):
    """`run_suite` copies a closure's `after()` into its timed row (not into a refused one);
    the GPU bench uses it for each row's own new autotuner choices (`triton_chunked.TUNED`)."""
    from types import SimpleNamespace

    from fastrpe.ops.linear import triton_chunked as tc

    def timed(p, device, dtype):
        def fn():
            return None

        fn.after = lambda: {"said": p.L}
        return fn

    rows = run_suite([Problem(L=8)], ["t", "r"], repeats=1, warmup=0,
                     registry={"t": timed, "r": lambda p, d, t: "refused"}, log=lambda *a: None,
                     cpu_peak=False)["rows"]
    assert rows[0]["said"] == 8 and "said" not in rows[1]
    # a stand-in autotuner: its cache maps tuning keys to the configs it chose
    cfg = SimpleNamespace(num_warps=8, num_stages=2)
    fake = SimpleNamespace(fn=SimpleNamespace(__name__="_k"), cache={(32, 64): cfg})
    monkeypatch.setattr(tc, "TUNED", [fake])
    before = gpu.autotuned()
    assert before == {"_k": {"(32, 64)": "num_warps=8, num_stages=2"}}
    fake.cache[(32, 128)] = SimpleNamespace(num_warps=4, num_stages=3)
    assert gpu._new_choices(before, gpu.autotuned()) == {
        "autotuned": {"_k": {"(32, 128)": "num_warps=4, num_stages=3"}}}
    assert gpu._new_choices(before, before) == {}


def test_host_time_script_counts_the_host_side_of_each_triton_call(tmp_path, capsys):
    """benchmarks/host_time.py: eager host time per call of each Triton backend, kernels
    stubbed (the interpreter's launches are no-ops while it runs, and restored after), and a
    bad `--modes` refused in one line."""
    import triton.runtime.interpreter as interp
    from _benchmarks import load_benchmark

    mod = load_benchmark("host_time")
    run = interp.InterpretedFunction.run
    out = tmp_path / "h.json"
    assert mod.main(["--calls", "2", "--repeats", "1", "--modes", "eager", "--out", str(out)]) == 0
    assert interp.InterpretedFunction.run is run  # restored
    rows = json.loads(out.read_text())["rows"]
    assert [r["backend"] for r in rows] == [b for b, _ in mod.CASES]
    assert all(r["eager_us"] > 0 and "compiled_us" not in r for r in rows)
    capsys.readouterr()
    assert mod.main(["--modes", "graphed"]) == 2
    assert "--modes" in capsys.readouterr().out


def test_only_and_skip_choose_the_competitors_and_a_pattern_matching_none_is_a_one_line_error(tmp_path, capsys):
    """gpu_run.sh times fla's rows in a process of their own (`--only 'fla-*'`, with another
    triton) and the rest without them (`--skip 'fla-*'`); neither run writes rows for the
    other's competitors, so the other's resume still runs them."""
    base = ["bench", "--suite", "gpu", "--smoke", "--lengths", "40", "--families", "alibi", "--sections", "rows",
            "--out", str(tmp_path)]
    assert main([*base, "--skip", "fla-*,*+*"]) == 0
    res = json.loads((tmp_path / "gpu.json").read_text())
    names = {r["competitor"] for r in res["rows"]}
    assert "flex" in names and "fastrpe-triton_chunked" in names
    assert not any(n.startswith("fla-") or "+" in n for n in names)
    assert main([*base, "--resume", "--only", "fla-*"]) == 0
    res = json.loads((tmp_path / "gpu.json").read_text())
    added = {r["competitor"] for r in res["rows"] if r["run"] == 1}
    assert added == {"fla-chunk_simple_gla", "fla-chunk_linear_attn"}  # refusals on CPU, recorded
    capsys.readouterr()
    assert main([*base, "--resume", "--only", "fla_*"]) == 2
    err = capsys.readouterr()
    msg = (err.out + err.err).strip().splitlines()
    assert len(msg) == 1 and "--only" in msg[0] and "'fla_*'" in msg[0] and "matches no competitor" in msg[0]


def test_only_with_a_family_times_that_competitor_on_those_families_alone(tmp_path):
    """`--only 'flex,fastrpe-fft:learned*'`: Flex on every family, the FFT path on the learned
    tables only (gpu_run.sh's fresh 64k window: the FFT rows the learned criteria read, not
    ALiBi's or KERPLE's, which other backends decide)."""
    base = ["bench", "--suite", "gpu", "--smoke", "--lengths", "40", "--families", "alibi,learned_full",
            "--sections", "rows", "--out", str(tmp_path)]
    assert main([*base, "--only", "flex,fastrpe-fft:learned*"]) == 0
    res = json.loads((tmp_path / "gpu.json").read_text())
    rows = {(r["problem"]["position"], r["competitor"]) for r in res["rows"]}
    assert rows == {("alibi", "flex"), ("learned_full", "flex"), ("learned_full", "fastrpe-fft")}


def test_a_row_that_broke_the_context_runs_again_under_other_versions_only(tmp_path, monkeypatch):
    """fla-core 0.6.0 broke the CUDA context under triton 3.6 (H100 image, 2026-11-26): under
    the same versions its row stays and fla is not run again; a run whose torch, triton or fla
    differs measures it again, unless that run leaves fla to another (`skip`). Each run's
    versions are kept (`envs`), and the table says which rows a run of other versions timed."""
    from fastrpe.bench import runner

    quiet = {"log": lambda *a: None}
    cfg = gpu.smoke_config(lengths=(32,), families=("alibi",), sections=("rows",))
    first = gpu.run_gpu_suite(cfg, tmp_path, command="one", **quiet)
    res = json.loads((tmp_path / "gpu.json").read_text())
    for r in res["rows"]:
        if r["competitor"] == "fla-chunk_simple_gla":
            r["skipped"], r["context_lost"] = "error: AcceleratorError: illegal memory access", True
    (tmp_path / "gpu.json").write_text(json.dumps(res))
    calls = []
    real = gpu.registry

    def counted(cfg):
        def fla(p, device, dtype):
            calls.append(p.L)
            return "counted"
        return {**real(cfg), "fla-chunk_simple_gla": fla}

    monkeypatch.setattr(gpu, "registry", counted)
    monkeypatch.setattr(runner, "context_lost", lambda device: False)
    gpu.run_gpu_suite(cfg, tmp_path, command="same versions", resume=True, **quiet)
    assert calls == []
    newer = {**gpu.versions(), "triton": "9.9.9", "fla": "9.9"}
    monkeypatch.setattr(gpu, "versions", lambda: newer)
    gpu.run_gpu_suite(replace(cfg, skip=("fla-*",)), tmp_path, command="others, fla left out", resume=True, **quiet)
    assert calls == []
    again = gpu.run_gpu_suite(replace(cfg, only=("fla-*",)), tmp_path, command="fla's own", resume=True, **quiet)
    assert calls == [32]
    fla = [r for r in again["rows"] if r["competitor"] == "fla-chunk_simple_gla"]
    assert len(fla) == 1 and fla[0]["run"] == 3 and fla[0]["skipped"] == "counted"
    assert len(again["rows"]) == len(first["rows"])
    assert [e and e["triton"] for e in again["envs"]] == [first["triton"]] * 2 + ["9.9.9"] * 2
    assert again["triton"] == first["triton"]  # the first run's, and the first fla any run had
    assert again["fla"] == (first["fla"] or "9.9")
    table = (tmp_path / "gpu.md").read_text()
    assert "Run 3 (its rows: fla-chunk_simple_gla): torch" in table and "triton 9.9.9" in table


def test_retry_errors_of_a_run_that_times_some_competitors_leaves_the_others_rows():
    """The run without fla (`skip`) measures again its own rows of a problem where one of its
    competitors failed, and keeps fla's: fla's own run times those."""
    p, q = Problem(position="alibi", L=32).to_dict(), Problem(position="t5", L=32).to_dict()
    rows = [{"problem": p, "competitor": "flex", "skipped": "error: InductorError"},
            {"problem": p, "competitor": "fla-chunk_simple_gla", "seconds": 1.0},
            {"problem": p, "competitor": "fastrpe-triton_chunked", "seconds": 1.0},
            {"problem": q, "competitor": "flex", "seconds": 1.0}]
    keep = gpu.retry_errors(rows, gpu.smoke_config(skip=("fla-*",)))
    assert [r["competitor"] for r in keep] == ["fla-chunk_simple_gla", "flex"]
    assert [r["competitor"] for r in gpu.retry_errors(rows)] == ["flex"]  # every competitor: the problem whole
    fla_only = gpu.retry_errors(rows, gpu.smoke_config(only=("fla-*",)))
    assert fla_only == rows  # none of its competitors failed


def test_the_top_level_versions_are_the_first_whole_runs_not_fla_s_own(tmp_path, monkeypatch):
    """On a fresh machine gpu_run.sh times fla's rows first, in a process with triton 3.7.1
    (`--only`): the result's versions are still those of the run that timed the rest, and
    the table names the run whose versions differ."""
    quiet = {"log": lambda *a: None}
    cfg = gpu.smoke_config(lengths=(32,), families=("alibi",), sections=("rows",))
    real = gpu.versions()
    monkeypatch.setattr(gpu, "versions", lambda: {**real, "triton": "9.9.9", "fla": "9.9"})
    gpu.run_gpu_suite(replace(cfg, only=("fla-*",)), tmp_path, command="fla's own", **quiet)
    monkeypatch.setattr(gpu, "versions", lambda: {**real, "fla": None})
    res = gpu.run_gpu_suite(replace(cfg, skip=("fla-*",)), tmp_path, command="the rest", resume=True, **quiet)
    assert res["triton"] == real["triton"] and res["fla"] == "9.9"
    assert res["envs"][0]["only"] == ["fla-*"] and "only" not in res["envs"][1]
    table = (tmp_path / "gpu.md").read_text()
    assert "Run 0 (its rows: fla-chunk_linear_attn, fla-chunk_simple_gla): torch" in table
    assert "Run 1" not in table


def test_compiled_and_flex_rows_record_inductors_cudagraph_skips(monkeypatch):
    """Under mode="reduce-overhead" Inductor runs a graph it cannot capture without CUDA graphs
    and says so in one log line only: a `+compiled` or Flex row keeps the lines logged since
    its setup (`cudagraph_skips`), and none when there were none."""
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    from fastrpe import backends_triton

    monkeypatch.setattr(backends_triton, "INTERPRET_ON_CPU", True)
    monkeypatch.setattr(gpu, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    cfg = gpu.smoke_config(compiled_max_length=48)
    p = Problem(position="alibi", L=48, H=2, D=16, features=8)
    dev = torch.device("cpu")
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to an earlier row")  # not this row's
    runs = [gpu.fastrpe_setup("triton_chunked", cfg, compiled=True)(p, dev, torch.float32),
            gpu.flex_setup(True, 4096)(p, dev, torch.float32)]
    for run in runs:
        assert not isinstance(run, str), run
        assert "cudagraph_skips" not in run.after()
    runs[0]()
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (1 instances)\nmore")
    for run in runs:
        assert run.after()["cudagraph_skips"] == ["skipping cudagraphs due to mutated inputs (1 instances)"]
    torch._dynamo.reset()


def test_a_verdict_on_rows_of_two_machines_says_so(capsys):
    """A 15-minute session resumes the last one's JSON: a ratio may then set a row of this
    session's machine against one of another's (each session gets a fresh machine; its boot
    id tells them apart). The issue asks for ratios from one run, so such a verdict says so."""
    L = 65536
    rows = [_row("alibi", L, "flex", 60.0, run=0), _row("alibi", L, "fastrpe-triton_chunked", 3.0, exact=True, run=1),
            _row("alibi", L, "fla-chunk_simple_gla", 3.5, run=1)]
    res = {**_result(rows), "envs": [{"machine": "aaaa"}, {"machine": "bbbb"}]}
    by = {c["criterion"]: c for c in gpu.check(res)}
    flex = by["geometric (alibi), L=65536: >= 15x faster than compiled Flex + ALiBi"]
    fla = by["geometric (alibi), L=65536: no slower than fla chunk_simple_gla"]
    assert flex["status"] == "pass" and flex["machines"] == 2 and "two machines" in flex["detail"]
    assert fla["status"] == "pass" and "machines" not in fla and "two machines" not in fla["detail"]
    gpu.print_check(res)
    assert "1 of these compare rows timed on two machines" in capsys.readouterr().out
    # a result from before `envs`: its runs count as one machine
    assert "machines" not in {c["criterion"]: c for c in gpu.check(_result(rows))}[flex["criterion"]]


def test_each_run_records_the_machine_it_ran_on(tmp_path):
    cfg = gpu.smoke_config(lengths=(32,), families=("alibi",), sections=("rows",), only=("flex",))
    res = gpu.run_gpu_suite(cfg, tmp_path, command="one", log=lambda *a: None)
    assert res["envs"][0]["machine"] == gpu.machine_id()
    assert gpu.machine_id() is None or len(gpu.machine_id()) == 8


def test_anchor_rows_are_measured_again_and_their_drift_printed(tmp_path, capsys):
    """A session resuming the last one's JSON measures the anchors again (`measure_again`),
    keeping their earlier rows; --check prints each pair's ratio, the drift between the two
    sessions' machines that the verdicts across sessions carry."""
    quiet = {"log": lambda *a: None}
    cfg = gpu.smoke_config(lengths=(32, 40), families=("alibi",), sections=("rows",), only=("flex", "fastrpe-chunked"))
    gpu.run_gpu_suite(cfg, tmp_path, command="one", **quiet)
    res = json.loads((tmp_path / "gpu.json").read_text())
    n = len(res["rows"])
    assert gpu.measure_again(res, (("flex", "alibi", 32), ("fastrpe-chunked", "alibi", 40), ("flex", "t5", 32))) == 2
    assert len(res["rows"]) == n - 2 and [r["competitor"] for r in res["earlier"]] == ["flex", "fastrpe-chunked"]
    (tmp_path / "gpu.json").write_text(json.dumps(res))
    again = gpu.run_gpu_suite(cfg, tmp_path, command="two", resume=True, **quiet)
    assert len(again["rows"]) == n
    assert sorted((r["competitor"], r["problem"]["L"]) for r in again["rows"] if r["run"] == 1) == [
        ("fastrpe-chunked", 40), ("flex", 32)]
    drift = gpu.anchor_drift(again)
    assert [(d["competitor"], d["L"]) for d in drift] == [("flex", 32), ("fastrpe-chunked", 40)]
    assert all(d["ratio"] == pytest.approx(d["now_ms"] / d["earlier_ms"]) for d in drift)
    gpu.print_check(again)
    out = capsys.readouterr().out
    assert "measured again: flex alibi L=32:" in out and "how far two sessions' machines differ" in out


def test_check_auto_against_the_fastest_exact_backend():
    """Issue 12 item 3: `auto` never more than 1.2x the fastest exact backend. Variants (`+`)
    and approximate backends do not set the bar; a faster approximate pick passes."""
    L = 4096
    base = [_row("alibi", L, "fastrpe-triton_chunked", 2.0, exact=True),
            _row("alibi", L, "fastrpe-chunked", 5.0, exact=True),
            _row("alibi", L, "fastrpe-triton_chunked+compiled", 0.5, exact=True),
            _row("kerple_log", L, "fastrpe-fft", 20.0, exact=True),
            _row("kerple_log", L, "fastrpe-triton_soe", 3.0, exact=False)]
    crit = "auto: never more than 1.2x"
    good = _result(base + [_row("alibi", L, "fastrpe-auto", 2.3, auto_picks="triton_chunked", exact=True),
                           _row("kerple_log", L, "fastrpe-auto", 3.1, auto_picks="triton_soe", exact=False)])
    assert _status(good, crit) == "pass"
    slow = _result(base + [_row("alibi", L, "fastrpe-auto", 5.1, auto_picks="chunked", exact=True)])
    assert _status(slow, crit) == "fail"
    detail = next(c["detail"] for c in gpu.check(slow) if c["criterion"].startswith(crit))
    assert "0/1 within 1.2x" in detail and "auto ran chunked, 2.55x fastrpe-triton_chunked's time" in detail
    assert _status(_result(base), crit) == "missing"


def test_rows_with_cuda_graphs_in_a_default_mode_run_and_the_4k_criterion_reads_both_pairings(monkeypatch):
    """A run in the default compile mode also times Flex and fastrpe with CUDA graphs
    (`+cudagraphs`, up to --compiled-max-length: Flex's compiled call and fastrpe's eager one
    captured, with the eager rows, and fastrpe's +compiled rows with mode="reduce-overhead",
    after them): the 4k criterion sets fastrpe against Flex without graphs, and any fastrpe row
    against Flex with graphs, and passes on either; a graphed fastrpe row never meets Flex
    without."""
    reg = gpu.registry(gpu.GpuConfig())
    assert {"flex+cudagraphs", "fastrpe-triton_chunked+cudagraphs", "fastrpe-triton_soe+cudagraphs",
            "fastrpe-triton_chunked+blocked-scan+cudagraphs", "fastrpe-triton_tiled+bf16-features+cudagraphs",
            "fastrpe-triton_chunked+compiled+cudagraphs"} <= set(reg)
    assert gpu.row_pass(Problem(position="t5", causal=True, L=4096), "fastrpe-triton_band+blocked-scan+cudagraphs") == 0
    assert not any(n.endswith("+cudagraphs") for n in gpu.registry(gpu.GpuConfig(compile_mode="reduce-overhead")))
    p4 = Problem(position="alibi", causal=True, L=4096)
    assert gpu.row_pass(p4, "flex+cudagraphs") == gpu.row_pass(p4, "fastrpe-triton_chunked+cudagraphs") == 0
    assert gpu.row_pass(p4, "fastrpe-triton_chunked+compiled+cudagraphs") == 1
    assert gpu.base_competitor("fastrpe-triton_soe+cudagraphs") == "fastrpe-triton_soe"
    captured = _result([_row("alibi", 4096, "flex+cudagraphs", 0.5),
                        _row("alibi", 4096, "fastrpe-triton_chunked+cudagraphs", 0.45, exact=True)])
    assert _status(captured, "alibi, L=4096: no slower than Flex") == "pass"
    L, crit = 4096, "alibi, L=4096: no slower than Flex"
    base = [_row("alibi", L, "flex", 0.9), _row("alibi", L, "flex+cudagraphs", 0.5),
            _row("alibi", L, "fastrpe-triton_chunked", 1.8, exact=True)]
    assert _status(_result(base), crit) == "fail"
    # with graphs ours beats Flex with graphs (0.4 < 0.5), though not Flex without them on its own terms
    graphed = _result(base + [_row("alibi", L, "fastrpe-triton_chunked+compiled+cudagraphs", 0.4, exact=True)])
    assert _status(graphed, crit) == "pass"
    detail = next(c["detail"] for c in gpu.check(graphed) if c["criterion"].startswith(crit))
    assert "fastrpe-triton_chunked 1.8 ms vs flex 0.9 ms" in detail
    assert "with CUDA graphs: fastrpe-triton_chunked+compiled+cudagraphs 0.4 ms vs flex+cudagraphs 0.5 ms" in detail
    # a graphed row slower than Flex with graphs: fail, even though 0.6 < Flex's 0.9 without graphs
    slow = _result(base + [_row("alibi", L, "fastrpe-triton_chunked+compiled+cudagraphs", 0.6, exact=True)])
    assert _status(slow, crit) == "fail"


def test_a_graphed_row_compiles_with_reduce_overhead(monkeypatch):
    from fastrpe import backends_triton

    monkeypatch.setattr(backends_triton, "INTERPRET_ON_CPU", True)
    monkeypatch.setattr(gpu, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(gpu, "_closure", lambda fn, q, k, v, backward: (lambda: None))
    cfg = gpu.smoke_config(compiled_max_length=48)
    p = Problem(position="alibi", L=48, H=2, D=16, features=8)
    run = gpu.registry(cfg)["fastrpe-triton_chunked+compiled+cudagraphs"](p, torch.device("cpu"), torch.float64)
    assert not isinstance(run, str), run
    assert "mode='reduce-overhead'" in run.extra["compiled"]
    flex = gpu.registry(cfg)["flex+cudagraphs"](Problem(position="alibi", L=96, H=2, D=16, features=8),
                                                torch.device("cpu"), torch.float64)
    assert isinstance(flex, str) and "--compiled-max-length" in flex
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["fastrpe-triton_soe+walk", "fastrpe-triton_soe+walk+bf16x3"])
def test_the_walk_rows_walk(monkeypatch, name):
    """The `+walk` rows run their call with the far field walked (`triton_soe_walk`), forward
    and backward, and say so; their twins do not."""
    from fastrpe import backends_triton
    from fastrpe.ops.linear import triton_soe_walk

    monkeypatch.setattr(backends_triton, "INTERPRET_ON_CPU", True)
    calls = []
    for fn in ("far_forward", "far_backward"):
        real = getattr(triton_soe_walk, fn)
        monkeypatch.setattr(triton_soe_walk, fn, lambda *a, _f=fn, _r=real, **kw: calls.append(_f) or _r(*a, **kw))
    p = Problem(position="kerple_log", L=40, H=2, D=16, features=8)
    for row in (name, name.replace("+walk", "", 1)):
        run = gpu.registry(gpu.smoke_config())[row](p, torch.device("cpu"), torch.float32)
        assert not isinstance(run, str), run
        run()
        assert (run.extra.get("far_field") == "walk") == (row == name)
        assert calls == (["far_forward", "far_backward"] if row == name else [])
        calls.clear()


def test_a_captured_row_needs_cuda_and_its_warm_up_leaves_no_work_for_the_timed_calls(monkeypatch):
    """fastrpe's and Flex's `+cudagraphs` rows (`captured`) need a CUDA device (a reason, not
    an error, elsewhere), and are left out of the warm-up's per-config rows: their call is their
    eager twin's, whose kernels the twin compiles."""
    from fastrpe.bench import gpu_warm

    cfg = gpu.smoke_config()
    p = Problem(position="alibi", L=48, H=2, D=16, features=8)
    for name in ("fastrpe-triton_chunked+cudagraphs", "flex+cudagraphs"):
        why = gpu.registry(cfg)[name](p, torch.device("cpu"), torch.float64)
        assert isinstance(why, str) and "CUDA graphs need a CUDA device" in why
    assert gpu_warm.tuned("fastrpe-triton_chunked") and not gpu_warm.tuned("fastrpe-triton_chunked+cudagraphs")
    assert not gpu_warm.shared("flex+cudagraphs") and not gpu_warm.shared("fastrpe-triton_chunked+cudagraphs")


def test_a_call_that_cannot_be_captured_is_a_refusal_and_its_own_errors_stay_errors(monkeypatch):
    """`captured`: a capture that fails (a host sync in the call, say) gives the row a reason,
    not an error (a resumed run would measure the problem's other rows again for an error); an
    error of the call itself, in its warm-up calls, is raised."""
    monkeypatch.setattr(gpu, "_warm_on_side_stream", lambda fn, device: fn())

    def no_capture(fn):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(gpu, "_capture", no_capture)
    why = gpu.captured(lambda: None, torch.device("cpu"))
    assert isinstance(why, str) and why.startswith("could not be captured in a CUDA graph: RuntimeError: "
                                                   "operation not permitted when stream is capturing")

    def broken():
        raise ValueError("the call's own")

    with pytest.raises(ValueError, match="the call's own"):
        gpu.captured(broken, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_replay_gives_the_eager_calls_gradients():
    """`captured`: a forward+backward call replayed from a CUDA graph leaves the gradients the
    eager call gives (each replay rewrites them), for new input values copied in place."""
    dev = torch.device("cuda")
    q, k, v = (torch.randn(1, 2, 256, 16, device=dev, requires_grad=True) for _ in range(3))
    pos = fr.positions.make("alibi", 2).to(dev)
    kern = fr.kernels.get_kernel("nprf", head_dim=16, num_features=8).to(dev)

    def fn(q, k, v):
        return fr.attention(q, k, v, kernel=kern, position=pos, causal=True, backend="auto")

    replay = gpu.captured(gpu._closure(fn, q, k, v, True), dev)
    with torch.no_grad():
        for t in (q, k, v):
            t.mul_(0.5)
    replay()
    got = [t.grad.clone() for t in (q, k, v)]
    q.grad = k.grad = v.grad = None
    fn(q, k, v).float().sum().backward()
    for a, t in zip(got, (q, k, v)):
        torch.testing.assert_close(a, t.grad)


def test_timed_backward_call_starts_from_no_gradients():
    """A timed forward+backward call sets its inputs' gradients to None first (a training
    step's `zero_grad(set_to_none=True)`): two calls leave one call's gradients, and the
    second never reads the first's (under CUDA graphs an output its replay overwrites)."""
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    seen = []

    def fn(q, k, v):
        seen.append(q.grad)
        return (q * k * v).sum(-1)

    run = gpu._closure(fn, q, k, v, backward=True)
    run()
    once = q.grad.clone()
    run()
    assert seen == [None, None]
    torch.testing.assert_close(q.grad, once, rtol=0, atol=0)


def test_changed_rows_of_older_code_are_measured_again_once(capsys):
    """`gpu.CHANGED`: a resumed session moves the timed rows whose code changed since (pattern,
    family, from L) to `earlier`, but only rows of runs before `CODE_EPOCH`; --check prints
    their old and new times as the change's, not the machines' drift."""
    changed = (("fastrpe-triton_chunked", "*", 16384), ("fastrpe-auto", "alibi", 16384))
    rows = [_row("alibi", 65536, "fastrpe-triton_chunked", 6.0, run=0),
            _row("alibi", 4096, "fastrpe-triton_chunked", 2.0, run=0),  # shorter: unchanged
            _row("alibi", 65536, "fastrpe-auto", 6.0, run=1),  # measured under the new code
            _row("t5", 65536, "fastrpe-auto", 9.0, run=0),  # another family
            _row("alibi", 65536, "fastrpe-triton_chunked+compiled", 5.0, run=0),  # another competitor
            _row("alibi", 262144, "fastrpe-triton_chunked", None, run=0)]  # untimed: nothing to compare
    res = {**_result(rows), "envs": [{"device": "X"}, {"device": "X", "code_epoch": gpu.CODE_EPOCH}]}
    assert gpu.measure_again(res, anchors=(), changed=changed) == 1
    assert [(r["competitor"], r["problem"]["L"], r["again"]) for r in res["earlier"]] == [
        ("fastrpe-triton_chunked", 65536, "changed")]
    assert len(res["rows"]) == len(rows) - 1
    res["rows"].append(_row("alibi", 65536, "fastrpe-triton_chunked", 4.0, run=1))
    [d] = gpu.anchor_drift(res)
    assert d["again"] == "changed" and d["ratio"] == pytest.approx(4.0 / 6.0)
    assert gpu.measure_again(res, anchors=(), changed=changed) == 0  # the new row is of the new epoch


def test_changed_rows_that_failed_are_measured_again_too():
    """A row of changed code that failed with an error moves as a timed one does, a fault that
    broke the CUDA context included (`retry_errors` keeps those: they would break it again under
    the same code); a failure for memory, an anchor that failed, or a row of the new epoch stay."""
    changed = (("fastrpe-triton_tiled+bf16x3", "*", 0),)
    fault = "error: AcceleratorError: CUDA error: an illegal memory access was encountered"
    rows = [_row("learned", 4096, "fastrpe-triton_tiled+bf16x3", skipped=fault, context_lost=True, run=0),
            _row("learned", 65536, "fastrpe-triton_tiled+bf16x3", skipped="out of memory", run=0),
            _row("alibi", 4096, "flex", skipped=fault, run=0),  # an anchor that failed: no time to compare
            _row("learned_full", 4096, "fastrpe-triton_tiled+bf16x3", skipped=fault, run=1)]  # the new epoch's
    res = {**_result(rows), "envs": [{"device": "X"}, {"device": "X", "code_epoch": gpu.CODE_EPOCH}]}
    assert rows[0] in gpu.retry_errors(res["rows"])  # the fault stays there
    assert gpu.measure_again(res, changed=changed) == 1
    assert [(r["problem"]["position"], r["again"]) for r in res["earlier"]] == [("learned", "changed")]
    assert res["rows"] == rows[1:]
    assert gpu.anchor_drift(res) == []  # nothing timed to set against


def test_changed_decode_rows_are_measured_again_and_their_drift_printed(capsys):
    """`gpu.CHANGED_DECODE`: a resumed session moves the decode rows of older runs that match it
    to `earlier_decode` (here the states' only), so the decode section times them again, and
    --check prints each one's old and new eager time."""
    decode = [{"method": "state-linear (alibi, nprf)", "kind": "constant", "seconds": 5e-4, "run": 0, "context": 64},
              {"method": "state-soe (kerple_log, nprf), PyTorch ops", "kind": "constant", "seconds": 1.6e-3, "run": 0,
               "context": 64},
              {"method": "kv-cache (alibi, softmax)", "kind": "kv", "seconds": 1.5e-3, "run": 0, "context": 64},
              {"method": "state-band (t5, nprf)", "kind": "constant", "seconds": 6e-4, "run": 1,
               "context": 64}]  # the new epoch's
    res = {**_result([], decode=decode), "envs": [{"device": "X"}, {"device": "X", "code_epoch": gpu.CODE_EPOCH}]}
    assert gpu.measure_again(res, anchors=(), changed=(), changed_decode=("state-*",)) == 2
    assert [r["method"] for r in res["decode"]] == ["kv-cache (alibi, softmax)", "state-band (t5, nprf)"]
    assert [r["again"] for r in res["earlier_decode"]] == ["changed", "changed"]
    res["decode"].append({"method": "state-linear (alibi, nprf)", "kind": "constant", "seconds": 3e-4, "run": 1,
                          "context": 64})
    [d] = gpu.decode_drift(res)
    assert d["method"] == "state-linear (alibi, nprf)" and d["ratio"] == pytest.approx(0.6)
    gpu.print_check(res)
    assert "measured again: decode state-linear (alibi, nprf): 0.5 ms earlier, 0.3 ms now (0.600x)" in capsys.readouterr().out
    assert gpu.measure_again(res, anchors=(), changed=(), changed_decode=("state-*",)) == 0
    assert all(any(gpu.matches(m, (pat,)) for pat, _ in gpu.CHANGED_DECODE)
               for m in ("state-soe (kerple_log, nprf)", "kv-cache (alibi, softmax)"))


def test_the_rows_that_faulted_before_the_key_tile_fix_are_in_changed():
    """The 4k bf16x3 rows of triton_soe, triton_band and triton_tiled faulted in the fourth H100
    session and stayed in its JSON; `CHANGED` names them, so the next session measures them."""
    for comp, fam in (("fastrpe-triton_soe+bf16x3", "kerple_log"), ("fastrpe-triton_band+bf16x3", "t5"),
                      ("fastrpe-triton_tiled+bf16x3", "learned")):
        assert any(gpu.matches(comp, (c,)) and gpu.matches(fam, (f,)) and 4096 >= L for c, f, L, _ in gpu.CHANGED)


def test_a_change_moves_the_rows_of_runs_before_its_own_epoch_only():
    """Each `CHANGED` entry names the epoch of its change: a row timed at that epoch or after
    stays however many epochs later (the sixth session ran epoch 4; epoch 5's resume must not
    time its fft rows again), one timed before it moves; the decode entries likewise."""
    changed = (("fastrpe-fft", "*", 0, 2),)
    rows = [_row("learned", 4096, "fastrpe-fft", 20.0, run=0), _row("learned", 65536, "fastrpe-fft", 500.0, run=1)]
    decode = [{"method": "state-linear (alibi, nprf)", "kind": "constant", "seconds": 5e-4, "run": 0},
              {"method": "state-band (t5, nprf)", "kind": "constant", "seconds": 6e-4, "run": 1}]
    res = {**_result(rows, decode=decode),
           "envs": [{"device": "X", "code_epoch": 1}, {"device": "X", "code_epoch": 2}]}
    assert gpu.measure_again(res, anchors=(), changed=changed, changed_decode=(("state-*", 2),), pair_lengths=()) == 2
    assert [r["problem"]["L"] for r in res["rows"]] == [65536]
    assert [r["method"] for r in res["decode"]] == ["state-band (t5, nprf)"]


def test_a_ratio_whose_two_sides_are_from_two_machines_is_measured_again_whole():
    """`gpu.unpaired` / `measure_again(pair_lengths=...)`: at a ratio's length, a problem whose
    Flex row and best fastrpe row were timed on different machines, or whose Flex row has no
    fastrpe row beside it, has every timed Flex and fastrpe row measured again ("pair"); a
    problem with both sides from one machine keeps its rows, and other competitors stay."""
    L = 65536
    rows = [_row("alibi", L, "flex", 55.0, run=1), _row("alibi", L, "fastrpe-triton_chunked", 3.1, exact=True, run=0),
            _row("alibi", L, "fastrpe-triton_chunked+bf16-features", 3.8, exact=True, run=1),
            _row("alibi", L, "fla-chunk_simple_gla", 3.0, run=0),
            _row("kerple_log", L, "flex", 182.0, run=1),
            _row("kerple_log", L, "fastrpe-triton_soe", 8.0, max_abs_err_fp32=1e-5, run=1),
            _row("kerple_log", L, "fastrpe-auto", 230.0, exact=True, run=0),
            _row("t5", L, "flex", 496.0, run=1)]
    res = {**_result(rows), "envs": [{"device": "X", "machine": "a"}, {"device": "X", "machine": "b"}]}
    assert gpu.unpaired(res, (L,)) == {("alibi", L), ("t5", L)}
    assert gpu.measure_again(res, anchors=(), changed=(), changed_decode=(), pair_lengths=(L,)) == 4
    assert {(r["problem"]["position"], r["competitor"]) for r in res["earlier"]} == {
        ("alibi", "flex"), ("alibi", "fastrpe-triton_chunked"), ("alibi", "fastrpe-triton_chunked+bf16-features"),
        ("t5", "flex")}
    assert {r["again"] for r in res["earlier"]} == {"pair"}
    assert gpu.unpaired(res, (L,)) == set()  # what stays is paired (fla's row is not Flex's pair)
    # a fastrpe row of changed code moves first; the Flex row it leaves alone follows it
    res["envs"][1]["code_epoch"] = 1
    assert gpu.measure_again(res, anchors=(), changed=(("fastrpe-triton_soe", "*", 0, 2),), changed_decode=(),
                             pair_lengths=(L,)) == 3
    assert [(r["competitor"], r["again"]) for r in res["earlier"][-3:]] == [
        ("fastrpe-triton_soe", "changed"), ("flex", "pair"), ("fastrpe-auto", "pair")]


def test_the_sixth_sessions_json_resumes_with_fla_and_the_unpaired_64k_ratios_measured_again():
    """On the JSON the sixth H100 session left (h100-2026-11-27d.json): fla's row, a fault of
    the third session kept since by `lost_elsewhere`, moves (CODE_EPOCH 5), and with it no other
    competitor's row of any epoch-4 run; the 64k ratios set across machines (ALiBi's Flex
    against the fifth session's triton_chunked) or half-measured (T5's Flex alone) move whole,
    while both KERPLEs, timed on one machine in that session, keep theirs."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks/results/gpu/h100-2026-11-27d.json"
    res = json.loads(path.read_text())
    assert any(r["competitor"] == "fla-chunk_simple_gla" and r.get("context_lost") for r in res["rows"])
    gpu.measure_again(res, changed=[c for c in gpu.CHANGED if gpu._since(c, 3)[1] <= 6])  # (as it resumed then)
    again = {(r["competitor"], r["problem"]["position"], r["problem"]["L"], r["again"])
             for r in res["earlier"] if "again" in r}
    assert ("fla-chunk_simple_gla", "alibi", 4096, "changed") in again
    assert not any(r["competitor"].startswith("fla-") for r in res["rows"])
    assert ("flex", "t5", 65536, "pair") in again and ("flex", "alibi", 65536, "pair") in again
    for fam in ("kerple_log", "kerple_power"):
        assert gpu._row(res, fam, 65536, "flex")["seconds"]
        assert gpu.best_fastrpe(res, fam, 65536, tol=gpu.ACCURACY_TOL) is not None
    epoch4 = {i for i, e in enumerate(res["envs"]) if e and e.get("code_epoch") == 4}
    moved4 = [r for r in res["earlier"] if r.get("run") in epoch4 and r.get("again") == "changed"]
    assert moved4 == []
    assert gpu.unpaired(res) == set()


def test_the_seventh_sessions_json_resumes_with_the_walks_fault_auto_and_fast_launch_measured_again():
    """On the JSON the seventh H100 session left (h100-2026-11-28.json): the walk's bf16x3 row,
    which broke the CUDA context there (and would stay, `retry_errors`), moves (CODE_EPOCH 7:
    its kernels changed), and so does every `fastrpe-auto` row (the library's products for
    16-bit calls became bf16x3) and the fast-launch decode rows (their launch changed); the
    plain Triton rows, which name their tf32x3, and the `+bf16x3` rows stay."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks/results/gpu/h100-2026-11-28.json"
    res = json.loads(path.read_text())
    assert any(r["competitor"] == "fastrpe-triton_soe+walk+bf16x3" and r.get("context_lost") for r in res["rows"])
    gpu.measure_again(res)
    again = {(r["competitor"], r["problem"]["position"], r["problem"]["L"], r["again"])
             for r in res["earlier"] if "again" in r}
    assert ("fastrpe-triton_soe+walk+bf16x3", "kerple_log", 65536, "changed") in again
    assert not any(r["competitor"] in ("fastrpe-auto", "fastrpe-triton_soe+walk+bf16x3") for r in res["rows"])
    for name, fam in (("fastrpe-triton_chunked+bf16x3", "alibi"), ("fastrpe-triton_band", "t5")):
        assert gpu._row(res, fam, 65536, name)["seconds"]
    assert not any(d["method"].endswith("fast launch") for d in res["decode"])
    assert {d["method"] for d in res["earlier_decode"] if d.get("again")} >= {
        "state-linear (alibi, nprf), fast launch", "state-soe (kerple_log, nprf), fast launch"}


def test_the_plain_triton_rows_name_tf32x3_and_auto_takes_the_librarys_default(monkeypatch):
    """Since bf16x3 became the library's products for 16-bit calls, a plain `fastrpe-triton_*`
    row runs under tf32x3 (what its name has meant in every session's JSON), `+bf16x3` under
    bf16x3, and `fastrpe-auto` under the library's default (what it measures); each row says
    which it set."""
    from fastrpe import backends_triton

    monkeypatch.setattr(backends_triton, "INTERPRET_ON_CPU", True)
    cfg = gpu.smoke_config()
    p = Problem(position="alibi", L=48, H=2, D=16, features=8)
    dev = torch.device("cpu")
    import fastrpe

    seen = []
    real = fastrpe.attention
    monkeypatch.setattr(fastrpe, "attention", lambda *a, **kw: seen.append(backends_triton.FLOAT32_PRODUCTS)
                        or real(*a, **kw))
    for backend, kw in (("triton_chunked", {}), ("triton_chunked", {"float32_products": "bf16x3"}), ("auto", {})):
        run = gpu.fastrpe_setup(backend, cfg, **kw)(p, dev, torch.float32)
        assert not isinstance(run, str), run
        seen.clear()
        run()
        want = kw.get("float32_products", "tf32x3" if backend != "auto" else backends_triton.FLOAT32_PRODUCTS)
        assert seen and set(seen) == {want}, (backend, kw, seen)
        assert run.extra.get("float32_products") == (None if backend == "auto" else want)


def test_fla_tiles_as_large_as_their_dimension_are_pruned_as_fla_prunes_its_gla_backward(monkeypatch):
    """`gpu.fla_tile_prune`: fla's rule from its #989 (a BK/BV tile kept only below K/V, or the
    smallest offered), here for the bench's K = 32 features and V = 64; and
    `prune_fla_oversized_tiles` puts it on the tiled autotuners of a module (under
    `triton.heuristics`, as fla's chunk_o), not on one without tiles nor over a pruner of the
    kernel's own, naming the same ones again."""
    import sys
    import types

    triton = pytest.importorskip("triton")
    tl = pytest.importorskip("triton.language")

    def cfgs(pairs):
        return [triton.Config({"BK": bk, "BV": bv}, num_warps=4, num_stages=3) for bk, bv in pairs]

    offered = cfgs([(128, 128), (64, 64), (32, 32)])  # fla-core 0.6.0's chunk_fwd_kernel_o on Hopper
    assert [(c.kwargs["BK"], c.kwargs["BV"]) for c in gpu.fla_tile_prune(offered, {}, K=32, V=64)] == [(32, 32)]
    both = cfgs([(32, 64), (64, 32), (32, 32), (64, 128)])
    assert [(c.kwargs["BK"], c.kwargs["BV"]) for c in gpu.fla_tile_prune(both, {"K": 128}, V=128)] == [
        (32, 64), (64, 32), (32, 32)]
    assert gpu.fla_tile_prune(offered, {}) == offered  # dimensions unknown: all kept
    plain = [triton.Config({}, num_warps=w) for w in (2, 4)]
    assert gpu.fla_tile_prune(plain, {}, K=32, V=64) == plain

    @triton.jit
    def body(x, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        pass

    def own(configs, nargs, **kw):
        return configs

    mod = types.ModuleType("fake_fla_chunk_o")
    mod.tiled = triton.heuristics({"BK": lambda a: 32})(triton.autotune(configs=offered, key=["K"])(body))
    mod.untiled = triton.autotune(configs=plain, key=[])(body)
    mod.pruned = triton.autotune(configs=offered, key=["K"], prune_configs_by={"early_config_prune": own})(body)
    monkeypatch.setitem(sys.modules, "fake_fla_chunk_o", mod)
    assert gpu.prune_fla_oversized_tiles(("fake_fla_chunk_o", "no_such_fla_module")) == ["fake_fla_chunk_o.tiled"]
    assert mod.tiled.fn.early_config_prune is gpu.fla_tile_prune and mod.untiled.early_config_prune is None
    assert mod.pruned.early_config_prune is own
    assert gpu.prune_fla_oversized_tiles(("fake_fla_chunk_o",)) == ["fake_fla_chunk_o.tiled"]
    monkeypatch.setenv(gpu.FLA_PRUNE_ENV, "0")
    assert gpu.prune_fla_oversized_tiles(("fake_fla_chunk_o",)) == []


def test_a_precision_variant_at_1m_is_judged_by_its_accuracy_length_errors():
    """At 1M no row measures its accuracy: a `+bf16x3` row there counts by its own and its
    twin's errors at the accuracy length (the twin need not be timed at 1M), and not where
    those say its products cost the bf16 call something."""
    acc, big = 65536, 1048576
    name = "fastrpe-triton_soe+saved-states+bf16x3+stacked-states"
    rows = [_row("kerple_power", acc, "fastrpe-triton_soe+saved-states+stacked-states", 7.0, exact=False,
                 max_abs_err_fp32=3e-5, max_abs_err=7e-3),
            _row("kerple_power", acc, name, 6.0, exact=False, max_abs_err_fp32=3e-5, max_abs_err=7e-3),
            _row("kerple_power", big, "fastrpe-triton_soe+saved-states", 0.155, exact=False),
            _row("kerple_power", big, name, 0.07, exact=False)]
    res = _result(rows)
    assert gpu.precision_twin(name) == "fastrpe-triton_soe+saved-states+stacked-states"
    got, row = gpu.best_fastrpe(res, "kerple_power", big, tol=1e-3)
    assert got == name and row["max_abs_err_fp32"] == 3e-5
    rows[1]["max_abs_err"] = 8e-3  # costs the bf16 call something at 64k: not counted at 1M either
    assert gpu.best_fastrpe(res, "kerple_power", big, tol=1e-3)[0] == "fastrpe-triton_soe+saved-states"


def test_resume_source_takes_the_carried_json_of_this_gpu_else_the_newest_committed_one(tmp_path):
    """A fresh checkout carries no .gpu_runs/: `first` then resumes the newest committed JSON
    measured on the same GPU in the same Flex mode, never another device's, a smoke run's, or
    a warm-up's record."""
    def put(name, **kw):
        p = tmp_path / name
        p.write_text(json.dumps({"suite": "gpu", "smoke": False, "rows": [], "config": {}, **kw}))
        return p

    h100a = put("h100-2026-11-27.json", device="H100", finished="2026-11-27T10:00:00Z")
    h100b = put("h100-2026-11-28.json", device="H100", finished="2026-11-28T10:00:00Z")
    h200 = put("h200-2026-11-26.json", device="H200", finished="2026-11-26T10:00:00Z")
    cuda_graphs = put("h200-2026-11-29.json", device="H200", finished="2026-11-29T10:00:00Z",
                      config={"compile_mode": "reduce-overhead"})
    smoke = put("smoke.json", device="H200", smoke=True, finished="2026-11-30T10:00:00Z")
    (tmp_path / "h200-warm.json").write_text(json.dumps({"device": "H200", "workers": []}))
    (tmp_path / "broken.json").write_text("{")
    committed = sorted(tmp_path.glob("*.json"))
    missing = tmp_path / "runs" / "gpu.json"
    assert gpu.resume_source(missing, committed, "H100") == h100b
    assert gpu.resume_source(missing, committed, "H200") == h200
    assert gpu.resume_source(missing, committed, "H200", "reduce-overhead") == cuda_graphs
    assert gpu.resume_source(None, committed, "B200") is None
    # the last call's JSON wins over a newer committed one, if it is this GPU's
    assert gpu.resume_source(h100a, committed, "H100") == h100a
    assert gpu.resume_source(h100a, committed, "H200") == h200
    assert gpu.resume_source(smoke, committed, "H200") == h200
