"""The GPU bench's compile warm-up (`fastrpe bench --suite gpu --warm`, `fastrpe.bench.gpu_warm`),
on CPU: the one-config autotuners it relies on, the rows it plans, and a smoke run of its
worker processes, finished and stopped at the budget."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fastrpe.bench import gpu
from fastrpe.bench.gpu_warm import LAST, plan, shared, tuned, warm_items
from fastrpe.bench.registry import Problem
from fastrpe.cli.main import main
from fastrpe.ops.linear.triton_chunked import TUNE_CONFIGS, tune_configs

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def test_tune_configs_reads_one_index(monkeypatch):
    monkeypatch.delenv("FASTRPE_TRITON_CONFIG", raising=False)
    assert tune_configs() == TUNE_CONFIGS and len(set(TUNE_CONFIGS)) == len(TUNE_CONFIGS) > 1
    for i, c in enumerate(TUNE_CONFIGS):
        monkeypatch.setenv("FASTRPE_TRITON_CONFIG", str(i))
        assert tune_configs() == (c,)
    for bad in ("6", "-1", "x", "1,2"):
        monkeypatch.setenv("FASTRPE_TRITON_CONFIG", bad)
        with pytest.raises(Exception, match="FASTRPE_TRITON_CONFIG: expected an index in 0..2") as e:
            tune_configs()
        assert "\n" not in str(e.value)


def _compiled_env(**extra):
    """This environment without the interpreter (the suite's conftest sets it), so that the
    kernels are decorated as on a GPU."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTRPE_TRITON_CONFIG")}
    return {**env, **extra}


def test_every_autotuned_kernel_takes_the_one_config_asked_for():
    """Each autotuner tunes over `TUNE_CONFIGS`, or the one pinned; triton_soe's bf16x3 dq
    autotuner (`triton_soe.SOE_DQ_BF16X3_NOTE`) over the same with at least 2 stages, wrapping
    the same kernel."""
    pytest.importorskip("triton")
    code = ("from fastrpe.ops.linear import triton_chunked as tc, triton_soe as ts, triton_tiled as tt\n"
            "ks = {n: getattr(m, n) for m in (tc, ts, tt) for n in dir(m) if type(getattr(m, n)).__name__ == 'Autotuner'}\n"
            "assert ts._soe_bwd_dq_kernel_bf16x3.fn is ts._soe_bwd_dq_kernel.fn\n"
            "print({n: tuple((c.num_warps, c.num_stages) for c in k.configs) for n, k in ks.items()})")
    staged = ((4, 2), (4, 3))
    for env, want, want_staged in ((_compiled_env(), TUNE_CONFIGS, staged),
                                   (_compiled_env(FASTRPE_TRITON_CONFIG="2"), (TUNE_CONFIGS[2],), ((4, 3),)),
                                   (_compiled_env(FASTRPE_TRITON_CONFIG="0"), ((4, 1),), ((4, 2),))):
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                             check=False)
        assert res.returncode == 0, res.stderr[-2000:]
        configs = eval(res.stdout)
        assert len(configs) == 11 and configs.pop("_soe_bwd_dq_kernel_bf16x3") == want_staged
        assert set(configs.values()) == {want}


def test_tune_pairs_raises_the_stages_and_drops_repeats(monkeypatch):
    from fastrpe.ops.linear.triton_chunked import tune_pairs

    monkeypatch.delenv("FASTRPE_TRITON_CONFIG", raising=False)
    assert tune_pairs() == TUNE_CONFIGS
    assert tune_pairs(2) == ((4, 2), (4, 3))
    assert tune_pairs(3) == ((4, 3),)
    monkeypatch.setenv("FASTRPE_TRITON_CONFIG", "0")
    assert tune_pairs(2) == ((4, 2),)


def test_a_one_config_autotuner_launches_as_a_full_one_times_that_config():
    """The warm-up's premise, against the installed triton: the options a full autotuner
    passes when it times config c (Triton's compile cache key is built from them) are the ones
    a one-config autotuner launches c with."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def k(x_ptr, n, BLOCK: tl.constexpr):
        pass

    def calls_of(configs):
        calls = []
        tuner = triton.autotune(configs=[triton.Config({}, num_warps=w, num_stages=s) for w, s in configs], key=["n"],
                                do_bench=lambda fn, quantiles=None, **kw: (fn(), [1.0, 1.0, 1.0])[1])(k)
        tuner.fn.run = lambda *args, **kwargs: calls.append((args, kwargs))
        tuner.run(0, 64, BLOCK=16, grid=(1,))
        return calls

    full = calls_of(TUNE_CONFIGS)
    assert len(full) == len(TUNE_CONFIGS) + 1  # each config timed, then the winner launched
    for i, c in enumerate(TUNE_CONFIGS):
        one = calls_of([c])
        assert len(one) == 1 and one[0] == full[i], (c, one, full[i])


def test_warm_items_are_the_compiling_rows_in_the_bench_order():
    cfg = gpu.GpuConfig(lengths=(gpu.L_SHORT, gpu.L_CHECK, gpu.L_LONG, gpu.L_MAX))
    first = warm_items(cfg, "first")
    assert first and all(gpu.reads(p, n) and gpu.applies(p, n) and (tuned(n) or shared(n)) for p, n in first)
    # the bench's passes in order (the eager rows, then those under torch.compile), each by length
    ranks = [gpu.row_pass(p, n) for p, n in first]
    assert ranks == sorted(ranks) and set(ranks) == {0, 1}
    for rank in (0, 1):
        lengths = [p.L for (p, _), r in zip(first, ranks) if r == rank]
        assert lengths == sorted(lengths)
    names = {n for _, n in first}
    assert {"flex", "fla-chunk_simple_gla", "fastrpe-triton_chunked", "fastrpe-triton_soe", "fastrpe-triton_band",
            "fastrpe-triton_tiled", "fastrpe-triton_chunked+compiled"} <= names
    # a compiled row runs its eager twin's kernels: one worker compiles its graph (`shared`)
    assert not tuned("fastrpe-triton_chunked+compiled") and shared("fastrpe-triton_chunked+compiled")
    assert not any("auto" in n or n in ("fastrpe-fft", "sdpa") for n in names)  # auto would time; the rest compile nothing
    # Flex at 262,144 only for the learned tables, as `reads` says
    assert {p.position for p, n in first if n == "flex" and p.L == gpu.L_LONG} == {"learned", "learned_full"}
    # rest: both passes, the first one's rows first, less what gpu.json holds
    rest = warm_items(cfg, "rest", done={(first[0][0].tag(), first[0][1])})
    assert rest[:len(first) - 1] == first[1:] and len(rest) > len(first)
    assert any(n.endswith("+bf16-features") for _, n in rest) and "fla-chunk_linear_attn" in {n for _, n in rest}
    with pytest.raises(ValueError):
        warm_items(cfg, "second")


def test_plan_gives_every_worker_the_tuned_rows_and_one_worker_each_shared_row():
    P = [Problem(position="alibi", L=L) for L in (64, 128, 256)]
    items = [(P[0], "flex"), (P[0], "fastrpe-triton_chunked"), (P[1], "fla-chunk_simple_gla"), (P[1], "flex"),
             (P[1], "fastrpe-triton_chunked"), (P[2], "flex")]
    workers = plan(items, 2, n_workers=2)
    for w in workers:  # the bench's order kept, every tuned row in every worker, fla's rows last
        assert [it for it in w if tuned(it[1])] == [it for it in items if tuned(it[1])]
        fla = [it for it in w if it[1] in LAST]
        assert w == [it for it in items if it in w and it not in fla] + fla
    shared = [it for w in workers for it in w if not tuned(it[1])]
    assert sorted(shared, key=items.index) == [it for it in items if not tuned(it[1])]  # each exactly once
    assert [len(w) for w in workers] == [4, 4] and (P[1], "fla-chunk_simple_gla") in [w[-1] for w in workers]


def test_plan_with_more_workers_than_configs_deals_each_configs_tuned_rows_among_its_workers():
    """Three autotuner configs, six workers (`WARM_WORKERS`): worker i compiles config i mod 3;
    each tuned row is compiled once per config, by one of that config's two workers, in turn;
    the shared rows go to one worker each, over all six."""
    from fastrpe.bench.gpu_warm import WARM_WORKERS

    P = [Problem(position="alibi", L=L) for L in (64, 128, 256, 512)]
    items = [(p, "fastrpe-triton_chunked") for p in P] + [(p, "flex") for p in P]
    workers = plan(items, 3)
    assert len(workers) == WARM_WORKERS == 6
    for c in range(3):
        mine = [it for i in (c, c + 3) for it in workers[i] if tuned(it[1])]
        assert sorted(mine, key=items.index) == items[:4]  # each tuned row once for config c
        assert [len([it for it in workers[i] if tuned(it[1])]) for i in (c, c + 3)] == [2, 2]
    shared = [it for w in workers for it in w if not tuned(it[1])]
    assert sorted(shared, key=items.index) == items[4:] and all(len(w) <= 3 for w in workers)
    assert len(plan(items, 3, n_workers=1)) == 3  # never fewer workers than configs


@needs_no_cuda
def test_warm_refuses_without_cuda_in_one_line(tmp_path, capsys):
    rc = main(["bench", "--suite", "gpu", "--warm", "first", "--out", str(tmp_path)])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 2 and len(out) == 1 and "needs CUDA" in out[0]
    assert not (tmp_path / "gpu_warm.json").exists()


def test_smoke_warm_runs_each_worker_through_its_plan(tmp_path):
    rc = main(["bench", "--suite", "gpu", "--smoke", "--warm", "first", "--lengths", "40", "--families", "alibi,t5",
               "--budget-s", "120", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "gpu_warm.json").read_text())
    assert res["pass"] == "first" and res["killed_at_budget"] == []
    assert len(res["workers"]) >= len(TUNE_CONFIGS)  # (several workers share a config: gpu_warm.plan)
    assert [w["triton_config"] for w in res["workers"]] == [str(w["worker"] % len(TUNE_CONFIGS)) for w in res["workers"]]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["gpu_warm.json"]  # plan and logs elsewhere
    spec = json.loads((Path(res["work_dir"]) / "gpu_warm_plan.json").read_text())
    for w, planned in zip(res["workers"], spec["workers"]):
        assert w["returncode"] == 0 and w["finished"] and len(w["rows"]) == w["planned"] == len(planned)
        assert [r["competitor"] for r in w["rows"]] == [it["competitor"] for it in planned]
    ran = [r for w in res["workers"] for r in w["rows"] if r["competitor"] == "flex"]
    assert len(ran) == 2 and all("skipped" not in r for r in ran)  # eager Flex runs on CPU, each row once


def test_warm_stops_its_workers_at_the_budget(tmp_path):
    rc = main(["bench", "--suite", "gpu", "--smoke", "--warm", "first", "--lengths", "40", "--families", "alibi",
               "--budget-s", "0.2", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "gpu_warm.json").read_text())
    assert res["killed_at_budget"] == [w["worker"] for w in res["workers"]] and len(res["workers"]) >= len(TUNE_CONFIGS)
    assert all(w["returncode"] != 0 and not w.get("finished") for w in res["workers"])
    assert not list(Path(res["work_dir"]).glob("gpu_warm_?.json"))  # merged into gpu_warm.json
    assert not any("log_tail" in w for w in res["workers"])  # stopped, not failed
    # the cache key a precompiled pack must be built under (benchmarks/precompile.py)
    triton = pytest.importorskip("triton")
    assert res["triton_key"].startswith(triton.__version__) and len(res["triton_key"]) > 200


def test_warm_rest_with_nothing_left_starts_no_worker(tmp_path):
    from fastrpe.bench.gpu_warm import warm

    cfg = gpu.smoke_config(lengths=(40,), families=("alibi",))
    rows = [{"problem": p.to_dict(), "competitor": n, "seconds": 1.0} for p, n in warm_items(cfg, "rest")]
    (tmp_path / "gpu.json").write_text(json.dumps({"rows": rows}))
    lines = []
    res = warm(cfg, tmp_path, which="rest", log=lines.append)
    assert res["workers"] == [] and lines == ["warm-up: nothing left to compile for the rest pass"]
    assert not list(tmp_path.glob("gpu_warm_*.log"))


def _failing_then_flex_plan(tmp_path) -> Path:
    """A one-worker plan: a row that fails (no such competitor), then Flex."""
    cfg = gpu.smoke_config(lengths=(40,), families=("alibi",))
    p = Problem(position="alibi", kernel=cfg.kernel, L=40, B=cfg.B, H=cfg.H, D=cfg.D, features=cfg.features)
    spec = {"config": cfg.to_dict(), "pass": "first",
            "workers": [[{"problem": p.to_dict(), "competitor": "no-such-row"},
                         {"problem": p.to_dict(), "competitor": "flex"}]]}
    (tmp_path / "plan.json").write_text(json.dumps(spec))
    return tmp_path / "plan.json"


def test_a_worker_records_a_failing_row_and_goes_on(tmp_path):
    from fastrpe.bench.gpu_warm import run_worker

    assert run_worker(_failing_then_flex_plan(tmp_path), 0) == 0
    rec = json.loads((tmp_path / "gpu_warm_0.json").read_text())
    assert rec["finished"] and [r["competitor"] for r in rec["rows"]] == ["no-such-row", "flex"]
    assert rec["rows"][0]["skipped"].startswith("error: KeyError") and "skipped" not in rec["rows"][1]


def test_a_worker_stops_at_a_row_that_broke_the_cuda_context(tmp_path, monkeypatch):
    from fastrpe.bench import gpu_warm

    plan_path = _failing_then_flex_plan(tmp_path)
    monkeypatch.setattr(gpu_warm, "context_lost", lambda device: True)
    assert gpu_warm.run_worker(plan_path, 0) == gpu.CONTEXT_LOST_EXIT
    rec = json.loads((tmp_path / "gpu_warm_0.json").read_text())
    assert not rec.get("finished") and [r["competitor"] for r in rec["rows"]] == ["no-such-row"]
    assert rec["rows"][0]["context_lost"]


def test_warm_items_leave_out_the_competitors_the_run_does_not_time():
    """gpu_run.sh warms fla's rows in their own process, with their own triton (`--only`),
    and the rest without them (`--skip`)."""
    cfg = gpu.GpuConfig(lengths=(gpu.L_SHORT, gpu.L_CHECK))
    fla = warm_items(replace(cfg, only=("fla-*",)), "first")
    assert fla and {n for _, n in fla} == {"fla-chunk_simple_gla"}
    rest = {n for _, n in warm_items(replace(cfg, skip=("fla-*",)), "first")}
    assert rest and not any(n.startswith("fla-") for n in rest) and "flex" in rest


def test_warm_starts_only_the_workers_that_have_rows(tmp_path):
    """fla's warm-up (`--only 'fla-*'`) has two shared rows for six autotuner configs: the
    workers without a row are not started."""
    rc = main(["bench", "--suite", "gpu", "--smoke", "--warm", "first", "--lengths", "40,48", "--families", "alibi",
               "--only", "flex", "--budget-s", "120", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "gpu_warm.json").read_text())
    assert [w["worker"] for w in res["workers"]] == [0, 1]
    assert all(w["returncode"] == 0 and [r["competitor"] for r in w["rows"]] == ["flex"] for w in res["workers"])


def test_warm_first_puts_the_rows_a_resumed_run_times_first_at_the_front():
    """gpu_run.sh's resumed `first` times +compiled, +cudagraphs and +blocked-scan before the
    rest: its warm-up compiles those first (`--warm-first`), each group in the bench's order."""
    cfg = gpu.GpuConfig(lengths=(gpu.L_SHORT, gpu.L_CHECK), skip=("fla-*",))
    plain = warm_items(cfg, "first")
    pats = ("*+compiled", "*+cudagraphs", "*+blocked-scan")
    front = warm_items(replace(cfg, warm_first=pats), "first")
    hit = [any(n.endswith(p[1:]) for p in pats) for _, n in front]
    assert sorted(front, key=plain.index) == plain and any(hit) and not all(hit)
    assert hit == sorted(hit, reverse=True)  # every priority row before every other
    assert [it for it in front if it[1].endswith("+blocked-scan")] == [
        it for it in plain if it[1].endswith("+blocked-scan")]
    assert [it for it, h in zip(front, hit) if not h] == [it for it in plain if it not in front[:sum(hit)]]


def test_warm_first_at_a_length_puts_only_that_lengths_rows_first():
    """A fresh `first` (another GPU's JSON, or none) times the 64k criteria's rows before the
    4k ones: its warm-up compiles `flex@65536` first, and Flex at 4k where the bench's order
    has it."""
    cfg = gpu.GpuConfig(lengths=(gpu.L_SHORT, gpu.L_CHECK), skip=("fla-*",))
    plain = warm_items(cfg, "first")
    front = warm_items(replace(cfg, warm_first=(f"flex@{gpu.L_CHECK}",)), "first")
    n_long = sum(1 for p, n in plain if n == "flex" and p.L == gpu.L_CHECK)
    assert n_long > 0 and sorted(front, key=plain.index) == plain
    assert all(n == "flex" and p.L == gpu.L_CHECK for p, n in front[:n_long])
    assert front[n_long:] == [it for it in plain if it not in front[:n_long]]
    assert any(n == "flex" and p.L == gpu.L_SHORT for p, n in front[n_long:])
    # two lengths' groups: the one named first goes first, though the bench runs 4k first
    both = warm_items(replace(cfg, warm_first=(f"flex@{gpu.L_CHECK}", f"flex@{gpu.L_SHORT}")), "first")
    n_short = sum(1 for p, n in plain if n == "flex" and p.L == gpu.L_SHORT)
    assert n_short > 0 and [(p.L, n) for p, n in both[:n_long + n_short]] == (
        [(gpu.L_CHECK, "flex")] * n_long + [(gpu.L_SHORT, "flex")] * n_short)


def test_row_matches_reads_a_length_after_the_at_sign():
    short, long = (Problem(L=L, position="alibi") for L in (gpu.L_SHORT, gpu.L_CHECK))
    assert gpu.row_matches(long, "flex", ("flex@65536",)) and not gpu.row_matches(short, "flex", ("flex@65536",))
    assert gpu.row_matches(short, "flex", ("fl*",)) and gpu.row_matches(long, "flex", ("fl*",))
    assert not gpu.row_matches(long, "flex+cudagraphs", ("flex@65536",))
    assert gpu.row_matches(long, "fastrpe-auto", ("flex@4096", "fastrpe-*@65536"))


def test_row_matches_reads_a_family_after_the_colon():
    learned, alibi = (Problem(L=gpu.L_CHECK, position=f) for f in ("learned_full", "alibi"))
    assert gpu.row_matches(learned, "fastrpe-fft", ("fastrpe-fft:learned*",))
    assert not gpu.row_matches(alibi, "fastrpe-fft", ("fastrpe-fft:learned*",))
    assert gpu.row_matches(learned, "fastrpe-fft", ("fastrpe-fft:learned_full@65536",))
    assert not gpu.row_matches(learned, "fastrpe-fft", ("fastrpe-fft:learned_full@4096",))
    assert gpu.split_pattern("flex") == ("flex", "*", None)
    assert gpu.split_pattern("fastrpe-*:t5@4096") == ("fastrpe-*", "t5", 4096)


@pytest.mark.parametrize("pats, says", [("flex@4k", "expected a length"), ("flux@4096", "matches no competitor"),
                                        ("flex:learnt@4096", "matches none of")])
def test_warm_first_at_a_length_is_checked_by_the_cli(tmp_path, capsys, pats, says):
    rc = main(["bench", "--suite", "gpu", "--smoke", "--warm", "first", "--warm-first", pats, "--out", str(tmp_path)])
    err = capsys.readouterr()
    assert rc == 2 and says in (err.out + err.err)


def test_warm_first_is_an_option_of_the_cli(tmp_path, capsys):
    rc = main(["bench", "--suite", "gpu", "--smoke", "--warm", "first", "--warm-first", "nothing-*",
               "--out", str(tmp_path)])
    err = capsys.readouterr()
    assert rc == 2 and "--warm-first" in (err.out + err.err) and "matches no competitor" in (err.out + err.err)


def test_a_restarted_worker_goes_on_from_its_start_with_its_record(tmp_path, monkeypatch):
    """`run_worker(..., start)`: a worker that stopped at a row that broke the CUDA context is
    started again after it, and its record goes on (rows, then `finished`)."""
    from fastrpe.bench import gpu_warm

    plan_path = _failing_then_flex_plan(tmp_path)
    monkeypatch.setattr(gpu_warm, "context_lost", lambda device: True)
    assert gpu_warm.run_worker(plan_path, 0) == gpu.CONTEXT_LOST_EXIT
    monkeypatch.undo()
    assert gpu_warm.run_worker(plan_path, 0, start=1) == 0
    rec = json.loads((tmp_path / "gpu_warm_0.json").read_text())
    assert rec["finished"] and [r["competitor"] for r in rec["rows"]] == ["no-such-row", "flex"]
    assert rec["rows"][0]["context_lost"] and "skipped" not in rec["rows"][1]


FAKE_WORKER = r"""
import json, sys
from pathlib import Path
plan_path, index, start = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
items = json.loads(plan_path.read_text())["workers"][index]
out = plan_path.parent / f"gpu_warm_{index}.json"
rec = json.loads(out.read_text()) if start else {"worker": index, "rows": []}
def row(i, **kw):
    rec["rows"].append({"tag": "t", "competitor": items[i]["competitor"], **kw})
    out.write_text(json.dumps(rec))
if start == 0 and len(items) > 1:  # its first row breaks the CUDA context: recorded
    row(0, skipped="error: an illegal memory access", context_lost=True)
    sys.exit(75)
if start == 1 and len(items) > 2:  # its second row kills it before its record
    print("Segmentation fault (a stand-in)")
    sys.exit(3)
for i in range(start, len(items)):
    row(i)
rec["finished"] = True
out.write_text(json.dumps(rec))
"""


def test_warm_starts_a_worker_again_after_a_lost_context_and_after_a_crash(tmp_path, monkeypatch):
    """One faulting row ended four of the six workers of each H100 warm-up (2026-11-28): now a
    worker that stopped at a row that broke the CUDA context starts again after that row, and
    one that died before recording its row after that row, recorded as where it died; each
    restart in the record with its log's tail. (A stand-in worker: the first row of a
    worker with two rows or more breaks the context, the second of one with three or more
    kills it.)"""
    from fastrpe.bench import gpu_warm
    from fastrpe.bench.gpu_warm import warm

    fake = tmp_path / "fake_worker.py"
    fake.write_text(FAKE_WORKER)
    monkeypatch.setattr(gpu_warm, "_worker_command",
                        lambda plan, i, start: [sys.executable, str(fake), str(plan), str(i), str(start)])
    monkeypatch.setattr(gpu_warm, "RESTART_MIN_S", 0.0)
    cfg = gpu.smoke_config(lengths=(40, 48), families=("alibi", "t5"))
    lines = []
    res = warm(cfg, tmp_path / "out", log=lines.append, budget_s=60)
    spec = json.loads((Path(res["work_dir"]) / "gpu_warm_plan.json").read_text())
    assert any(len(w) > 2 for w in spec["workers"])  # (the case exercises both)
    for w, planned in zip(res["workers"], spec["workers"]):
        m = len(planned)
        assert w["returncode"] == 0 and w["finished"] and len(w["rows"]) == m
        assert [r["competitor"] for r in w["rows"]] == [it["competitor"] for it in planned]
        want = [(0, gpu.CONTEXT_LOST_EXIT)] * (m > 1) + [(1, 3)] * (m > 2)
        assert [(f["row"], f["exit"]) for f in w.get("restarts", [])] == want
        if m > 2:
            assert w["rows"][1]["skipped"] == "the worker died here (exit 3)"
            assert "Segmentation fault (a stand-in)" in w["restarts"][1]["log_tail"]
    assert any("started again after row 0 (exit 75" in line for line in lines)
