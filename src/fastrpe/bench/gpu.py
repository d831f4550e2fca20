"""The GPU suite, `fastrpe bench --suite gpu`: issue 12's comparison in one process.

Problems: B=1, H=8, D=64, 32 features (fastrpe kernel `nprf`), bf16, forward+backward,
L in `DEFAULT_LENGTHS`, one positional family at a time (`FAMILIES`; causal except
`learned_full`). Competitors, each a registry entry for `runner.run_suite`:

* `flex`: `torch.compile(flex_attention)` with the family's `score_mod` and, when causal,
  a causal `block_mask` from `create_block_mask` (what a user runs; softmax attention);
* `sdpa`: `scaled_dot_product_attention` without a positional term (FlashAttention on a
  GPU: the exact-softmax ceiling), on the family `none`;
* `fla-chunk_simple_gla`: flash-linear-attention's chunked geometric decay (ALiBi's
  `log γ = -m` per head as `g_gamma`, no normalizer), on `alibi`;
  `fla-chunk_linear_attn`: its normalized linear attention without a decay, on `none`
  (fla takes raw `[B, T, H, K]` tensors of width K = 32: no feature map is charged to it;
  its autotuners do not try K/V tiles as wide as K/V or wider, as fla prunes its own GLA
  backward: `prune_fla_oversized_tiles`, recorded in the rows' `fla_pruned`);
* `fastrpe-<backend>` for every backend in `fastrpe.dispatch.BACKENDS` (registered when the
  suite starts, so backends added later appear by themselves) and `fastrpe-auto`, through
  `fastrpe.attention(..., backend=...)`; a backend that refuses the call is recorded with
  its own `not_supported_reasons`; `fastrpe-triton_*` multiply their float32 features by three
  tf32 products (`backends_triton.FLOAT32_PRODUCTS = "tf32x3"`, named: the rows kept their
  meaning when the library's default for 16-bit calls became "bf16x3", 2026-11-28; `+bf16x3`
  rows run that, and `fastrpe-auto` whatever the library does); `fastrpe-triton_*+bf16-features`:
  the Triton backends with the features rounded to bf16 (`backends_triton.LOWP_FEATURES`), to
  weigh their speed against their error on the GPU;
  `fastrpe-triton_*+compiled`: the same call under `torch.compile(fullgraph=True)`, as Flex
  runs (the kernels are custom ops in the graph; the feature maps and the glue are Inductor's).

Order: the rows the criteria read (`reads`) first, at every length, then those of them under
`torch.compile` (`+compiled`, up to `compiled_max_length`), then the rest, so a phase cut
short by its budget still has them; the sections (host syncs, decoding, timed rows) run in
the order `sections` gives, each under the same budget, and a run resumed picks up where one
stopped. Positional parameters are frozen everywhere
(gradients for q, k, v only). Times are median
CUDA-event milliseconds over `repeats` calls after warm-up (compilation excluded), memory
the allocator's peak above what the inputs and their gradients hold (`peak_bytes`) and in
all (`peak_total_bytes`). A call out of memory, past the hard cap, or failing, is recorded
with its reason and the longer lengths of that pair are skipped.

Besides the timings: the output error of every fastrpe backend at `accuracy_length` against
a float64 reference of Luo et al.'s Eq. 10 on sampled rows (`sampled_reference`), a
decoding section (one token at `decode_context` with a constant-size state against
KV-cache steps), and a host-synchronization section (each linear-time and FFT backend,
forward+backward under `torch.cuda.set_sync_debug_mode("error")`). `check` evaluates the
issue's "What it must show" criteria from the JSON.

`smoke=True` runs the same code at toy sizes on CPU (eager FlexAttention, forward only,
labeled as such; fla skipped): it tests the harness, it measures nothing.
"""
from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..ops.softmax.flex import GATHER_KERNEL_OPTIONS
from .registry import Problem

DEFAULT_LENGTHS = (4096, 16384, 65536, 262144, 1048576)
FAMILIES = ("alibi", "kerple_log", "kerple_power", "t5", "learned", "learned_full")
DECAYING = ("alibi", "kerple_log", "kerple_power")
SECTIONS = ("sync", "decode", "rows")
#: families the fastrpe paths must compute to within `ACCURACY_TOL` of exact (float32 inputs)
ACCURACY_TOL = 1e-3
SOFTMAX_ONLY_BACKENDS = ("dense", "sdpa", "flex")  # not linear-time or FFT paths: no sync check
#: fastrpe rows timed and shown but not counted as fastrpe's result in the criteria: the
#: materializing reference (quadratic memory) and the softmax backends
NOT_CONTENDERS = ("fastrpe-dense", "fastrpe-sdpa", "fastrpe-flex")
#: the lengths `check` reads: every family at the first two, the learned tables' Flex ratio at
#: the third, the memory and time limits at the last
L_SHORT, L_CHECK, L_LONG, L_MAX = 4096, 65536, 262144, 1048576
#: `fastrpe bench --suite gpu` exits with this when a row broke the CUDA context: run it again
#: with --resume (benchmarks/gpu_run.sh does, while its time lasts)
CONTEXT_LOST_EXIT = 75
#: the rows of KERPLE log's and power's criteria (the same backends)
_KERPLE_ROWS = ("flex", "fastrpe-triton_soe", "fastrpe-triton_soe+saved-states",
                "fastrpe-triton_soe+saved-states+blocked-scan", "fastrpe-auto",
                "fastrpe-triton_soe+compiled", "flex+cudagraphs", "fastrpe-triton_soe+cudagraphs",
                "fastrpe-triton_soe+blocked-scan+cudagraphs", "fastrpe-triton_soe+compiled+cudagraphs",
                "fastrpe-triton_soe+bf16x3", "fastrpe-triton_soe+saved-states+bf16x3",
                "fastrpe-triton_soe+walk", "fastrpe-triton_soe+walk+bf16x3",
                "fastrpe-triton_soe+saved-states+stacked-states", "fastrpe-triton_soe+saved-states+bf16x3+stacked-states",
                "fastrpe-triton_soe+saved-states+fused-maps", "fastrpe-triton_soe+saved-states+bf16x3+fused-maps",
                "fastrpe-triton_soe+saved-states+stacked-states+fused-maps")
#: the rows of the learned tables' criteria, causal and not
_TABLE_ROWS = ("flex", "fastrpe-triton_tiled", "fastrpe-fft", "fastrpe-auto", "fastrpe-triton_tiled+compiled",
               "flex+cudagraphs", "fastrpe-triton_tiled+cudagraphs", "fastrpe-triton_tiled+bf16-features+cudagraphs",
               "fastrpe-triton_tiled+compiled+cudagraphs", "fastrpe-triton_tiled+bf16-features",
               "fastrpe-triton_tiled+bf16x3", "fastrpe-triton_tiled+bf16x3+cudagraphs", "fastrpe-fft+lag-kernels",
               "fastrpe-fft+chunk-recursion")
#: the competitors `check` reads, per family (SDPA: the ratios' ceiling). The suite runs these
#: first, at the lengths `reads` names, and the rest after: the first H100 call spent its budget
#: on two rows of 4,096 tokens, and fla's chunk_linear_attn, which no criterion reads, autotuned
#: for over 60 s in its first call
CRITERIA_ROWS = {
    "none": ("sdpa",),
    "alibi": ("fla-chunk_simple_gla", "flex", "fastrpe-triton_chunked", "fastrpe-triton_chunked+sequential-scan",
              "fastrpe-auto", "fastrpe-triton_chunked+compiled", "flex+cudagraphs", "fastrpe-triton_chunked+cudagraphs",
              "fastrpe-triton_chunked+blocked-scan+cudagraphs", "fastrpe-triton_chunked+compiled+cudagraphs",
              "fastrpe-triton_chunked+bf16-features", "fastrpe-triton_chunked+bf16x3",
              "fastrpe-triton_chunked+bf16x3+fused-maps"),
    "kerple_log": _KERPLE_ROWS,
    "kerple_power": _KERPLE_ROWS,
    "t5": ("flex", "fastrpe-triton_band", "fastrpe-triton_band+sequential-scan", "fastrpe-auto",
           "fastrpe-triton_band+compiled", "flex+cudagraphs", "fastrpe-triton_band+cudagraphs",
           "fastrpe-triton_band+blocked-scan+cudagraphs", "fastrpe-triton_band+compiled+cudagraphs",
           "fastrpe-triton_band+bf16x3", "fastrpe-triton_band+bf16x3+fused-maps"),
    "learned": _TABLE_ROWS,
    "learned_full": _TABLE_ROWS,
}
# (`+bf16-features` for the exact families whose criteria the float32 features' tf32x3 products
# may cost: triton_tiled's quadratic loop multiplies float32 operands by three tf32 passes, 6x
# a bf16 pass each, and was 282 ms at 64k against Flex + table's 131 (H100, 2026-11-26/27);
# the rows' `max_abs_err` says what the rounding costs. KERPLE's are left out: their 1e-3 is
# judged on float32 inputs, which the bf16 features never see. `+bf16x3` everywhere: the same
# float32 features multiplied by bf16 halves, 16 significant bits, half of tf32x3's tensor-core
# passes; stopped by a Triton miscompile on the H100 of 2026-11-27 that the kernels
# no longer give it (`triton_chunked.HOPPER_TRANS_NOTE`); timed for KERPLE, not counted there:
# see PRECISION_VARIANTS. Since 2026-11-28 bf16x3 is the library's default for 16-bit calls, and
# the plain rows set tf32x3 themselves: `fastrpe_setup`)
#: the suffix of fastrpe's rows under `torch.compile`, the backends that have them, and the
#: compiler (Inductor, as Flex's; the CPU tests trace with "aot_eager", which generates no code)
COMPILED = "+compiled"
COMPILE_BACKEND = "inductor"
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
#: the `+saved-states` rows' bound on the states triton_soe keeps for its backward
#: (`triton_soe.SAVE_STATES_BYTES`): KERPLE-log's 16 terms take 0.54 GB at 64k (B·H = 8, bf16)
SAVED_STATES_BYTES = 2 << 30
COMPILED_BACKENDS = ("triton_chunked", "triton_soe", "triton_band", "triton_tiled")
#: the suffix of the rows replayed from CUDA graphs, up to `compiled_max_length`, in a run whose
#: compile mode is the default: `flex+cudagraphs` and `fastrpe-<backend>+cudagraphs` capture the
#: call as it runs in their twin rows (compiled Flex; fastrpe's eager call) and time its replay
#: (`captured`), and fastrpe's `+compiled+cudagraphs` rows compile with mode="reduce-overhead".
#: At 4k both sides are mostly host time eager (fastrpe's Triton rows were 14-44% GPU busy on
#: the H100, Flex 18%); these rows give the like-with-like answer with graphs in the same run
#: (`check` reads both pairings). Before the CPU session after the fourth H100 one,
#: `flex+cudagraphs` compiled Flex again with mode="reduce-overhead" for every family, after
#: the eager rows, and no session reached it.
GRAPHED = "+cudagraphs"


#: the variant rows that change how a bf16 call's features are rounded or multiplied
#: (`backends_triton.LOWP_FEATURES`, `FLOAT32_PRODUCTS`). A float32 call keeps the default's
#: exact products, so such a row's `max_abs_err_fp32` is its twin's, not its own. Where a
#: tolerance is judged on float32 inputs (KERPLE's 1e-3), `best_fastrpe` counts such a row only
#: if its own error with bf16 inputs (`max_abs_err`, its products at work) is no larger than its
#: twin's on the same problem (`precision_twin`): then its products add nothing the bf16 call
#: does not lose anyway, and the float32 error, the fit's, is the twin's. (The sixth H100
#: session: bf16x3's KERPLE rows at 64k had their twins' bf16 errors to the last bit, 9.7e-4 and
#: 7.6e-3; bf16 features' ALiBi row 1.6e-2 against 3.9e-3.)
PRECISION_VARIANTS = ("+bf16-features", "+bf16x3")


def precision_twin(name: str) -> str | None:
    """The row a `PRECISION_VARIANTS` row varies (its name without the variant), or None for
    another row."""
    for v in PRECISION_VARIANTS:
        if v in name:
            return name.replace(v, "", 1)
    return None


def compiled_row(name: str) -> bool:
    """A row whose call runs under `torch.compile` (it compiles for long: pass 1). fastrpe's
    `+cudagraphs` rows without `+compiled` capture their eager call (`captured`): nothing to
    compile but their twin's kernels."""
    return name.endswith((COMPILED, COMPILED + GRAPHED))


def base_competitor(name: str) -> str:
    """The eager row a compiled row runs the kernels of (its accuracy is that row's)."""
    return name.removesuffix(GRAPHED).removesuffix(COMPILED)


def row_pass(p: Problem, name: str) -> int:
    """Which of the suite's three passes runs a row: 0, the rows the criteria read (`reads`);
    1, those of them under `torch.compile` (compiling takes long: the eager rows of every
    length are in before it starts); 2, every other row."""
    if not reads(p, name):
        return 2
    return 1 if compiled_row(name) else 0


def reads(p: Problem, name: str) -> bool:
    """Whether `check` reads the row of competitor `name` on problem `p` (at lengths it does
    not know, as in a smoke run, every criteria competitor counts)."""
    if name not in CRITERIA_ROWS.get(p.position, ()):
        return False
    learned = p.position in ("learned", "learned_full")
    if p.L == L_LONG:
        return learned  # >= 4x faster than Flex at 262,144
    if p.L == L_MAX:  # 40 GiB (tables), 60 ms and 8 GiB (decaying terms): fastrpe's own rows
        return name.startswith("fastrpe-") and (learned or p.position in DECAYING)
    return True


@dataclass
class GpuConfig:
    """What the suite runs. The defaults are the issue's problem on a GPU."""

    lengths: tuple = DEFAULT_LENGTHS
    families: tuple = FAMILIES
    B: int = 1
    H: int = 8
    D: int = 64
    features: int = 32
    kernel: str = "nprf"
    dtype: str = "bfloat16"
    repeats: int = 10
    warmup: int = 2
    time_limit_s: float = 2.0  # a warm call slower than this: timed once (longer lengths: see run_suite)
    call_cap_s: float = 180.0  # hard cap on one call, compilation included (interrupts Python between launches)
    budget_s: float | None = None  # stop starting new rows after this many seconds (resume later)
    accuracy_length: int = 65536
    accuracy_rows: int = 32
    decode_context: int = 65536
    decode_prompt: int = 2048  # tokens that build the constant-size states (see `decode_rows`)
    sync_length: int = 4096
    flex_max_length: int = 262144  # no criterion needs Flex beyond (its 1M call takes minutes)
    #: fastrpe's `+compiled` rows up to this length: below it an eager call is mostly host time
    #: (the 2026-11-26 H100 rows at 4,096), beyond it the kernels' own
    compiled_max_length: int = 16384
    #: `torch.compile`'s mode for those rows and for the Flex baseline alike ("default";
    #: "reduce-overhead" adds CUDA graphs to both: at 4k both are partly host time)
    compile_mode: str = "default"
    #: what runs, in this order: the host-sync check, the decoding rows, the timed rows (all of
    #: them under `budget_s`: a section cut short resumes where it stopped)
    sections: tuple = SECTIONS
    #: the passes of the rows section this run takes (`row_pass`): a priority call of
    #: gpu_run.sh takes the criteria's rows (0, 1) and leaves the others' (2) to the general one
    passes: tuple = (0, 1, 2)
    #: the competitors this run times: names matching one of `only` (fnmatch patterns; empty:
    #: every one) and none of `skip`. gpu_run.sh times fla's rows in a process of their own,
    #: with another triton (benchmarks/fla_site.sh), and the rest with `skip=("fla-*",)`
    only: tuple = ()
    skip: tuple = ()
    #: the warm-up (`--warm`) compiles the rows matching these patterns first (`row_matches`:
    #: "name" or "name@L"): those the run times first (gpu_run.sh's priority rows)
    warm_first: tuple = ()
    smoke: bool = False
    device: str = "cuda"

    def to_dict(self) -> dict:
        return asdict(self)


def smoke_config(**overrides) -> GpuConfig:
    """Toy sizes on CPU: the suite's code path in seconds, numbers meaningless."""
    kw = dict(lengths=(48, 96), B=1, H=2, D=16, features=8, dtype="float32", repeats=1, warmup=0,
              time_limit_s=30.0, call_cap_s=None, accuracy_length=96, accuracy_rows=8, decode_context=128,
              decode_prompt=40, sync_length=64, smoke=True, device="cpu")
    kw.update(overrides)
    return GpuConfig(**kw)


# ----------------------------------------------------------------------------- problems


def family_causal(family: str) -> bool:
    return family != "learned_full"


def make_position(family: str, H: int, L: int):
    """The positional term of a family, with fixed (seeded) parameters, frozen."""
    import fastrpe as fr

    g = torch.Generator().manual_seed(1)
    if family == "none":
        return None
    if family == "alibi":
        pos = fr.positions.ALiBi(H)
    elif family == "kerple_log":
        pos = fr.positions.KerpleLog(H)
    elif family == "kerple_power":
        # exponents spread over (0, 2) as the paper initializes them (p = 1 alone would be ALiBi)
        pos = fr.positions.KerplePower(H, p=torch.linspace(0.5, 1.5, H))
    elif family == "t5":
        pos = fr.positions.T5Bias(H, bidirectional=False)
        with torch.no_grad():
            pos.embedding.copy_(torch.randn(pos.embedding.shape, generator=g))
    elif family in ("learned", "learned_full"):
        # an arbitrary table over all offsets: nothing to clip, nothing decays
        pos = fr.positions.LearnedTable(H, max_distance=max(L - 1, 0), causal=family_causal(family))
        with torch.no_grad():
            pos.table.copy_(torch.randn(pos.table.shape, generator=g))
    else:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    return pos.requires_grad_(False)


def problems(cfg: GpuConfig) -> list[Problem]:
    """Every (length, family) problem, shortest lengths first (a run cut short has them)."""
    out = []
    for L in sorted(cfg.lengths):
        for fam in ("none", *cfg.families):
            out.append(Problem(position=fam, kernel=cfg.kernel, causal=family_causal(fam), L=L, B=cfg.B, H=cfg.H,
                               D=cfg.D, features=cfg.features, backward=True))
    return out


def _qkv(p: Problem, device, dtype, layout: str = "bhld", k_width: int | None = None):
    """Seeded inputs, `[B, H, L, D]` (or fla's `[B, L, H, K]`), requiring grad."""
    g = torch.Generator(device="cpu").manual_seed(0)
    kw = p.D if k_width is None else k_width

    def one(width):
        shape = (p.B, p.H, p.L, width) if layout == "bhld" else (p.B, p.L, p.H, width)
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype).requires_grad_(p.backward)

    return one(kw), one(kw), one(p.D)


def _closure(fn, q, k, v, backward: bool):
    """One timed call: `fn(q, k, v)`, and with `backward` its `.float().sum().backward()`.
    The backward holds no reference to the output, as a model's layer does not (its next op
    keeps what it needs): each method keeps its output only as long as its own autograd
    does (SDPA, Flex and fla save it for their backward; fastrpe's Triton paths free it
    before their kernels' backward, `triton_chunked._QuotientGrad`), so the peak compares
    like for like.

    Each backward call starts from no gradients, as a training step after
    `zero_grad(set_to_none=True)`: nothing is added to the last call's (an accumulation
    kernel per input no method needs), and no call reads a gradient the last one left. Under
    CUDA graphs (`+cudagraphs`) that gradient is an output of the graph's previous replay,
    which the next replay overwrites: accumulating into it raised "accessing tensor output of
    CUDAGraphs that has been overwritten" on the H100 (2026-11-27, `flex+cudagraphs`)."""
    def run():
        if backward:
            q.grad = k.grad = v.grad = None
            fn(q, k, v).float().sum().backward()
            return None
        return fn(q, k, v)

    return run


# ----------------------------------------------------------------------------- competitors

_FLEX_COMPILED: dict = {}


def _flex_compiled(mode: str = "default"):
    """One `torch.compile(flex_attention)` per compile mode; the recompile limit raised (a
    shape or score_mod per problem) and, where torch allows, made an error rather than a silent
    eager fallback."""
    if mode not in _FLEX_COMPILED:
        from torch.nn.attention.flex_attention import flex_attention

        raise_recompile_limits()
        _FLEX_COMPILED[mode] = torch.compile(flex_attention, dynamic=False,
                                             **({} if mode == "default" else {"mode": mode}))
    return _FLEX_COMPILED[mode]


def raise_recompile_limits() -> None:
    """Dynamo's recompile limits raised (the suite compiles one graph per problem) and, where
    torch allows, reaching one made an error rather than a silent eager fallback."""
    cfg = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 1024))
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True


_BENCH_MASKS: dict = {}


def causal_block_mask(L: int, device, compiled: bool = True) -> tuple[object, str]:
    """The causal `BlockMask` for `L × L` as a user builds it, and how: `create_block_mask`,
    compiled where this torch offers it (the plain one materializes the `[L, L]` mask and runs
    out of memory first). Cached for the last length. fastrpe's own `flex` backend builds the
    same blocks from their indices (`ops.softmax.flex.causal_block_mask`)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    key = (L, str(device), compiled)
    if key not in _BENCH_MASKS:
        _BENCH_MASKS.clear()  # at 1M tokens a mask's block indices take ~1 GB
        made = None
        if compiled:
            try:
                made = (create_block_mask(causal, None, None, L, L, device=device, _compile=True),
                        "create_block_mask(_compile=True)")
            except TypeError:  # no _compile argument in this torch
                pass
        _BENCH_MASKS[key] = made or (create_block_mask(causal, None, None, L, L, device=device), "create_block_mask")
    return _BENCH_MASKS[key]


#: The compiled Flex baseline's kernel options, tried in turn while compilation runs out of
#: shared memory: Inductor's own, then its tiles in 2 stages, then fastrpe's `flex` backend's
#: choice for gathering score_mods (`ops.softmax.flex.GATHER_KERNEL_OPTIONS`)
FLEX_OPTIONS_CHAIN = (None, {"num_stages": 2}, GATHER_KERNEL_OPTIONS)


def _warm_on_side_stream(fn, device: torch.device, calls: int = 3) -> None:
    """`calls` calls of `fn` on a side stream: compilation, autotuning and kept tables happen
    there, off the capture stream, as `torch.cuda.graphs` asks before a capture."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)


def _capture(fn) -> torch.cuda.CUDAGraph:
    """One call of `fn` captured in a CUDA graph (after `_warm_on_side_stream`)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def capture_graph(fn, device: torch.device) -> torch.cuda.CUDAGraph:
    """`fn()` captured in a CUDA graph, after three calls on a side stream."""
    _warm_on_side_stream(fn, device)
    return _capture(fn)


def captured(run, device: torch.device):
    """`run` (a timed call, forward and backward) replayed from one CUDA graph, captured as
    `capture_graph` does. A replay runs the same kernels on the same
    buffers without Python or launches: what a training step captured whole (or compiled with
    mode="reduce-overhead") pays. The gradients are outputs of the graph, rewritten by each
    replay. The graph's memory pool is taken at the capture, before the timed calls: such a row's
    `peak_bytes` leaves it out. A call that synchronizes with the host, or sizes anything from
    device values, cannot be captured: then the reason, which the row records as a refusal
    (not an error: a resumed run does not measure the problem's other rows again for it)."""
    from .runner import _first_line

    _warm_on_side_stream(run, device)  # an error here is the call's own: the row records it
    try:
        graph = _capture(run)
    except Exception as e:  # noqa: BLE001 - recorded: the row says why the call cannot be captured
        why = f"could not be captured in a CUDA graph: {_first_line(e)}"
        try:
            torch.cuda.synchronize(device)
        except Exception as after:  # noqa: BLE001 - a broken context: said, and the next row's error says so too
            why += f" (and then {_first_line(after)})"
        return why

    def replay():
        graph.replay()

    replay.graph = graph  # alive as long as the row's call
    replay.extra = {**getattr(run, "extra", {}), "cuda_graph": "the call captured once, its replay timed "
                    "(torch.cuda.CUDAGraph; its memory pool is not in peak_bytes)"}
    if hasattr(run, "after"):
        replay.after = run.after
    return replay


def first_that_fits(calls: list, labels: list, used: dict):
    """A call running `calls[0]`, and from then on the next of `calls` each time one fails to
    compile for want of resources ("out of resource": shared memory), any other error raised.
    `used["kernel_options"]` says which runs (`labels`), `used["refused"]` what ran out."""
    state = {"i": 0}

    def run():
        while True:
            try:
                return calls[state["i"]]()
            except Exception as e:
                if "out of resource" not in str(e) or state["i"] + 1 >= len(calls):
                    raise
                used.setdefault("refused", []).append(_flex_refusal(e))
                state["i"] += 1
                used["kernel_options"] = labels[state["i"]]
    return run


def _flex_refusal(e: BaseException) -> str:
    """The line of a compile error that says what ran out ("out of resource: ... Required: N")."""
    text = str(e)
    i = text.find("out of resource")
    return text[i:i + 160].split("Reducing")[0].strip() if i >= 0 else text.splitlines()[0][:160]


def flex_setup(smoke: bool, max_length: int, compile_mode: str = "default", cap: str = "--flex-max-length",
               graphed: bool = False):
    """Compiled FlexAttention with the family's score_mod (and a causal block mask), in
    `compile_mode`, the mode fastrpe's `+compiled` rows run in too (like with like); not beyond
    `max_length` (the option `cap` sets it); `graphed`: the call replayed from a CUDA graph
    (`captured`; `flex+cudagraphs`)."""
    def setup(p: Problem, device, dtype):
        try:
            from torch.nn.attention.flex_attention import flex_attention
        except ImportError:
            return "FlexAttention is not in this PyTorch"
        if p.position == "none":
            return "no positional term (see sdpa)"
        if p.L > max_length:
            return f"not run beyond L={max_length} (no criterion needs it; {cap})"
        if graphed and device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        if device.type != "cuda" and not smoke:
            return "needs CUDA (eager Flex on CPU is not a baseline)"
        pos = make_position(p.position, p.H, p.L).to(device)
        mod = pos.score_mod(0)
        extra = {"score_mod": type(pos).__name__}
        backward = p.backward
        if device.type == "cuda":
            fn = _flex_compiled(compile_mode)
            extra["flex"] = "torch.compile(flex_attention, dynamic=False" + (
                ")" if compile_mode == "default" else f", mode={compile_mode!r})")
        else:
            fn = flex_attention
            extra["flex"] = "EAGER FlexAttention (smoke mode only; not a baseline)"
            if backward:
                backward = False
                extra["note"] = "forward only: FlexAttention has no backward on CPU"
        bm = None
        if p.causal:
            bm, how = causal_block_mask(p.L, device, compiled=device.type == "cuda")
            extra["block_mask"] = how
        q, k, v = _qkv(replace(p, backward=backward), device, dtype)
        # Inductor's tiles first; where they do not fit in shared memory (a score_mod that
        # gathers from a table did not, on the H100), the next options: the fastest that compiles
        chain = FLEX_OPTIONS_CHAIN if device.type == "cuda" else (None,)

        def flex_with(opts):
            kw = {"kernel_options": dict(opts)} if opts else {}

            def flex(q, k, v):
                if device.type == "cuda":
                    return fn(q, k, v, score_mod=mod, block_mask=bm, **kw)
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # eager-mode advice (smoke only)
                    return fn(q, k, v, score_mod=mod, block_mask=bm, **kw)
            return _closure(flex, q, k, v, backward)

        extra["flex_tiles"] = {"kernel_options": "Inductor's default"}  # the row holds this dict
        skips = cudagraph_skips_mark()
        run = first_that_fits([flex_with(o) for o in chain], [o or "Inductor's default" for o in chain],
                              extra["flex_tiles"])
        run.extra = extra
        run.after = lambda: cudagraph_skips_since(skips)
        return captured(run, device) if graphed else run

    return setup


def sdpa_setup(p: Problem, device, dtype):
    if p.position != "none":
        return "SDPA here is the ceiling without a positional term (family none)"
    q, k, v = _qkv(p, device, dtype)
    run = _closure(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=p.causal),
                   q, k, v, p.backward)
    run.extra = {"note": "no positional term"}
    return run


def fla_version() -> str | None:
    try:
        import fla

        return getattr(fla, "__version__", "unknown")
    except Exception:  # noqa: BLE001 - absent or broken: the fla rows say why
        return None


#: fla's modules whose autotuned kernels tile K and V (`BK`, `BV` configs): chunk_simple_gla's and
#: chunk_linear_attn's forward output and chunk-state kernels
FLA_TILED_MODULES = ("fla.ops.common.chunk_o", "fla.ops.common.chunk_h")
#: "0" keeps fla's own configs (`prune_fla_oversized_tiles`)
FLA_PRUNE_ENV = "FASTRPE_FLA_PRUNE"


def fla_tile_prune(configs, nargs, **kwargs):
    """fla's own rule for its GLA backward (fla-org/flash-linear-attention#989, after fla-core
    0.6.0): a config keeps a `BK` (`BV`) tile only if it is below K (V) or the smallest offered
    (for BV: the smallest among the configs the BK rule kept, so that one is always left),
    because a tile the size of the dimension or larger leaves the loop over it one iteration,
    and Triton's pipelined block-pointer loads then read a tile past the tensor (an illegal
    memory access on H100 even with boundary checks). All configs if none is left."""
    args = {**(nargs or {}), **kwargs}
    keep = list(configs)
    for tile, dim in (("BK", "K"), ("BV", "V")):
        sizes = [c.kwargs[tile] for c in keep if tile in c.kwargs]
        if not sizes or not isinstance(args.get(dim), int):
            continue
        keep = [c for c in keep if tile not in c.kwargs or c.kwargs[tile] < args[dim] or c.kwargs[tile] == min(sizes)]
    return keep or list(configs)


def prune_fla_oversized_tiles(modules: tuple[str, ...] = FLA_TILED_MODULES) -> list[str]:
    """`fla_tile_prune` on the autotuned kernels of `modules` that offer `BK`/`BV` configs and
    have no pruning of their own (again: the same); returns their names (a row's `fla_pruned`).
    Why: fla-core 0.6.0's `chunk_fwd_kernel_o` offers BK = BV = 128 and 64 at three pipeline
    stages on Hopper, and the bench's fla rows take K = 32 features (V = 64), where those
    tiles cover the whole dimension in one iteration: the case fla's #989 traced to illegal
    memory accesses on H100. chunk_simple_gla broke the CUDA context there on 2026-11-26 (triton
    3.6) and -27 (3.7.1), at 4,096 tokens, in a kernel not yet named. A pruned config is one
    whose tile is mostly padding at K = 32, so the autotuner loses little; `FASTRPE_FLA_PRUNE=0`
    keeps fla's own (the probe's unpruned variant)."""
    import os
    import sys

    from triton.runtime.autotuner import Autotuner

    if os.environ.get(FLA_PRUNE_ENV, "1") == "0":
        return []
    done = []
    # the modules fla's entry points imported (another fla's layout: none, nothing pruned)
    for name, mod in ((n, sys.modules.get(n)) for n in modules):
        for attr, obj in (vars(mod) if mod is not None else {}).items():
            while obj is not None and not isinstance(obj, Autotuner) and hasattr(obj, "fn"):
                obj = obj.fn  # under `triton.heuristics`, as fla's kernels are
            if not isinstance(obj, Autotuner) or not any("BK" in c.kwargs or "BV" in c.kwargs for c in obj.configs):
                continue
            if obj.early_config_prune is None:
                obj.early_config_prune = fla_tile_prune
            if obj.early_config_prune is fla_tile_prune:
                done.append(f"{name.rsplit('.', 1)[-1]}.{attr}")
    return done


def _fla_import(name: str):
    """(function, None) or (None, why not)."""
    try:
        if name == "chunk_simple_gla":
            from fla.ops.simple_gla import chunk_simple_gla as f
        else:
            from fla.ops.linear_attn import chunk_linear_attn as f
        return f, None
    except Exception as e:  # noqa: BLE001
        return None, f"flash-linear-attention (fla-core) not importable: {type(e).__name__}: {e}"


def fla_simple_gla_setup(p: Problem, device, dtype):
    """fla's `chunk_simple_gla` with ALiBi's per-head log-decay `g_gamma = -m` (`[H]`),
    `[B, T, H, K]` inputs, K = features, no normalizer."""
    if p.position != "alibi":
        return "geometric decay: runs on the alibi family"
    f, why = _fla_import("chunk_simple_gla")
    if why:
        return why
    if device.type != "cuda":
        return "fla's Triton kernels need CUDA"
    from fastrpe.positions import alibi_slopes

    g_gamma = -torch.tensor(alibi_slopes(p.H), dtype=torch.float32, device=device)  # log γ_h per step
    q, k, v = _qkv(p, device, dtype, layout="blhd", k_width=p.features)
    run = _closure(lambda q, k, v: f(q, k, v, g_gamma=g_gamma, scale=p.features ** -0.5)[0], q, k, v, p.backward)
    run.extra = {"layout": "[B, T, H, K]", "K": p.features, "note": "geometric decay (ALiBi slopes), no normalizer",
                 "fla_pruned": prune_fla_oversized_tiles()}
    return run


def fla_linear_attn_setup(p: Problem, device, dtype):
    """fla's `chunk_linear_attn(normalize=True)` without a decay, `[B, T, H, K]`, K = features."""
    if p.position != "none":
        return "no positional term: runs on the family none"
    f, why = _fla_import("chunk_linear_attn")
    if why:
        return why
    if device.type != "cuda":
        return "fla's Triton kernels need CUDA"
    q, k, v = _qkv(p, device, dtype, layout="blhd", k_width=p.features)
    run = _closure(lambda q, k, v: f(q, k, v, scale=p.features ** -0.5, normalize=True)[0], q, k, v, p.backward)
    run.extra = {"layout": "[B, T, H, K]", "K": p.features, "note": "normalized, no positional term",
                 "fla_pruned": prune_fla_oversized_tiles()}
    return run


def _kernel(p: Problem, device):
    import fastrpe as fr

    kern = fr.kernels.get_kernel(p.kernel, head_dim=p.D, num_features=p.features)
    return kern.to(device) if isinstance(kern, torch.nn.Module) else kern


def sample_rows(L: int, n: int) -> torch.Tensor:
    """`n` query rows spread over `0..L-1`, the first and the last included."""
    return torch.unique(torch.linspace(0, L - 1, max(min(n, L), 1)).round().long())


def sampled_reference(kern, pos, q, k, v, rows: torch.Tensor, causal: bool) -> torch.Tensor:
    """Kernelized attention with RPE at query rows `rows` in float64, from Luo et al.,
    "Stable, Fast and Accurate: Kernelized Attention with Relative Positional Encoding"
    (NeurIPS 2021), Eq. 10: `out_i = Σ_j φ(q_i)·φ(k_j)·c(j-i)·v_j / Σ_j φ(q_i)·φ(k_j)·c(j-i)`,
    `c = exp(b)`, causal keeping `j ≤ i`. One `[H, rows, L]` weight block, not `L × L`.
    Returns `[B, H, len(rows), Dv]`."""
    L = k.shape[2]
    rows = rows.to(q.device)
    with torch.no_grad():
        pq = kern(q[:, :, rows].double(), is_query=True)  # (B, H, n, F)
        pk = kern(k.double(), is_query=False)  # (B, H, L, F)
        w = torch.einsum("bhnf,bhlf->bhnl", pq, pk)
        if pos is not None:
            j = torch.arange(L, device=q.device)
            r = j[None, :] - rows[:, None]  # (n, L): key minus query position
            h = torch.arange(q.shape[1], device=q.device)[:, None, None]
            b = pos.bias(h, r[None]).double()  # (H, n, L)
            if causal:
                b = b.masked_fill(r[None] > 0, float("-inf"))
            b = b - b.amax(-1, keepdim=True).clamp_min(-1e300)  # any constant cancels (Eq. 10)
            w = w * torch.exp(b)[None]
        elif causal:
            w = w.masked_fill((torch.arange(L, device=q.device)[None, :] > rows[:, None])[None, None], 0.0)
        num = torch.einsum("bhnl,bhld->bhnd", w, v.double())
        den = w.sum(-1, keepdim=True)
        return num / den


def fastrpe_setup(backend: str, cfg: GpuConfig, lowp_features: str | None = None, state_scan: str | None = None,
                  compiled: bool = False, mode: str | None = None, saved_states: int | None = None,
                  graphed: bool = False, float32_products: str | None = None, far_field: str | None = None,
                  fused_maps: bool | None = None, state_terms: int | None = None, lag_kernels: bool = False,
                  chunk_recursion: bool = False):
    """`fastrpe.attention(backend=backend)`; `lowp_features` sets the Triton backends'
    `backends_triton.LOWP_FEATURES` for its calls (the variant rows `+bf16-features`),
    `float32_products` their `FLOAT32_PRODUCTS` (`+bf16x3`; "tf32x3" where None for a Triton
    backend; `auto` takes the library's default),
    `state_scan` triton_chunked's `STATE_SCAN` (`+sequential-scan`, `+blocked-scan`; a backward keeps its
    forward's); `compiled`, the call under `torch.compile(fullgraph=True, dynamic=False)`
    (`+compiled`: Flex's treatment; the kernels are custom ops in the graph,
    `triton_chunked.compile_opaque`), up to `cfg.compiled_max_length`, in `mode` (default:
    `cfg.compile_mode`; `+compiled+cudagraphs`: "reduce-overhead"); `saved_states`, triton_soe's
    `SAVE_STATES_BYTES` (`+saved-states`: the forward's states kept for the backward); `far_field`,
    its `FAR_FIELD` (`+walk`: the far field walked in blocks, no stored states); `fused_maps`,
    `backends_triton.FUSED_MAPS` (`+fused-maps`: the PRF maps' backward in the gradient kernels
    of triton_chunked, `triton_chunked_prf`, and of triton_soe and triton_band, `triton_soe_prf`);
    `state_terms`, triton_soe's `STATE_TERMS`
    (`+stacked-states`: several terms' states a program in the chunk-state passes,
    `triton_soe_stacked`); `lag_kernels`, the FFT path's `fft.blocked.KERNEL = "cuda"`
    (`+lag-kernels`: the causal blocked product's sums over chunks in Triton kernels on the
    spectra as cuFFT writes them, `fft/triton_blocked.py`); `chunk_recursion`, the FFT path's
    `fft.causal.LOCAL = "never"` (`+chunk-recursion`: each chunk's own pairs by the halving
    recursion and dense leaves, the path before they went through `triton_tiled`); `graphed`, the
    eager call replayed from a CUDA graph (`captured`; `+cudagraphs`), up to
    `cfg.compiled_max_length`."""
    mode = cfg.compile_mode if mode is None else mode
    if float32_products is None and backend.startswith("triton_"):
        float32_products = "tf32x3"  # (the rows' meaning since before the library's default changed)

    def setup(p: Problem, device, dtype):
        import fastrpe as fr
        from fastrpe.api import _problem
        from fastrpe.backends_triton import use_float32_products, use_fused_maps, use_lowp_features
        from fastrpe.dispatch import BACKENDS, explain_problem, select_backend
        from fastrpe.ops.linear.triton_chunked import use_state_scan
        from fastrpe.ops.linear.fft.blocked import use_kernel
        from fastrpe.ops.linear.fft.causal import use_local
        from fastrpe.ops.linear.triton_soe import use_far_field, use_saved_states, use_state_terms

        if p.position == "none":
            return "runs the positional families"
        if backend == "triton_tiled" and p.L > cfg.flex_max_length:
            # quadratic, as Flex: at 1M a forward+backward would take tens of seconds
            return f"not run beyond L={cfg.flex_max_length} (quadratic time, as Flex; --flex-max-length)"
        if (compiled or graphed) and p.L > cfg.compiled_max_length:
            return f"not run beyond L={cfg.compiled_max_length} (--compiled-max-length)"
        if graphed and device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        pos = make_position(p.position, p.H, p.L).to(device)
        kern = _kernel(p, device)
        q, k, v = _qkv(p, device, dtype)
        extra = {}
        try:
            prob, _ = _problem(q, k, v, kern, pos, p.causal, None, None, None)
        except fr.FastRPEError as e:
            return str(e)
        if backend == "auto":
            if explain_problem(prob, eligible_only=True).chosen is None:
                return "auto: no backend supports this call"
            # what the timed calls will run: under the "measure" policy (CUDA's default) this
            # first call times the candidates and caches the fastest, which the model may not rank first
            chosen = select_backend(prob, "auto", inputs=(q, k, v, None)).name
            extra.update(auto_picks=chosen, exact=BACKENDS[chosen].exact)
        else:
            b = BACKENDS.get(backend)
            if b is None:
                return f"backend {backend!r} is not registered"
            reasons = b.not_supported_reasons(prob)
            if reasons:
                return "; ".join(reasons)
            extra["exact"] = b.exact

        def attend(q, k, v):  # (what `+compiled` compiles: the settings stay outside the graph)
            return fr.attention(q, k, v, kernel=kern, position=pos, causal=p.causal, backend=backend)

        def call(q, k, v):
            with contextlib.ExitStack() as stack:
                if lowp_features is not None:
                    stack.enter_context(use_lowp_features(lowp_features))
                if float32_products is not None:
                    stack.enter_context(use_float32_products(float32_products))
                if state_scan is not None:
                    stack.enter_context(use_state_scan(state_scan))
                if saved_states is not None:
                    stack.enter_context(use_saved_states(saved_states))
                if far_field is not None:
                    stack.enter_context(use_far_field(far_field))
                if fused_maps is not None:
                    stack.enter_context(use_fused_maps(fused_maps))
                if state_terms is not None:
                    stack.enter_context(use_state_terms(state_terms))
                if lag_kernels:
                    stack.enter_context(use_kernel("cuda"))
                if chunk_recursion:
                    stack.enter_context(use_local("never"))
                return attend(q, k, v)

        if lowp_features is not None:
            extra["lowp_features"] = lowp_features
        if float32_products is not None:
            extra["float32_products"] = float32_products
        if state_scan is not None:
            extra["state_scan"] = state_scan
        if saved_states is not None:
            extra["saved_states_bytes"] = saved_states
        if far_field is not None:
            extra["far_field"] = far_field
        if fused_maps is not None:
            extra["fused_maps"] = fused_maps
        if state_terms is not None:
            extra["state_terms"] = state_terms
        if lag_kernels:
            extra["lag_kernels"] = "cuda"
        if chunk_recursion:
            extra["chunk_recursion"] = True
        skips = cudagraph_skips_mark()
        if compiled:
            raise_recompile_limits()
            opts = {"fullgraph": True, "dynamic": False, "backend": COMPILE_BACKEND}
            if mode != "default":
                opts["mode"] = mode
            attend = torch.compile(attend, **opts)
            args = ", ".join(f"{k}={v!r}" for k, v in opts.items())
            extra["compiled"] = f"torch.compile(fastrpe.attention, {args})"

        if p.L == cfg.accuracy_length:
            extra.update(accuracy(call, kern, pos, q, k, v, p.causal, cfg.accuracy_rows))
        run = _closure(call, q, k, v, p.backward)
        run.extra = extra
        before = autotuned()
        run.after = lambda: {**_new_choices(before, autotuned()), **cudagraph_skips_since(skips)}
        return captured(run, device) if graphed else run

    return setup


#: Inductor's warnings that it runs a graph without CUDA graphs, as this process logged them
#: since `cudagraph_skips_mark` first ran
_CUDAGRAPH_SKIPS: list[str] = []
_CUDAGRAPH_WATCH: list = []


def cudagraph_skips_mark() -> int:
    """How many "skipping cudagraphs due to ..." warnings Inductor has logged so far (watched
    from the first call on, once per process). Under mode="reduce-overhead" a graph Inductor
    cannot capture runs without CUDA graphs, and only that log line says so: the `+compiled`
    and Flex rows record theirs (`cudagraph_skips_since`)."""
    if not _CUDAGRAPH_WATCH:
        import logging

        try:
            from torch._inductor.cudagraph_utils import cudagraphs_log
        except Exception:  # noqa: BLE001 - another torch: nothing to watch
            cudagraphs_log = None

        class Keep(logging.Handler):
            def emit(self, record):
                _CUDAGRAPH_SKIPS.append(record.getMessage().strip().splitlines()[0][:300])

        if cudagraphs_log is not None:
            cudagraphs_log.addHandler(Keep(logging.WARNING))
        _CUDAGRAPH_WATCH.append(cudagraphs_log)
    return len(_CUDAGRAPH_SKIPS)


def cudagraph_skips_since(mark: int) -> dict:
    """`{"cudagraph_skips": [...]}`, the warnings logged after `mark`, or {} if none."""
    new = _CUDAGRAPH_SKIPS[mark:]
    return {"cudagraph_skips": list(new)} if new else {}


def autotuned() -> dict:
    """The Triton autotuners' choices so far in this process (`triton_chunked.autotune_choices`;
    none before fastrpe's kernels are imported)."""
    mod = sys.modules.get("fastrpe.ops.linear.triton_chunked")
    return mod.autotune_choices() if mod is not None else {}


def _new_choices(before: dict, now: dict) -> dict:
    """`{"autotuned": {kernel: {key: config}}}` with the choices in `now` not in `before` (a
    row's own), or {} if none."""
    new = {name: {k: c for k, c in keys.items() if k not in before.get(name, {})} for name, keys in now.items()}
    new = {name: keys for name, keys in new.items() if keys}
    return {"autotuned": new} if new else {}


def accuracy(call, kern, pos, q, k, v, causal: bool, n_rows: int) -> dict:
    """Max abs output error at sampled rows against `sampled_reference`, with the inputs in
    float32 (`max_abs_err_fp32`, what the issue's 1e-3 is judged on) and in the timed dtype
    (`max_abs_err`), plus the reference's scale."""
    rows = sample_rows(q.shape[2], n_rows)
    out = {}
    with torch.no_grad():
        ref = sampled_reference(kern, pos, q, k, v, rows, causal)
        out["ref_max_abs"] = float(ref.abs().max())
        for tag, dt in (("max_abs_err", q.dtype), ("max_abs_err_fp32", torch.float32)):
            if tag == "max_abs_err_fp32" and q.dtype == torch.float32:
                out[tag] = out["max_abs_err"]
                continue
            got = call(q.detach().to(dt), k.detach().to(dt), v.detach().to(dt))[:, :, rows.to(q.device)]
            out[tag] = float((got.double() - ref).abs().max())
            del got
    out["accuracy_rows"] = int(rows.numel())
    return out


def registry(cfg: GpuConfig) -> dict:
    """Competitor name -> setup, fastrpe's backends read from `BACKENDS` now."""
    from fastrpe.dispatch import BACKENDS

    reg = {
        "sdpa": sdpa_setup,
        "fla-chunk_linear_attn": fla_linear_attn_setup,
        "fla-chunk_simple_gla": fla_simple_gla_setup,
        "flex": flex_setup(cfg.smoke, cfg.flex_max_length, cfg.compile_mode),
    }
    for name in ("auto", *BACKENDS):
        reg[f"fastrpe-{name}"] = fastrpe_setup(name, cfg)
    # the default keeps bf16 problems' features float32
    for name in ("triton_chunked", "triton_soe", "triton_band", "triton_tiled"):
        if name in BACKENDS:
            reg[f"fastrpe-{name}+bf16-features"] = fastrpe_setup(name, cfg, lowp_features="bfloat16")
            # the float32 features multiplied by bf16 halves (half of tf32x3's passes)
            reg[f"fastrpe-{name}+bf16x3"] = fastrpe_setup(name, cfg, float32_products="bf16x3")
    # the PRF maps' backward inside triton_chunked's gradient kernels (`backends_triton.FUSED_MAPS`,
    # off by default until timed here), with the library's default products for bf16 (bf16x3)
    if "triton_chunked" in BACKENDS:
        reg["fastrpe-triton_chunked+bf16x3+fused-maps"] = fastrpe_setup("triton_chunked", cfg,
                                                                       float32_products="bf16x3", fused_maps=True)
    # the chunk-state passes as STATE_SCAN's "auto" does not run them at the bench's lengths
    # (triton_chunked.auto_blocked): triton_chunked and triton_band blocked from 16k on, so
    # their sequential twins; triton_soe sequential (its terms fill the SMs), so its blocked one
    for name, scan in (("triton_chunked", "sequential"), ("triton_band", "sequential"), ("triton_soe", "blocked")):
        if name in BACKENDS:
            reg[f"fastrpe-{name}+{scan}-scan"] = fastrpe_setup(name, cfg, state_scan=scan)
    # the SoE terms' states kept from forward to backward (2 GiB at most), not made again there
    if "triton_soe" in BACKENDS:
        reg["fastrpe-triton_soe+saved-states"] = fastrpe_setup("triton_soe", cfg, saved_states=SAVED_STATES_BYTES)
        # and their passes blocked: with 11 terms (KERPLE log at 64k, 9 for power) the sequential
        # pass is 88 programs walking 1,024 chunks (STATE_SCAN "auto" blocks under 66 on an H100);
        # with 16 the blocked kernels took longer on the device (7.4 vs 5.0 ms, third session)
        reg["fastrpe-triton_soe+saved-states+blocked-scan"] = fastrpe_setup(
            "triton_soe", cfg, saved_states=SAVED_STATES_BYTES, state_scan="blocked")
        # and multiplied by bf16 halves: at 64k KERPLE's fastest rows were 7.6-8.0 ms with states
        # kept and 7.1-7.4 with bf16x3 (sixth H100 session), while "at most 2x fla's geometric
        # time" asks about 6.7 if fla takes the issue's 3.33 ms
        reg["fastrpe-triton_soe+saved-states+bf16x3"] = fastrpe_setup(
            "triton_soe", cfg, saved_states=SAVED_STATES_BYTES, float32_products="bf16x3")
        # the far field walked in blocks, every term in one pass, no K·N stored states
        # (`triton_soe_walk`): at 1M the stored states ran a term per launch group (240 ms for
        # KERPLE-log's 15 terms, sixth H100 session; the criterion asks 60)
        reg["fastrpe-triton_soe+walk"] = fastrpe_setup("triton_soe", cfg, far_field="walk")
        reg["fastrpe-triton_soe+walk+bf16x3"] = fastrpe_setup("triton_soe", cfg, far_field="walk",
                                                              float32_products="bf16x3")
        # (not for triton_band: T5's one term fits one launch group at any length; its walk is
        # tested, not timed, and its binaries would not fit in the compile pack beside these)
        # the chunk-state passes with four terms' states a program (`triton_soe.STATE_TERMS`,
        # off by default until timed here): each chunk's inputs read once for four terms, where
        # the per-term passes (about 40% of the call on the H100) read them once a term; with
        # 9-11 terms, 24 programs, which STATE_SCAN "auto" blocks (results/soe_traffic.json); in
        # tf32x3 too, the bf16x3 row's `precision_twin`, without which KERPLE's criteria would
        # not count it
        reg["fastrpe-triton_soe+saved-states+stacked-states"] = fastrpe_setup(
            "triton_soe", cfg, saved_states=SAVED_STATES_BYTES, state_terms=4)
        reg["fastrpe-triton_soe+saved-states+bf16x3+stacked-states"] = fastrpe_setup(
            "triton_soe", cfg, saved_states=SAVED_STATES_BYTES, float32_products="bf16x3", state_terms=4)
        # the PRF maps' backward inside the SoE gradient kernels (`triton_soe_prf`, FUSED_MAPS; in
        # the last launch group where the terms take several), its tf32x3 twin for KERPLE's
        # accuracy rule
        reg["fastrpe-triton_soe+saved-states+fused-maps"] = fastrpe_setup(
            "triton_soe", cfg, saved_states=SAVED_STATES_BYTES, fused_maps=True)
        reg["fastrpe-triton_soe+saved-states+bf16x3+fused-maps"] = fastrpe_setup(
            "triton_soe", cfg, saved_states=SAVED_STATES_BYTES, float32_products="bf16x3", fused_maps=True)
        # both at 1M, where the budget makes four launch groups of KERPLE-log's 15 terms: the
        # stacked passes' 183 GB (soe_traffic.json) less the maps' float32 dφ of the last group
        reg["fastrpe-triton_soe+saved-states+stacked-states+fused-maps"] = fastrpe_setup(
            "triton_soe", cfg, saved_states=SAVED_STATES_BYTES, state_terms=4, fused_maps=True)
    if "triton_band" in BACKENDS:  # T5 through the same fused SoE kernels, one term
        reg["fastrpe-triton_band+bf16x3+fused-maps"] = fastrpe_setup("triton_band", cfg, float32_products="bf16x3",
                                                                    fused_maps=True)
    # the causal FFT path's sums over chunks in Triton kernels on the spectra as cuFFT writes them
    # (`fft.blocked.KERNEL`, off by default until timed here; by the byte count 595 -> 444-468 GiB
    # at 64k, 4,240 -> 2,322-2,611 at 262k with 64 chunks: results/fft_blocked_kernels_at_scale.json)
    if "fft" in BACKENDS:
        reg["fastrpe-fft+lag-kernels"] = fastrpe_setup("fft", cfg, lag_kernels=True)
        # the path before each chunk's own pairs went through triton_tiled (`fft.causal.LOCAL`,
        # "cuda" by default untimed; by the byte count 578 -> 453 GiB at 64k, 4,158 -> 2,525 at
        # 262k; with the lag kernels 427-451 -> 313 and 2,250-2,539 -> 1,331-1,426:
        # results/fft_local_at_scale-tiled.json against -before.json)
        reg["fastrpe-fft+chunk-recursion"] = fastrpe_setup("fft", cfg, chunk_recursion=True)
    # under torch.compile, as Flex: at short lengths an eager call is mostly host time
    for name in COMPILED_BACKENDS:
        if name in BACKENDS:
            reg[f"fastrpe-{name}{COMPILED}"] = fastrpe_setup(name, cfg, compiled=True)
    # with CUDA graphs, where the run's mode has none: Flex's compiled call and fastrpe's eager
    # one captured and replayed (`captured`: nothing compiled again), and fastrpe's compiled with
    # mode="reduce-overhead"
    if cfg.compile_mode == "default":
        reg[f"flex{GRAPHED}"] = flex_setup(cfg.smoke, min(cfg.flex_max_length, cfg.compiled_max_length),
                                           cap="--compiled-max-length", graphed=True)
        for name in COMPILED_BACKENDS:
            if name in BACKENDS:
                reg[f"fastrpe-{name}{GRAPHED}"] = fastrpe_setup(name, cfg, graphed=True)
                reg[f"fastrpe-{name}{COMPILED}{GRAPHED}"] = fastrpe_setup(name, cfg, compiled=True,
                                                                          mode="reduce-overhead")
        # what a replay's device time may gain where launches cost nothing: the chunk-state
        # passes blocked at 4k (64 chunks; STATE_SCAN "auto" blocks from 16k, where the eager
        # calls were timed: at 4k their sequential passes were 0.17 of triton_chunked's 0.36 ms
        # of GPU time, 64 steps in 8 programs, H100 2026-11-27b profile), and triton_tiled's
        # features in bf16 (its 1.79 ms at 4k were 3x Flex's busy time, in tf32x3 products)
        for name in ("triton_chunked", "triton_band", "triton_soe"):
            if name in BACKENDS:
                reg[f"fastrpe-{name}+blocked-scan{GRAPHED}"] = fastrpe_setup(name, cfg, state_scan="blocked",
                                                                              graphed=True)
        if "triton_tiled" in BACKENDS:
            reg[f"fastrpe-triton_tiled+bf16-features{GRAPHED}"] = fastrpe_setup("triton_tiled", cfg,
                                                                                 lowp_features="bfloat16",
                                                                                 graphed=True)
            reg[f"fastrpe-triton_tiled+bf16x3{GRAPHED}"] = fastrpe_setup("triton_tiled", cfg,
                                                                          float32_products="bf16x3", graphed=True)
    return reg


_APPLIES = {
    "sdpa": lambda fam: fam == "none",
    "fla-chunk_linear_attn": lambda fam: fam == "none",
    "fla-chunk_simple_gla": lambda fam: fam == "alibi",
    "flex": lambda fam: fam != "none",
    f"flex{GRAPHED}": lambda fam: fam != "none",
}


def matches(name: str, patterns) -> bool:
    """Whether competitor `name` matches one of `patterns` (fnmatch, case kept)."""
    return any(fnmatch.fnmatchcase(name, pat) for pat in patterns)


def split_pattern(pat: str) -> tuple[str, str, int | None]:
    """A row pattern's parts: `competitor[:family][@L]` -> (competitor pattern, family pattern,
    length or None); "fastrpe-fft:learned*@65536" is the FFT path on both learned tables at
    65,536 tokens. The family part is an fnmatch pattern too ("*" when absent)."""
    pat, _, at = pat.partition("@")
    name, _, fam = pat.partition(":")
    return name, fam or "*", int(at) if at else None


def row_matches(p: Problem, name: str, patterns) -> bool:
    """Whether the row of competitor `name` on problem `p` matches one of `patterns`
    (`split_pattern`): a competitor pattern (`matches`), at every length and family, or with
    `:family` for those families only, `@L` at that length only (`flex@65536`: compiled Flex at
    65,536 tokens, not at 4,096)."""
    for pat in patterns:
        comp, fam, at = split_pattern(pat)
        if fnmatch.fnmatchcase(name, comp) and fnmatch.fnmatchcase(p.position, fam) and (at is None or p.L == at):
            return True
    return False


def wanted(cfg: GpuConfig, name: str, p: Problem) -> bool:
    """Whether this run times competitor `name` on problem `p` (`GpuConfig.only` and `.skip`,
    `row_matches`)."""
    return (not cfg.only or row_matches(p, name, cfg.only)) and not row_matches(p, name, cfg.skip)


def applies(p: Problem, name: str) -> bool:
    """Pairs that make sense (fastrpe on the positional families; see the module doc)."""
    rule = _APPLIES.get(name)
    if rule is not None:
        return rule(p.position)
    if name.startswith("fastrpe-grid"):
        return False  # 2D grids only: no 1D problem here
    return p.position != "none"


def _mark_lost(row: dict, device: torch.device) -> None:
    """After a row's error: mark it if the CUDA context is broken (see `runner.ContextLost`)."""
    from .runner import context_lost

    if context_lost(device):
        row["context_lost"] = True


def _stop_if_lost(row: dict, what: str) -> None:
    """Once a marked row is recorded: stop this process (a new one resumes after that row)."""
    from .runner import ContextLost

    if row.get("context_lost"):
        raise ContextLost(f"{what}: {row.get('skipped')}")


# ----------------------------------------------------------------------------- decoding


def decode_rows(cfg: GpuConfig, device: torch.device, dtype: torch.dtype, log=print, *, done=frozenset(),
                over=lambda: False, on_row=lambda row: None) -> list[dict]:
    """One token at `decode_context` tokens of context, `MultiheadAttention.step`, no grad:
    constant-size states (`LinearState` for ALiBi, `BandState` for T5, `SoEState` for
    KERPLE-log; each row records which state `step` kept and whether its fused Triton step
    ran, `fused_step`; each three times: with the PyTorch ops too, and with the fused kernel
    launched through its compiled binary, `triton_recurrent.FAST_LAUNCH`, checked bit for bit
    against the JIT's launch first, `_check_fast_launch`) against KV
    caches of that length (the same layer exact, and softmax + ALiBi), and the bare SDPA
    op on a KV cache (no projections, no positional term: the cheapest KV step there is).

    A constant-size state is built from a `decode_prompt`-token prompt and its `length` set
    to the context (its size and its step's work do not depend on the length); a KV cache
    is filled with seeded keys and values of the full context length.

    Methods in `done` are not run again (resuming); no new row starts once `over()` is true;
    `on_row(row)` is called after each row (the caller saves it: a run killed later keeps it)."""
    import fastrpe as fr
    from fastrpe.bench.runner import _time
    from fastrpe.nn import attention as attention_mod
    from fastrpe.nn.attention import KVCache
    from fastrpe.ops.linear import triton_recurrent

    H, D, ctx = cfg.H, cfg.D, cfg.decode_context
    fast_launch = triton_recurrent.FAST_LAUNCH
    E = H * D
    g = torch.Generator().manual_seed(0)
    rows = []

    def layer(kernel, position, backend):
        torch.manual_seed(0)
        return fr.nn.MultiheadAttention(E, H, kernel=kernel, position=position, causal=True,
                                        backend=backend).to(device=device, dtype=dtype).eval()

    def nprf():
        return fr.kernels.get_kernel(cfg.kernel, head_dim=D, num_features=cfg.features)

    x = torch.randn(cfg.B, 1, E, generator=g).to(device=device, dtype=dtype)
    prompt = torch.randn(cfg.B, min(cfg.decode_prompt, ctx), E, generator=g).to(device=device, dtype=dtype)

    def kv_cache():
        kk = torch.randn(cfg.B, H, ctx, D, generator=g).to(device=device, dtype=dtype)
        return KVCache(kk, torch.randn(cfg.B, H, ctx, D, generator=g).to(device=device, dtype=dtype))

    def state_of(mha):
        with torch.no_grad():  # max_length: an SoE state is fitted for the whole context
            _, st = mha.step(prompt, max_length=ctx + 64)
        return replace(st, length=ctx) if not isinstance(st, KVCache) else st

    states = [  # each constant-size state's layer
        ("state-linear (alibi, nprf)", lambda: layer(nprf(), fr.positions.ALiBi(H), "auto")),
        ("state-soe (kerple_log, nprf)", lambda: layer(nprf(), fr.positions.KerpleLog(H), "soe")),
        ("state-band (t5, nprf)", lambda: layer(nprf(), make_position("t5", H, ctx), "auto")),
    ]
    # each with its fused Triton step and with the PyTorch ops; then the fused steps launched
    # through their compiled binaries (`triton_recurrent.FAST_LAUNCH`, opt-in until these rows
    # have compared and timed it on a GPU)
    cases = [(name + how, make, state_of, "constant") for name, make in states for how in ("", ", PyTorch ops")]
    cases += [(name + ", fast launch", make, state_of, "constant") for name, make in states]
    cases += [
        ("kv-cache (alibi, nprf, exact)", lambda: layer(nprf(), fr.positions.ALiBi(H), "auto"),
         lambda m: kv_cache(), "kv"),
        ("kv-cache (alibi, softmax)", lambda: layer("softmax", fr.positions.ALiBi(H), "auto"), lambda m: kv_cache(),
         "kv"),
    ]
    for name, make, state, kind in cases:
        if name in done:
            continue
        if over():
            return rows
        row = {"method": name, "kind": kind, "context": ctx}
        # "PyTorch ops": the same layer without its fused Triton step (`attention.FUSED_STEP`)
        fused = attention_mod.FUSED_STEP
        attention_mod.FUSED_STEP = "never" if name.endswith("PyTorch ops") else fused
        try:
            mha = make()
            st = state(mha)
            row["state_bytes"] = _state_bytes(st)
            row["state"] = type(st).__name__
            if kind == "constant" and isinstance(st, KVCache):
                raise RuntimeError(f"step kept a KV cache, not a constant-size state: {mha.decoder(ctx)}")
            if kind == "constant":
                row["fused_step"] = mha._prf_step_fusable(x, st)  # one Triton launch between the matmuls
            if name.endswith("fast launch"):
                _check_fast_launch(mha, x, st)
                triton_recurrent.FAST_LAUNCH = True
            with torch.no_grad():
                sec, peak = _time(lambda: mha.step(x, st), device, cfg.repeats, cfg.warmup, cpu_peak=not cfg.smoke)
            row.update(seconds=sec, peak_bytes=peak)
            row.update(_graphed_step(lambda: mha.step(x, st), device, cfg))
        except Exception as e:  # noqa: BLE001 - recorded
            from .runner import _first_line

            row["skipped"] = "out of memory" if isinstance(e, torch.cuda.OutOfMemoryError) else _first_line(e)
            _mark_lost(row, device)
        finally:
            attention_mod.FUSED_STEP = fused
            triton_recurrent.FAST_LAUNCH = fast_launch
        rows.append(row)
        on_row(row)
        log(_decode_line(row))
        _stop_if_lost(row, name)
        mha = st = None
    # the bare op: one query against the whole cache, FlashAttention's decode
    row = {"method": "kv-cache sdpa op (no RPE, no projections)", "kind": "kv-op", "context": ctx}
    if row["method"] in done or over():
        return rows
    try:
        cache = kv_cache()
        qq = torch.randn(cfg.B, H, 1, D, generator=g).to(device=device, dtype=dtype)
        with torch.no_grad():
            sec, peak = _time(lambda: torch.nn.functional.scaled_dot_product_attention(qq, cache.k, cache.v), device,
                              cfg.repeats, cfg.warmup, cpu_peak=not cfg.smoke)
        row.update(seconds=sec, peak_bytes=peak, state_bytes=_state_bytes(cache))
    except Exception as e:  # noqa: BLE001
        from .runner import _first_line

        row["skipped"] = _first_line(e)
        _mark_lost(row, device)
    rows.append(row)
    on_row(row)
    log(_decode_line(row))
    _stop_if_lost(row, row["method"])
    return rows


def _check_fast_launch(mha, x, st) -> None:
    """Raise unless the layer's fused step launched through its compiled binary
    (`triton_recurrent.FAST_LAUNCH`: the JIT's launch first, then the binary's) gives the JIT's
    launch's output and state bit for bit; or where no fused kernel runs to launch so."""
    from fastrpe.ops.linear import triton_chunked, triton_recurrent

    if triton_chunked.INTERPRETED or not mha._prf_step_fusable(x, st):
        raise RuntimeError("fast launch: no compiled fused step here (the interpreter, or no fused step)")
    with torch.no_grad():
        ref, ref_st = mha.step(x, st)
        triton_recurrent.FAST_LAUNCH = True
        try:
            for _ in range(2):  # the JIT's launch of this specialization, then its binary's
                out, out_st = mha.step(x, st)
        finally:
            triton_recurrent.FAST_LAUNCH = False
    fields = [f for f in ("S", "keys", "values") if isinstance(getattr(ref_st, f, None), torch.Tensor)]
    bad = [n for n, a, b in [("output", out, ref)] + [(f, getattr(out_st, f), getattr(ref_st, f)) for f in fields]
           if not torch.equal(a, b)]
    if bad:
        raise RuntimeError(f"fast launch: {', '.join(bad)} differ from the JIT's launch's")


def _graphed_step(fn, device: torch.device, cfg: GpuConfig) -> dict:
    """The same step replayed as one CUDA graph (`graph_seconds`): what a decoding loop that
    captures its step pays, without Python and launch overhead (one token's work is small, so
    eager times measure mostly the launches). `graph_skipped` says why it could not be captured."""
    if device.type != "cuda" or cfg.smoke:
        return {}
    from .runner import _first_line, _time

    try:
        with torch.no_grad():
            graph = capture_graph(fn, device)
            sec, _ = _time(graph.replay, device, cfg.repeats, cfg.warmup, cpu_peak=False)
        return {"graph_seconds": sec}
    except Exception as e:  # noqa: BLE001 - recorded: a step that syncs or allocates dynamically cannot be captured
        torch.cuda.synchronize(device)
        return {"graph_skipped": _first_line(e)}


def _state_bytes(st) -> int:
    return sum(t.numel() * t.element_size() for t in vars(st).values() if isinstance(t, torch.Tensor))


def _decode_line(row: dict) -> str:
    msg = row.get("skipped") or f"{row['seconds'] * 1e3:9.3f} ms  state {row['state_bytes'] / 2**20:9.2f} MiB"
    if "graph_seconds" in row:
        msg += f"  graphed {row['graph_seconds'] * 1e3:.3f} ms"
    elif "graph_skipped" in row:
        msg += f"  (no graph: {row['graph_skipped']})"
    return f"decode ctx={row['context']:<8d} {row['method']:44s} {msg}"


# ----------------------------------------------------------------------------- host syncs


def _watch_syncs(fn, device) -> str | None:
    """Run `fn` once more under `set_sync_debug_mode("error")` (after a warm-up call outside
    the watch: plans and compiled kernels may be built on first use). None if no host
    synchronization happened, else the error's first line."""
    from .runner import _first_line

    fn()
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as e:
        if "synchroniz" not in str(e).lower():
            raise
        import traceback

        # where: the innermost fastrpe frame (torch's own frames say nothing about whose call it was)
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "fastrpe" in f.filename]
        where = f" at {frames[-1].filename.split('fastrpe/')[-1]}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
        return _first_line(e) + where
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)
    return None


def sync_rows(cfg: GpuConfig, device: torch.device, dtype: torch.dtype, log=print, *, done=frozenset(),
              over=lambda: False, on_row=lambda row: None) -> list[dict]:
    """Each linear-time and FFT backend (every registered backend but the softmax ones),
    forward+backward at `sync_length` under `torch.cuda.set_sync_debug_mode("error")`, twice:
    the backend's own hot path (`Backend.run` on a validated problem: `ok`) and the public call
    `fastrpe.attention` with its input checks (`ok_api`). False comes with the error; a
    backend that refuses the family is skipped with its reasons. `(backend, family)` pairs in
    `done` are not run again; no new pair starts once `over()` is true; `on_row(row)` is called
    after each row."""
    if device.type != "cuda":
        rows = [{"skipped": "needs CUDA (set_sync_debug_mode watches CUDA syncs)"}]
        on_row(rows[0])
        return rows
    import fastrpe as fr
    from fastrpe.api import _problem
    from fastrpe.dispatch import BACKENDS

    from .runner import _first_line

    rows = []
    for name, b in BACKENDS.items():
        if name in SOFTMAX_ONLY_BACKENDS:
            continue
        for fam in FAMILIES:
            if (name, fam) in done:
                continue
            if over():
                return rows
            p = Problem(position=fam, kernel=cfg.kernel, causal=family_causal(fam), L=cfg.sync_length, B=cfg.B,
                        H=cfg.H, D=cfg.D, features=cfg.features)
            row = {"backend": name, "family": fam, "L": p.L}
            try:
                pos = make_position(fam, p.H, p.L).to(device)
                kern = _kernel(p, device)
                q, k, v = _qkv(p, device, dtype)
                prob, kpm = _problem(q, k, v, kern, pos, p.causal, None, None, None)
                reasons = b.not_supported_reasons(prob)
                if reasons:
                    row["skipped"] = "; ".join(reasons)
                else:
                    hot = _closure(lambda q, k, v: b.run(q, k, v, prob, kpm), q, k, v, True)
                    api = _closure(lambda q, k, v: fr.attention(q, k, v, kernel=kern, position=pos, causal=p.causal,
                                                                backend=name), q, k, v, True)
                    for key, fn in (("ok", hot), ("ok_api", api)):
                        err = _watch_syncs(fn, device)
                        row[key] = err is None
                        if err is not None:
                            row[key.replace("ok", "error")] = err
            except Exception as e:  # noqa: BLE001 - anything but a sync is recorded as a reason
                row = {"backend": name, "family": fam, "L": p.L, "skipped": "error: " + _first_line(e)}
                _mark_lost(row, device)
            rows.append(row)
            on_row(row)
            msg = row.get("skipped") or " ".join(
                f"{k}={'clean' if row[k] else row[k.replace('ok', 'error')]}" for k in ("ok", "ok_api"))
            log(f"sync {name:14s} {fam:13s} {msg}")
            _stop_if_lost(row, f"sync {name} {fam}")
            hot = api = q = k = v = None
    return rows


# ----------------------------------------------------------------------------- the run


def versions() -> dict:
    """The software whose version a row's time or fault depends on: torch, triton, fla."""
    try:
        import triton

        tv = triton.__version__
    except Exception:  # noqa: BLE001
        tv = None
    return {"torch": torch.__version__, "triton": tv, "fla": fla_version()}


def environment(device: torch.device) -> dict:
    from .runner import device_name

    env = {"device": device_name(device), **versions(), "python": platform.python_version(), "cuda": torch.version.cuda}
    if device.type == "cuda":
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    from ..ops import triton_prf  # (imports without triton too)

    # the PRF maps' launch choices (`$FASTRPE_PRF_LAUNCH`: gpu_run.sh's pick from the PRF sweep)
    env["prf_launch"] = triton_prf.launch_choice()
    return env


def machine_id() -> str | None:
    """This machine's boot id (Linux; None elsewhere). Each GPU session gets a fresh machine:
    rows of runs with different ids were timed in different sessions, whatever the device's
    name says."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8] or None
    except OSError:
        return None


def _version_key(env: dict) -> tuple:
    return tuple(env.get(k) for k in ("torch", "triton", "fla"))


def run_versions(res: dict, row: dict) -> dict:
    """The versions of the run that measured `row`: `res["envs"][row["run"]]`, or the result's
    own for a result written before it kept one environment per run."""
    envs = res.get("envs") or []
    i = row.get("run")
    return envs[i] if isinstance(i, int) and 0 <= i < len(envs) and envs[i] else res


def lost_elsewhere(res: dict, rows: list[dict], now: dict, cfg: GpuConfig) -> list[dict]:
    """`rows` less each row that broke the CUDA context under other versions (torch, triton,
    fla) than `now`'s, for a competitor this run times (`wanted`): the fault may have been the
    old versions' (fla-core 0.6.0 under triton 3.6 on the H100 image, 2026-11-26), so that row
    is measured again. Under the same versions it stays, and its competitor is not run again."""
    key = _version_key(now)
    return [r for r in rows if not (r.get("context_lost") and wanted(cfg, r["competitor"], Problem(**r["problem"]))
                                    and _version_key(run_versions(res, r)) != key)]


def done_pairs(rows: list[dict]) -> set[tuple[str, str]]:
    """`(problem tag, competitor)` of every row a result holds: what a resumed run skips. Every
    pair with a row is done (timed, refused or out of memory); pairs the budget left out have
    no row and run then."""
    return {(Problem(**r["problem"]).tag(), r["competitor"]) for r in rows}


def _run_sections(cfg: GpuConfig, res: dict, dev, dt, log, over, select, save, keep) -> None:
    from .runner import run_suite

    for section in cfg.sections:
        if section == "sync":  # the hot paths under sync debug mode (they also warm the kernels)
            done = {(r.get("backend"), r.get("family")) for r in res["sync"]}
            if (None, None) not in done:  # a row without a backend: no CUDA, nothing to watch
                sync_rows(cfg, dev, dt, log=log, done=done, over=over, on_row=keep("sync"))
        elif section == "decode":
            decode_rows(cfg, dev, dt, log=log, done={r["method"] for r in res["decode"]}, over=over,
                        on_row=keep("decode"))
        elif section == "rows":
            reg = registry(cfg)
            # three passes (`row_pass`): the rows the criteria read at every length, those of them
            # under torch.compile, then every other row
            for rank in cfg.passes:
                done = done_pairs(res["rows"])

                def chosen(p, name, rank=rank, done=done):  # the budget is asked only for a row to run
                    return row_pass(p, name) == rank and (p.tag(), name) not in done and select(p, name)

                run_suite(problems(cfg), list(reg), device=cfg.device, dtype=cfg.dtype, repeats=cfg.repeats,
                          warmup=cfg.warmup, time_limit_s=cfg.time_limit_s, log=log, registry=reg, select=chosen,
                          catch_errors=True, call_cap_s=cfg.call_cap_s, done=done, on_row=save,
                          cpu_peak=not cfg.smoke, limit_on="timed")
        else:
            raise ValueError(f"unknown section {section!r}; known: {', '.join(SECTIONS)}")


def retry_errors(rows: list[dict], cfg: GpuConfig | None = None) -> list[dict]:
    """`rows` less every row of each problem where a competitor failed with an error (not for
    memory or time), so that a resumed run measures that problem again whole, its ratios from
    one run; a row that broke the CUDA context stays (it would break it again). With `cfg`,
    only the competitors it times count and go (`wanted`): another run times the rest."""
    def mine(r):
        return cfg is None or wanted(cfg, r["competitor"], Problem(**r["problem"]))

    def failed(r):
        return mine(r) and r.get("skipped", "").startswith("error:") and not r.get("context_lost")

    redo = {Problem(**r["problem"]).tag() for r in rows if failed(r)}
    return [r for r in rows if not (mine(r) and Problem(**r["problem"]).tag() in redo) or r.get("context_lost")]


#: rows a session resuming another's JSON measures again (`measure_again`), whose old and new
#: times tell how far two sessions' machines differ: one row of each kind, short and long, of
#: code that does not change with fastrpe's (until 2026-11-27 the long one was triton_chunked's
#: ALiBi row, which `CHANGED` measured again for its own reason; 2026-11-26 -> 27: Flex 0.856 ->
#: 0.990 ms, triton_chunked 5.85 -> 5.99 ms). From the fourth to the sixth session Flex at 64k
#: was an anchor too, so that each ratio's two rows came from one machine; but a Flex row moved
#: while its fastrpe rows stayed set the two against each other across machines again (the
#: sixth session's KERPLE rows, both sides from one run, would have lost that): `PAIR_LENGTHS`
#: does it per problem instead.
ANCHORS = (("flex", "alibi", L_SHORT), ("sdpa", "none", L_CHECK))
#: the ratio criteria's lengths where a resumed session measures a problem's Flex and fastrpe
#: rows again, all of them, when the rows a criterion reads are not both timed on one machine
#: (`unpaired`): the issue asks for ratios measured in the same run
PAIR_LENGTHS = (L_CHECK, L_LONG)


#: rows whose code changed since the last GPU session's JSON, (competitor, family) fnmatch
#: patterns, the shortest L and the epoch of the change: a session resuming that JSON measures
#: again the rows of runs before that epoch
#: (`measure_again`), their earlier rows kept beside, which --check prints as what the change
#: did (across two machines: read it beside the anchors' drift). 2026-11-27 (after the third
#: H100 session): the blocked scan's carries became one kernel, and STATE_SCAN's default
#: "auto" runs triton_chunked's and triton_band's passes blocked from 16k tokens, and
#: triton_band (one term) keeps its states for the backward (`triton_soe.SAVE_STATES_BYTES`). Each run records
#: its `code_epoch`: a change bumps CODE_EPOCH and names the new epoch in its entries.
#: Epoch 2 (after the fourth session, 2026-11-27): triton_prf's products default to "tf32x3"
#: (the fourth session's PRF sweep), which every fastrpe Triton row's feature maps run, and the
#: SoE fit takes fewer terms (KERPLE log 11 at 64k instead of 16, power 9 instead of 12: the
#: rates' grid, `soe.RATE_LO`/`RATE_HI`); the 4k rows (host-bound: 10-40% GPU busy) are left
#: as they are. Epoch 3 (a CPU session after, 2026-11-27): the key-tile gradient kernels of
#: triton_chunked, triton_soe/band and triton_tiled form their key-major tiles directly
#: (`triton_chunked.HOPPER_TRANS_NOTE`), so the `+bf16-features` rows, which those kernels'
#: miscompile on the H100 made wrong, are measured again at every length; and triton_tiled's
#: causal query tiles start heaviest first (`triton_tiled._query_tile`), which 4k's two waves of
#: programs should feel most, so its rows too; and tf32x3 takes two tf32 products, not three,
#: against a bf16 operand (`triton_chunked._dot_tf32x2`: values, states, output gradients), in
#: every Triton row from 16k (the 4k rows are host time). Still epoch 3 (no GPU has run it;
#: later CPU sessions): triton_tiled takes its interior tile pairs without masks (`_interior`),
#: and its weights from a per-call table `exp(b - top)`, not an exponential per pair
#: (`triton_tiled.exp_table`); its rows are in CHANGED at every length already. Epoch 4 (after
#: the fifth session, which ran epoch 3 and moved those rows; 2026-11-27): the FFT product's
#: per-row einsums (cuBLAS gemv, 190 of 555 ms of GPU time at 64k) became broadcast products
#: and one vector_norm, so the `fft` rows, and `auto`'s on the learned tables, which may run
#: it, are measured again at every length; and bf16x3's soe/band dq kernel tunes over
#: pipelined configs only (`triton_soe.SOE_DQ_BF16X3_NOTE`), whose rows had faulted. Still epoch
#: 4 (a CPU session after): rows that failed move as well as timed ones (`measure_again`), so
#: those bf16x3 rows, which had faulted and stayed, are measured again, and so is triton_tiled's
#: (learned, 4k), which faulted in the fourth session, before epoch 3's fix of the key-tile
#: kernels; the fifth's GPU tests passed it pinned to 4 and 8 warps at one stage.
#: Epoch 5 (after the sixth session, which ran epoch 4; 2026-11-27): each entry now says the
#: epoch whose code changed (its fourth field), so that a session's rows of that epoch stay
#: however many epochs later; and fla's row, which the third session's fault kept from running
#: ever since (a row that broke the CUDA context under the same versions keeps its competitor
#: out, `lost_elsewhere`), is measured again: the bench has pruned fla's oversized tiles
#: (`prune_fla_oversized_tiles`) since the fifth session, whose probe passed with them pruned.
#: Epoch 6 (a CPU session, 2026-11-28): the fused decoding step's host path (`CHANGED_DECODE`).
#: Epoch 7 (after the seventh session, which ran epoch 6; 2026-11-28): the SoE walk's dq and dk/dv
#: kernels hold their state transposed where an operand is 16-bit (`triton_soe_walk`'s docstring):
#: its bf16x3 row, which broke the CUDA context there, is measured again; `auto` takes the
#: library's new default for 16-bit calls, bf16x3 products (`backends_triton.FLOAT32_PRODUCTS`;
#: the plain Triton rows keep tf32x3, named), so its rows are measured again; and the fused decoding
#: steps' fast launch pads its grid to three dims, as Triton's runner reads them (the
#: "..., fast launch" decode rows stopped with an IndexError there: `CHANGED_DECODE`).
#: Epoch 8 (the third CPU session of 2026-11-28): the PRF maps' backward computes φ again from x
#: instead of reading it, and may take launch choices of its own (`triton_prf.BWD_LAUNCH`, the
#: sweep's "FWD/BWD" pick), in every fastrpe Triton row; no row moves for it (the `auto` rows move
#: for epoch 7 and carry it, the criteria's best rows among them); the new row
#: `fastrpe-triton_chunked+bf16x3+fused-maps` (`backends_triton.FUSED_MAPS`) is timed as any new row.
#: Epoch 9 (the fourth CPU session of 2026-11-28): triton_soe's dq kernel, which triton_band
#: runs too, forms the far weights' gradient only when they take one (`DWQ`; the bench's terms
#: are frozen), where it formed it, and read and wrote it back in memory, once per term and
#: chunk in every call: the rows its criteria read move (the others keep their times, of the
#: kernel before).
#: Epoch 10 (the fifth CPU session of 2026-11-28): the causal FFT path on CUDA takes the pairs
#: across chunks by one blocked product (`fft.causal.BLOCKED`, `fft/blocked.py`) instead of the
#: halving recursion over the whole length, so the causal table's `fft` rows, and its `auto` rows,
#: which may run it, move (the not-causal table's keep their times).
#: Epoch 11 (the seventh CPU session of 2026-11-28): the causal FFT path picks its chunks from a
#: byte model that counts the blocked product's lag matrices (`fft.plan.causal_chunk`: with the
#: bench's 8 heads the recursion from 262,144 tokens on), keeps them contiguous and sums the
#: coefficients' gradient after the blocks (`fft/blocked.py`): the same rows move again.
#: Epoch 12 (the first CPU session of 2026-11-29): the causal FFT path's segments add their
#: gradients in place at their own rows (`fft.segments.SegmentSums`), where autograd summed one
#: full-size gradient per segment and input (by the byte count 5% of the bench's 64k call, 18%
#: at 262k, 42% at 1M), and its chunk model is recalibrated (`plan.LEVEL_BYTES`: 8 chunks at
#: 262k on an H200, where it took 16): the same rows move again. (The not-causal path's near band now runs in
#: blocks of rows within the budget, `fft.band.band_rows`: one block up to 208k rows with an
#: H200's 4 GiB, so no timed row changes.) New rows, timed as any new row: the PRF maps'
#: backward inside the SoE gradient kernels (`+fused-maps` of triton_soe and triton_band,
#: `ops/linear/triton_soe_prf.py`); the kernels the others run are the same (a refactor: the
#: interpreter's outputs bitwise equal).
#: Epoch 13 (the third CPU session of 2026-11-29): the causal FFT path
#: takes each chunk's own pairs by triton_tiled's kernels (`fft.causal.LOCAL`), not the recursion
#: inside each chunk and its dense leaves, and its chunks from a model that prices them
#: (`plan.local_levels`: one chunk, all tiled, up to 16k tokens): the causal table's `fft` rows
#: and its `auto` rows move again; the new row `fastrpe-fft+chunk-recursion` times the path before.
#: And the FFT products' row contractions after each inverse transform run in one Triton kernel
#: (`fft/triton_rowsum.py`, `ROW_SUMS`), causal or not: the not-causal table's rows move too.
CODE_EPOCH = 13
CHANGED = (("fastrpe-fft", "*", 0, 4), ("fastrpe-auto", "learned*", 0, 4), ("fastrpe-triton_soe+bf16x3", "*", 0, 4),
           ("fastrpe-triton_band+bf16x3", "*", 0, 4), ("fastrpe-triton_tiled+bf16x3", "*", 0, 4),
           ("fla-chunk_simple_gla", "*", 0, 5), ("fastrpe-triton_soe+walk+bf16x3", "*", 0, 7),
           ("fastrpe-auto", "*", 0, 7), ("fastrpe-triton_soe+bf16x3", "*", 0, 9),
           ("fastrpe-triton_soe+saved-states*", "*", 0, 9), ("fastrpe-triton_band+bf16x3", "*", 0, 9),
           ("fastrpe-auto", "t5", 0, 9), ("fastrpe-fft", "learned", 0, 11), ("fastrpe-auto", "learned", 0, 11),
           ("fastrpe-fft", "learned", 0, 12), ("fastrpe-auto", "learned", 0, 12),
           ("fastrpe-fft", "learned", 0, 13), ("fastrpe-auto", "learned", 0, 13),
           ("fastrpe-fft+lag-kernels", "learned", 0, 13), ("fastrpe-fft", "learned_full", 0, 13),
           ("fastrpe-auto", "learned_full", 0, 13))
#: decode rows (`decode_rows`' methods, fnmatch patterns, with the epoch whose code changed)
#: moved as `CHANGED`'s rows are, to `earlier_decode`. Epoch 4: the fused step reads its
#: constants from one memo (`MultiheadAttention._fused_step_plan`: its host time 113 -> 78 µs on
#: the CPU, the geometric state), so the three constant-size states' eager steps, fused and
#: not, are timed again, and the KV-cache steps with them: the criterion's ratio, from one
#: machine. Epoch 6 (a CPU session, 2026-11-28): the fused step takes its q/k/v row whole
#: (`triton_recurrent.prf_*_token_packed`, the map's constants checked once, `PRFStep`), one
#: fingerprint a step instead of three, no `nn.Module.__getattr__` in its path: host time
#: 101 -> 59 µs (band, SoE), 79 -> 49 (geometric) on the CPU, bf16
#: (`benchmarks/decode_ops.py --host`); the sixth session's eager steps were 307-488 µs.
CHANGED_DECODE = (("state-*", 6), ("kv-cache*", 6), ("state-*, fast launch", 7))


def _since(entry: tuple, n: int) -> tuple[tuple, int]:
    """(the pattern fields, the epoch whose code changed) of a `CHANGED` (n = 3) or
    `CHANGED_DECODE` (n = 1) entry; one without its epoch is `CODE_EPOCH`'s."""
    entry = (entry,) if isinstance(entry, str) else tuple(entry)
    return entry[:n], (entry[n] if len(entry) > n else CODE_EPOCH)


def unpaired(res: dict, lengths=PAIR_LENGTHS) -> set[tuple[str, int]]:
    """(family, L) at `lengths` whose Flex row and the fastest fastrpe row its ratio criteria
    read (`best_fastrpe`: exact, or within ACCURACY_TOL for the KERPLEs) were not timed on one
    machine, or where one of the two is timed and the other is not."""
    out = set()
    for fam in FAMILIES:
        for L in lengths:
            ref = _row(res, fam, L, "flex")
            ref = ref if ref is not None and ref.get("seconds") else None
            kerple = fam in ("kerple_log", "kerple_power")
            b = best_fastrpe(res, fam, L, exact_only=not kerple, tol=ACCURACY_TOL if kerple else None)
            if ref is None and b is None:
                continue
            if ref is None or b is None or run_versions(res, ref).get("machine") != run_versions(res, b[1]).get("machine"):
                out.add((fam, L))
    return out


def measure_again(res: dict, anchors=ANCHORS, changed=CHANGED, changed_decode=CHANGED_DECODE,
                  pair_lengths=PAIR_LENGTHS) -> int:
    """Move from `res["rows"]` to `res["earlier"]` (each with `again`), so that a resumed run
    measures them again: the timed rows of `anchors` ((competitor, family, L); "anchor"); the
    rows of `changed` ((competitor pattern, family pattern, shortest L, epoch)) of runs before
    that epoch, timed or failed with an error (a fault of the old code says nothing of the new,
    and a row that broke the CUDA context would otherwise stay, `retry_errors`; "changed");
    and, at `pair_lengths`, every timed Flex and fastrpe row of each problem whose ratio's two
    sides are not from one machine (`unpaired`; "pair"). `anchor_drift` then compares each
    with its new time. The decode rows of `changed_decode` ((method pattern, epoch)) go to
    `res["earlier_decode"]` likewise (`decode_drift`). Returns how many moved."""
    want = {tuple(a) for a in anchors}
    changed = [_since(c, 3) for c in changed]

    def why(r) -> str | None:
        key = (r["competitor"], r["problem"]["position"], r["problem"]["L"])
        if r.get("seconds") and key in want:
            return "anchor"
        epoch = run_versions(res, r).get("code_epoch", 0)
        if (r.get("seconds") or r.get("skipped", "").startswith("error:")) and any(
                epoch < since and matches(key[0], (c,)) and matches(key[1], (f,)) and key[2] >= L
                for (c, f, L), since in changed):
            return "changed"
        return None

    def pair(r) -> str | None:  # on the rows `why` leaves: a changed row is no side
        key = (r["problem"]["position"], r["problem"]["L"])
        sides = r["competitor"] == "flex" or r["competitor"].startswith("fastrpe-")
        return "pair" if r.get("seconds") and sides and key in pairs else None

    moved = []

    def move(rule) -> None:
        kept = []
        for r in res["rows"]:
            again = rule(r)
            if again:
                moved.append({**r, "again": again})
            else:
                kept.append(r)
        res["rows"] = kept

    move(why)
    pairs = unpaired(res, pair_lengths) if pair_lengths else set()
    move(pair)
    res.setdefault("earlier", []).extend(moved)
    changed_decode = [_since(c, 1) for c in changed_decode]
    stay, gone = [], []
    for r in res.get("decode", []):
        epoch = run_versions(res, r).get("code_epoch", 0)
        old = any(epoch < since and matches(r["method"], pats) for pats, since in changed_decode)
        (gone if old else stay).append(r)
    if gone:
        res["decode"] = stay
        res.setdefault("earlier_decode", []).extend({**r, "again": "changed"} for r in gone)
    return len(moved) + len(gone)


def decode_drift(res: dict) -> list[dict]:
    """Each decode row measured again (`measure_again`) against its earlier eager time."""
    now = {r["method"]: r for r in res.get("decode", [])}
    return [{"method": old["method"], "earlier_ms": old["seconds"] * 1e3, "now_ms": now[old["method"]]["seconds"] * 1e3,
             "ratio": now[old["method"]]["seconds"] / old["seconds"]}
            for old in res.get("earlier_decode", [])
            if old.get("seconds") and now.get(old["method"], {}).get("seconds")]


def anchor_drift(res: dict) -> list[dict]:
    """Each row measured again (`measure_again`) against its earlier time: how far one
    session's machine times the same call from another's (same device name)."""
    out = []
    for old in res.get("earlier", []):
        p = old["problem"]
        new = _row(res, p["position"], p["L"], old["competitor"])
        if new is not None and new.get("seconds") and old.get("seconds"):
            out.append({"competitor": old["competitor"], "family": p["position"], "L": p["L"],
                        "earlier_ms": old["seconds"] * 1e3, "now_ms": new["seconds"] * 1e3,
                        "ratio": new["seconds"] / old["seconds"], "again": old.get("again", "anchor")})
    return out


def resume_source(carried: Path | None, committed: list[Path], device: str,
                  compile_mode: str = "default") -> Path | None:
    """The JSON a bench on `device` resumes: `carried` (the last device call's, in .gpu_runs/)
    if it was measured on a GPU of that name in `compile_mode`, else the newest such among
    `committed` (benchmarks/results/gpu/: the sessions' JSONs, by their last run's time), else
    None (start afresh). Timings of different devices or Flex modes never mix; other JSONs
    there (warm-ups, profiles, tests, smoke runs) are not bench results and are passed over."""
    def fits(p: Path) -> tuple[str, str] | None:
        try:
            r = json.loads(p.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(r, dict) or r.get("suite") != "gpu" or r.get("smoke") or "rows" not in r:
            return None
        if r.get("device") != device or r.get("config", {}).get("compile_mode", "default") != compile_mode:
            return None
        return (r.get("finished") or r.get("started") or "", p.name)

    if carried is not None and fits(carried):
        return carried
    ok = [(key, p) for p in committed if (key := fits(p))]
    return max(ok)[1] if ok else None


def run_gpu_suite(cfg: GpuConfig, out: Path, *, command: str = "", resume: bool = False, retry: bool = False,
                  log=print) -> dict:
    """Run everything `cfg` asks for, writing `out/gpu.json` after every row (a run cut short
    keeps what it measured; `resume` skips what `out/gpu.json` already holds, and with `retry`
    measures again the problems where a row failed, `retry_errors`), then the plot
    and the markdown table. Returns the result dict; `context_lost` in it says a row broke the
    CUDA context and the run stopped after recording it (resume it in a new process)."""
    from .runner import ContextLost

    dev = torch.device(cfg.device)
    dt = getattr(torch, cfg.dtype)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu.json"
    old = json.loads(path.read_text()) if resume and path.exists() else None
    rows = list(old["rows"]) if old else []
    if retry:
        rows = retry_errors(rows, cfg)
    env = environment(dev)
    if old:
        rows = lost_elsewhere(old, rows, env, cfg)
    if old and (old.get("device") != env["device"] or old.get("dtype") != cfg.dtype):
        from .._validate import FastRPEError

        raise FastRPEError(f"--resume: {path} holds {old.get('device')} / {old.get('dtype')} timings, this run is "
                           f"{env['device']} / {cfg.dtype}: timings of different devices do not mix (use another --out)")
    old_mode = (old or {}).get("config", {}).get("compile_mode", "default")  # (before the option: default)
    if old and old_mode != cfg.compile_mode:
        from .._validate import FastRPEError

        raise FastRPEError(f"--resume: {path} holds rows compiled in mode {old_mode!r}, this run asks "
                           f"{cfg.compile_mode!r}: the Flex baseline changes with it (use another --out)")
    # one environment per run (command), rows say their run (`run_versions`); the top level is
    # the first whole run's (not one of `--only`: gpu_run.sh may time fla's rows first, with
    # another triton), with the first fla version any run had
    n_old = len(old.get("commands", [])) if old else 0
    envs = (list(old.get("envs", [])) if old else [])[:n_old]
    envs = envs + [None] * (n_old - len(envs)) + [{**env, "machine": machine_id(), "code_epoch": CODE_EPOCH,
                                                   **({"only": list(cfg.only)} if cfg.only else {})}]
    base = next((old if e is None else e for e in envs if e is None or not e.get("only")), envs[0])
    top = {k: base.get(k) for k in env}
    top["fla"] = next((e["fla"] for e in [top, *[e for e in envs if e]] if e.get("fla")), None)
    res = {"suite": "gpu", "smoke": cfg.smoke, "config": cfg.to_dict(), **top, "envs": envs,
           "dtype": cfg.dtype, "repeats": cfg.repeats, "command": command,
           "commands": (old.get("commands", []) if old else []) + [command],
           "positions_frozen": True, "rows": rows,
           "decode": old.get("decode", []) if old else [], "sync": old.get("sync", []) if old else [],
           "earlier": old.get("earlier", []) if old else [],
           **({"earlier_decode": old["earlier_decode"]} if old and old.get("earlier_decode") else {}),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if cfg.smoke:
        res["note"] = "SMOKE RUN at toy sizes on " + dev.type + ": tests the harness, measures nothing"
    t0 = time.perf_counter()
    run_index = len(res["commands"]) - 1  # each new row says which run (command) measured it

    def save(_row=None):
        if _row is not None:
            _row["run"] = run_index
            res["rows"].append(_row)
        res["ratios"] = ratios(res)
        path.write_text(json.dumps(res, indent=1))

    cut = []  # set once the budget turned a row away

    def over() -> bool:
        if cfg.budget_s is not None and time.perf_counter() - t0 > cfg.budget_s:
            cut.append(True)
            return True
        return False

    # a competitor that broke the CUDA context once (its row says so) is not run again
    lost = {r["competitor"] for r in rows if r.get("context_lost")}

    def select(p, name):
        return applies(p, name) and wanted(cfg, name, p) and name not in lost and not over()

    def keep(section):
        def on_row(row):
            row["run"] = run_index
            res[section].append(row)
            save()
        return on_row

    try:
        _run_sections(cfg, res, dev, dt, log, over, select, save, keep)
    except ContextLost as e:  # what ran is saved; a new process goes on (gpu_run.sh does so)
        res["context_lost"] = str(e)
        cut.append(True)
        log(f"the CUDA context is lost ({e}): run again with --resume, in a new process")
    res["complete"] = not cut and set(cfg.sections) == set(SECTIONS)
    res["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    save()
    png = plot_gpu(res, out / "gpu.png")
    (out / "gpu.md").write_text(markdown_table(res))
    spent = cut and "context_lost" not in res
    log(f"wrote {path}, {out / 'gpu.md'}" + (f" and {png}" if png else "")
        + (f" (budget of {cfg.budget_s:g} s spent: run again with --resume)" if spent else ""))
    return res


# ----------------------------------------------------------------------------- reading results


def times(res: dict) -> dict[tuple[str, int, str], float]:
    """(family, L, competitor) -> seconds, for every timed row."""
    return {(r["problem"]["position"], r["problem"]["L"], r["competitor"]): r["seconds"]
            for r in res["rows"] if r.get("seconds")}


def _row(res: dict, fam: str, L: int, comp: str) -> dict | None:
    for r in res["rows"]:
        if r["problem"]["position"] == fam and r["problem"]["L"] == L and r["competitor"] == comp:
            return r
    return None


def best_fastrpe(res: dict, fam: str, L: int, *, exact_only: bool = False,
                 tol: float | None = None, graphed: bool = False) -> tuple[str, dict] | None:
    """The fastest fastrpe row on (family, L) that is exact (if asked) and within `tol` of exact
    where its accuracy was measured (float32 inputs; a row without its own measurement takes
    the one its competitor, or its eager twin, has on this family at `accuracy_length`).
    `fastrpe-auto` counts as the backend it ran. The rows with CUDA graphs (`GRAPHED`) count
    only with `graphed`: they are set against Flex with graphs, not without."""
    errs = {r["competitor"]: r["max_abs_err_fp32"] for r in res["rows"]
            if r["problem"]["position"] == fam and r.get("max_abs_err_fp32") is not None}
    best = None
    for r in res["rows"]:
        p = r["problem"]
        if p["position"] != fam or p["L"] != L or not r["competitor"].startswith("fastrpe-") or not r.get("seconds"):
            continue
        if r["competitor"] in NOT_CONTENDERS or r.get("auto_picks") in ("dense", "sdpa", "flex"):
            continue
        if exact_only and not r.get("exact", False):
            continue
        if r["competitor"].endswith(GRAPHED) and not graphed:
            continue
        twin = precision_twin(r["competitor"])
        if tol is not None and twin is not None:
            # its float32-input error is its twin's (float32 calls never take its products): it
            # counts where its products cost nothing in the call it times (`PRECISION_VARIANTS`),
            # judged where both were measured: at L, else at the accuracy length (1M has none)
            mine_row = r if r.get("max_abs_err") is not None else _accuracy_row(res, fam, r["competitor"])
            t = _row(res, fam, L, base_competitor(twin))
            if (t or {}).get("max_abs_err") is None:
                t = _accuracy_row(res, fam, base_competitor(twin))
            mine, theirs = (mine_row or {}).get("max_abs_err"), (t or {}).get("max_abs_err")
            if mine is None or theirs is None or not mine <= theirs:
                continue
            if t.get("max_abs_err_fp32") is not None:
                r = {**r, "max_abs_err_fp32": t["max_abs_err_fp32"]}
        # (a `+compiled` row runs its eager twin's kernels: it takes the twin's measurement)
        err = r.get("max_abs_err_fp32", errs.get(r["competitor"], errs.get(base_competitor(r["competitor"]))))
        if tol is not None and err is not None and not err <= tol:
            continue
        if best is None or r["seconds"] < best[1]["seconds"]:
            best = (r["competitor"], r)
    return best


def _accuracy_row(res: dict, fam: str, name: str) -> dict | None:
    """Competitor `name`'s row on family `fam` that holds its accuracy (`max_abs_err`: the
    accuracy length's), at any length, or None."""
    return next((r for r in res["rows"] if r["problem"]["position"] == fam and r["competitor"] == name
                 and r.get("max_abs_err") is not None), None)


def _failed_at_scale(reason: str) -> bool:
    """A competitor's row skipped for running out of memory or time (not for being absent)."""
    r = reason.lower()
    return "out of memory" in r or "exceeded" in r or "hard cap" in r


def ratios(res: dict) -> list[dict]:
    """Per (family, L): the best fastrpe time against Flex with the same term, fla's geometric
    decay and SDPA without RPE at that length (all from this run)."""
    t = times(res)
    out = []
    fams = sorted({k[0] for k in t if k[0] != "none"})
    for fam in fams:
        for L in sorted({k[1] for k in t if k[0] == fam}):
            b = best_fastrpe(res, fam, L)
            if b is None:
                continue
            s = b[1]["seconds"]
            row = {"family": fam, "L": L, "best_fastrpe": b[0], "ms": s * 1e3}
            for key, ref in (("flex_over_fastrpe", t.get((fam, L, "flex"))),
                             ("fla_gla_over_fastrpe", t.get(("alibi", L, "fla-chunk_simple_gla"))),
                             ("sdpa_over_fastrpe", t.get(("none", L, "sdpa")))):
                row[key] = ref / s if ref else None
            out.append(row)
    return out


def markdown_table(res: dict) -> str:
    """ms (fwd+bwd) per method and length, one table per family, pasteable into docs/RESULTS.md."""
    lines = [f"Device: {res['device']}; torch {res['torch']}, triton {res.get('triton')}, fla {res.get('fla')}; "
             f"{res['dtype']}; median of {res['repeats']} {'' if res.get('smoke') else 'CUDA-event '}timings after "
             f"warm-up (compilation excluded); positional parameters frozen (gradients of q, k, v).",
             "", "Commands: " + "; ".join(f"`{c}`" for c in res.get("commands", [res.get("command", "")])),
             "", "¹ timed once: a warm call took longer than the time limit; OOM: out of memory.", ""]
    def differs(e):  # a run without fla (its rows left to fla's own run) differs in no version of fla
        fla = e.get("fla")
        return any(e.get(k) != res.get(k) for k in ("torch", "triton")) or (fla is not None and fla != res.get("fla"))

    ran = {i: sorted({r["competitor"] for r in res["rows"] if r.get("run") == i})
           for i, e in enumerate(res.get("envs") or []) if e and differs(e)}
    if any(ran.values()):  # e.g. fla's rows, timed in a process of their own with another triton
        envs = res["envs"]
        lines[1:1] = ["", *[f"Run {i} (its rows: {', '.join(names)}): torch {envs[i].get('torch')}, "
                            f"triton {envs[i].get('triton')}, fla {envs[i].get('fla')}." for i, names in ran.items()
                            if names]]
    if res.get("smoke"):
        lines.insert(0, "**SMOKE RUN (toy sizes, CPU): not a measurement.**\n")
    Ls = sorted({r["problem"]["L"] for r in res["rows"]})
    for fam in ["none", *[f for f in FAMILIES if any(r["problem"]["position"] == f for r in res["rows"])]]:
        comps = []
        for r in res["rows"]:
            if r["problem"]["position"] == fam and r["competitor"] not in comps:
                comps.append(r["competitor"])
        if not comps:
            continue
        lines += [f"**{fam}** ({'causal' if family_causal(fam) else 'not causal'}), ms fwd+bwd (peak GiB above inputs)",
                  "", "| method | " + " | ".join(_fmt_L(L) for L in Ls) + " |",
                  "|---|" + "---|" * len(Ls)]
        for c in comps:
            cells = []
            for L in Ls:
                r = _row(res, fam, L, c)
                if r is None:
                    cells.append("")
                elif r.get("seconds"):
                    gib = f" ({r['peak_bytes'] / 2**30:.2f})" if r.get("peak_bytes") is not None else ""
                    once = "¹" if r.get("repeats") == 1 and res["repeats"] > 1 else ""
                    cells.append(f"{r['seconds'] * 1e3:.3g}{once}{gib}")
                else:
                    cells.append(_short_reason(r.get("skipped", "")))
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines.append("")
    if res.get("decode"):
        lines += ["**decoding one token** (context " + str(res["decode"][0]["context"]) + ")", "",
                  "| method | ms | ms, CUDA graph | state |", "|---|---|---|---|"]
        for r in res["decode"]:
            if r.get("seconds"):
                g = f"{r['graph_seconds'] * 1e3:.3g}" if r.get("graph_seconds") else _short_reason(
                    r.get("graph_skipped", ""))
                lines.append(f"| {r['method']} | {r['seconds'] * 1e3:.3g} | {g} | {r['state_bytes'] / 2**20:.2f} MiB |")
            else:
                lines.append(f"| {r['method']} | {_short_reason(r.get('skipped', ''))} | | |")
        lines.append("")
    lines += ["**criteria** (`fastrpe bench --suite gpu --check`)", ""]
    lines += [f"- {c['status'].upper()}: {c['criterion']} — {c['detail']}" for c in check(res)]
    return "\n".join(lines) + "\n"


def _fmt_L(L: int) -> str:
    return f"{L // 1048576}M" if L % 1048576 == 0 else (f"{L // 1024}k" if L % 1024 == 0 else str(L))


def _short_reason(s: str) -> str:
    s = s.replace("|", "/")
    if "out of memory" in s.lower():
        return "OOM"
    if "exceeded" in s:
        return "over time cap"
    return "—" if not s else ("n/a: " + s[:40] + ("…" if len(s) > 40 else ""))


def plot_gpu(res: dict, path: Path) -> Path | None:
    """Log-log time against L, one panel per family, one line per method."""
    from ..plotting import pyplot, save

    plt = pyplot()
    if plt is None:
        return None
    fams = [f for f in ("none", *FAMILIES) if any(r["problem"]["position"] == f and r.get("seconds")
                                                 for r in res["rows"])]
    if not fams:
        return None
    cols = min(3, len(fams))
    nrows = math.ceil(len(fams) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4 * nrows), squeeze=False)
    # one colour per method across the panels (Flex the same in every panel)
    names = sorted({r["competitor"] for r in res["rows"] if r.get("seconds")})
    cycle = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    colour = {c: cycle[i % len(cycle)] for i, c in enumerate(names)}
    for ax, fam in zip(axes.flat, fams):
        series: dict[str, list] = {}
        for r in res["rows"]:
            pf, c = r["problem"]["position"], r["competitor"]
            # every panel also shows the two references: SDPA without RPE and fla's geometric decay
            if r.get("seconds") and (pf == fam or (pf == "none" and c == "sdpa")
                                     or (pf == "alibi" and c == "fla-chunk_simple_gla")):
                series.setdefault(c, []).append((r["problem"]["L"], r["seconds"] * 1e3))
        for c, pts in sorted(series.items()):
            pts.sort()
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=c, color=colour[c],
                    linestyle="--" if not c.startswith("fastrpe") else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L")
        ax.set_ylabel("ms, forward + backward")
        ax.set_title(f"{fam} ({'causal' if family_causal(fam) else 'not causal'})", fontsize=10)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(fams):]:
        ax.set_visible(False)
    fig.suptitle(("SMOKE (not a measurement) " if res.get("smoke") else "") + res["device"]
                 + f", {res['dtype']}, B={res['config']['B']} H={res['config']['H']} D={res['config']['D']}",
                 fontsize=9)
    save(fig, path)
    return path


# ----------------------------------------------------------------------------- the criteria

GIB = 2 ** 30


def check(res: dict, L_check: int = L_CHECK, L_long: int = L_LONG, L_max: int = L_MAX) -> list[dict]:
    """Issue 12's "What it must show", each as pass / fail / missing (not measured), from a
    result of `run_gpu_suite`. A smoke result is checked at its own lengths (the largest
    stands for 1M, the middle one for 64k) so the logic is exercised; it proves nothing."""
    Ls = sorted({r["problem"]["L"] for r in res["rows"]})
    if res.get("smoke") and Ls:
        L_check, L_long, L_max = Ls[len(Ls) // 2], Ls[-1], Ls[-1]
    t = times(res)
    out = []

    def add(criterion, ok, detail, machines=1):
        out.append({"criterion": criterion, "status": "missing" if ok is None else ("pass" if ok else "fail"),
                    "detail": detail, **({"machines": machines} if machines > 1 else {})})

    def ms(s):
        return "—" if s is None else f"{s * 1e3:.3g} ms"

    def ratio_line(fam, L, ref_name, ref_fam, need, kind, exact_only=False, tol=None, graphed=False):
        """`kind`: 'faster' (ref / ours >= need) or 'at_most' (ours <= need × ref)."""
        b = best_fastrpe(res, fam, L, exact_only=exact_only, tol=tol, graphed=graphed)
        ref = t.get((ref_fam, L, ref_name))
        if b is None or ref is None:
            why = "no fastrpe row" if b is None else f"no {ref_name} time"
            r = _row(res, ref_fam, L, ref_name)
            if b is not None and r is not None and _failed_at_scale(r.get("skipped", "")):
                # the competitor ran out of memory or time at this length: it is no faster than us
                return True, f"{b[0]} {ms(b[1]['seconds'])}; {ref_name}: {r['skipped']}"
            if r is not None and "skipped" in r:
                why += f" ({ref_name}: {r['skipped']})"
            return None, why
        s = b[1]["seconds"]
        two = {run_versions(res, row).get("machine") for row in (b[1], _row(res, ref_fam, L, ref_name))}
        where = "" if len(two) == 1 else " [rows timed on two machines: two GPU sessions]"
        if kind == "faster":
            return (ref / s >= need, f"{b[0]} {ms(s)} vs {ref_name} {ms(ref)}: {ref / s:.2f}x (need >= {need:g}x)"
                    + where, len(two))
        return (s <= need * ref, f"{b[0]} {ms(s)} vs {ref_name} {ms(ref)}: {s / ref:.2f}x its time "
                f"(need <= {need:g}x)" + where, len(two))

    L = L_check
    # geometric decay (kernelized ALiBi)
    add(f"geometric (alibi), L={L}: no slower than fla chunk_simple_gla",
        *ratio_line("alibi", L, "fla-chunk_simple_gla", "alibi", 1.0, "at_most", exact_only=True))
    add(f"geometric (alibi), L={L}: >= 15x faster than compiled Flex + ALiBi",
        *ratio_line("alibi", L, "flex", "alibi", 15.0, "faster", exact_only=True))
    for fam in ("kerple_log", "kerple_power"):
        add(f"{fam}, L={L}: <= 2x fla's geometric time (within {ACCURACY_TOL:g} of exact)",
            *ratio_line(fam, L, "fla-chunk_simple_gla", "alibi", 2.0, "at_most", tol=ACCURACY_TOL))
        add(f"{fam}, L={L}: >= 20x faster than Flex with the same score_mod",
            *ratio_line(fam, L, "flex", fam, 20.0, "faster", tol=ACCURACY_TOL))
        b = best_fastrpe(res, fam, L, tol=ACCURACY_TOL)
        err = None if b is None else b[1].get("max_abs_err_fp32")
        add(f"{fam}, L={L}: output within {ACCURACY_TOL:g} of exact (float32 inputs, sampled rows vs float64)",
            None if err is None else err <= ACCURACY_TOL,
            "no accuracy measured" if err is None else f"{b[0]}: max abs error {err:.2e}")
    add(f"t5, L={L}: exact, <= 2x fla's geometric time",
        *ratio_line("t5", L, "fla-chunk_simple_gla", "alibi", 2.0, "at_most", exact_only=True))
    add(f"t5, L={L}: exact, >= 10x faster than Flex + T5",
        *ratio_line("t5", L, "flex", "t5", 10.0, "faster", exact_only=True))
    for fam in ("learned", "learned_full"):
        tag = "causal" if family_causal(fam) else "not causal"
        add(f"learned table ({tag}), L={L}: exact, no slower than Flex with the same table",
            *ratio_line(fam, L, "flex", fam, 1.0, "faster", exact_only=True))
        add(f"learned table ({tag}), L={L_long}: exact, >= 4x faster than Flex",
            *ratio_line(fam, L_long, "flex", fam, 4.0, "faster", exact_only=True))
        b = best_fastrpe(res, fam, L_max, exact_only=True)
        if b is None:
            add(f"learned table ({tag}), L={L_max}: completes within 40 GiB", None, "no exact fastrpe row")
        else:
            tot = b[1].get("peak_total_bytes", b[1].get("peak_bytes"))
            add(f"learned table ({tag}), L={L_max}: completes within 40 GiB",
                None if tot is None else tot <= 40 * GIB,
                f"{b[0]} {ms(b[1]['seconds'])}, peak {tot / GIB:.2f} GiB in all" if tot is not None else "no peak")
    L4 = Ls[0] if res.get("smoke") and Ls else L_SHORT
    for fam in FAMILIES:
        if any(r["problem"]["position"] == fam for r in res["rows"]):
            exact = fam not in ("kerple_log", "kerple_power")
            tol = None if exact else ACCURACY_TOL
            plain = ratio_line(fam, L4, "flex", fam, 1.0, "faster", exact_only=exact, tol=tol)
            # like with like with CUDA graphs too (fastrpe's rows with graphs or without against
            # Flex with graphs): either pairing passing meets the criterion
            graphs = ratio_line(fam, L4, f"flex{GRAPHED}", fam, 1.0, "faster", exact_only=exact, tol=tol,
                                graphed=True)
            if graphs[0] is None and not any(r["competitor"] == f"flex{GRAPHED}" for r in res["rows"]):
                add(f"{fam}, L={L4}: no slower than Flex with the same term", *plain)
            else:
                oks = [x[0] for x in (plain, graphs)]
                ok = True if True in oks else (None if oks == [None, None] else False)
                add(f"{fam}, L={L4}: no slower than Flex with the same term", ok,
                    f"{plain[1]}; with CUDA graphs: {graphs[1]}", max([*plain[2:3], *graphs[2:3], 1]))
    for fam in DECAYING:
        b = best_fastrpe(res, fam, L_max, tol=ACCURACY_TOL)
        if b is None:
            add(f"{fam}, L={L_max}: forward+backward within 60 ms and 8 GiB", None, "no fastrpe row")
            continue
        s, peak = b[1]["seconds"], b[1].get("peak_bytes")
        ok = s <= 0.060 and peak is not None and peak <= 8 * GIB
        tot = b[1].get("peak_total_bytes")
        add(f"{fam}, L={L_max}: forward+backward within 60 ms and 8 GiB", ok,
            f"{b[0]} {ms(s)}, peak {peak / GIB:.2f} GiB above inputs"
            + (f" ({tot / GIB:.2f} GiB in all)" if tot is not None else "") if peak is not None else ms(s))
    add("auto: never more than 1.2x the fastest exact backend (every family and length timed)", *auto_line(res))
    dec = [r for r in res.get("decode", []) if r.get("seconds")]
    states = [r for r in dec if r["kind"] == "constant"]
    kvs = [r for r in dec if r["kind"] == "kv"]
    if not states or not kvs:
        add("decoding at 64k: constant-size state >= 5x faster than a KV-cache step", None, "no decode rows")
    else:
        # eager, and like for like with both steps captured as CUDA graphs (no launch overhead)
        for key, how in (("seconds", ""), ("graph_seconds", ", CUDA-graphed steps")):
            timed_st, timed_kv = [r for r in states if r.get(key)], [r for r in kvs if r.get(key)]
            if not timed_st or not timed_kv:
                continue
            st, kv = min(timed_st, key=lambda r: r[key]), min(timed_kv, key=lambda r: r[key])
            add(f"decoding at {st['context']}{how}: constant-size state >= 5x faster than a KV-cache step",
                kv[key] / st[key] >= 5,
                f"{st['method']} {ms(st[key])} vs fastest layer KV step {kv['method']} {ms(kv[key])}: "
                f"{kv[key] / st[key]:.2f}x")
    sy = [r for r in res.get("sync", []) if "ok" in r]
    for key, what in (("ok", "no host synchronization in any backend's hot path (sync debug mode)"),
                      ("ok_api", "no host synchronization in fastrpe.attention end to end (sync debug mode)")):
        rows = [r for r in sy if key in r]
        if not rows:
            add(what, None, "no sync rows")
            continue
        bad = [f"{r['backend']}/{r['family']}" for r in rows if not r[key]]
        first = next((r.get(key.replace("ok", "error")) for r in rows if not r[key]), None)
        add(what, not bad, f"{len(rows) - len(bad)}/{len(rows)} backend x family runs clean"
            + (f"; syncs in {', '.join(bad)} (first: {first})" if bad else ""))
    return out


#: issue 12 item 3: `auto` never picks a backend more than this many times slower than the
#: fastest exact one
AUTO_SLACK = 1.2


def auto_line(res: dict, slack: float = AUTO_SLACK) -> tuple:
    """Issue 12 item 3 over every (family, L) with a timed `fastrpe-auto` row: its time
    against the fastest exact backend's row in its default form (no `+` variant; the
    materializing reference counts, it is a backend `auto` may pick). `(ok or None, detail)`."""
    ratios = []
    for r in res["rows"]:
        if r["competitor"] != "fastrpe-auto" or not r.get("seconds"):
            continue
        fam, L = r["problem"]["position"], r["problem"]["L"]
        exact = [x for x in res["rows"] if x["problem"]["position"] == fam and x["problem"]["L"] == L
                 and x["competitor"].startswith("fastrpe-") and "+" not in x["competitor"]
                 and x["competitor"] != "fastrpe-auto" and x.get("exact") and x.get("seconds")]
        if exact:
            best = min(exact, key=lambda x: x["seconds"])
            ratios.append((r["seconds"] / best["seconds"], fam, L, r.get("auto_picks"), best["competitor"]))
    if not ratios:
        return None, "no fastrpe-auto row with an exact backend timed beside it"
    bad = [x for x in ratios if x[0] > slack]
    worst = max(ratios)
    same = f"fastrpe-{worst[3]}" == worst[4]
    detail = (f"{len(ratios) - len(bad)}/{len(ratios)} within {slack:g}x; worst {worst[1]} L={worst[2]}: auto "
              f"ran {worst[3]}, {worst[0]:.2f}x {worst[4]}'s time"
              + (" (the same backend: the gap is auto's own host time, or two timings' spread)" if same else ""))
    return not bad, detail


def print_check(res: dict, log=print) -> int:
    """Print one line per criterion; 0 if all pass, 1 if any fails or is missing."""
    rows = check(res)
    if res.get("smoke"):
        log("SMOKE RESULT: toy sizes on CPU, the criteria below exercise the checker only")
    for c in rows:
        log(f"{c['status'].upper():8s} {c['criterion']}: {c['detail']}")
    n = {s: sum(c["status"] == s for c in rows) for s in ("pass", "fail", "missing")}
    log(f"{n['pass']} passed, {n['fail']} failed, {n['missing']} missing")
    two = sum(c.get("machines", 1) > 1 for c in rows if c["status"] != "missing")
    if two:
        log(f"{two} of these compare rows timed on two machines (two GPU sessions): the issue asks for ratios "
            "measured in one run")
    for d in anchor_drift(res):
        why = ("how far two sessions' machines differ" if d["again"] == "anchor"
               else "its code changed since (gpu.CHANGED; two machines: see the anchors)")
        log(f"measured again: {d['competitor']} {d['family']} L={d['L']}: {d['earlier_ms']:.3g} ms earlier, "
            f"{d['now_ms']:.3g} ms now ({d['ratio']:.3f}x): {why}")
    for d in decode_drift(res):
        log(f"measured again: decode {d['method']}: {d['earlier_ms']:.3g} ms earlier, {d['now_ms']:.3g} ms now "
            f"({d['ratio']:.3f}x): timed again (gpu.CHANGED_DECODE: the states' steps changed, the KV steps "
            "for a ratio from one machine; two machines: see the anchors)")
    return 0 if n["fail"] == 0 and n["missing"] == 0 else 1


# ----------------------------------------------------------------------------- the CLI


class _Unset(str):
    """A parser default that remembers it was not given (the gpu suite has its own)."""


class _UnsetInt(int):
    pass


def add_arguments(p) -> None:
    """The gpu suite's options on `fastrpe bench`; `--dtype`/`--repeats` keep their defaults
    for the other suites and take the gpu suite's (bfloat16, 10) when not given."""
    for a in p._actions:
        if a.dest == "dtype" and isinstance(a.default, str):
            a.default = _Unset(a.default)
        if a.dest == "repeats" and isinstance(a.default, int):
            a.default = _UnsetInt(a.default)
    g = p.add_argument_group("--suite gpu (issue 12; needs CUDA unless --smoke)")
    g.add_argument("--lengths", default=None, help="comma-separated L (default 4096,16384,65536,262144,1048576)")
    g.add_argument("--families", default=None, help=f"comma-separated, from {','.join(FAMILIES)} (default all)")
    g.add_argument("--smoke", action="store_true", help="toy sizes on CPU: tests the harness, measures nothing")
    g.add_argument("--check", nargs="?", const="", default=None, metavar="JSON",
                   help="evaluate the issue's criteria from a result (default OUT/gpu.json); runs nothing")
    g.add_argument("--resume", action="store_true", help="keep the rows OUT/gpu.json already has; run the rest")
    g.add_argument("--retry-errors", action="store_true",
                   help="with --resume: measure again, whole, each problem where a row failed with an error")
    g.add_argument("--budget-s", type=float, default=None, help="start no new row after this many seconds")
    g.add_argument("--time-limit-s", type=float, default=None,
                   help="a first call slower than this is timed once and longer lengths skipped (default 2)")
    g.add_argument("--call-cap-s", type=float, default=None, help="hard cap on one call (default 180)")
    g.add_argument("--accuracy-length", type=int, default=None, help="L of the accuracy rows (default 65536)")
    g.add_argument("--decode-context", type=int, default=None, help="context of the decode rows (default 65536)")
    g.add_argument("--flex-max-length", type=int, default=None,
                   help="no Flex or triton_tiled rows beyond this L (default 262144)")
    g.add_argument("--compiled-max-length", type=int, default=None,
                   help="no fastrpe +compiled rows beyond this L (default 16384)")
    g.add_argument("--compile-mode", choices=COMPILE_MODES, default=None,
                   help="torch.compile's mode for the Flex baseline and the +compiled rows alike (default: default)")
    g.add_argument("--warm", choices=("first", "rest"), default=None,
                   help="instead of timing: compile what the bench's first pass runs (first), or all it has yet to run "
                        "after OUT/gpu.json (rest), one process per Triton autotuner config side by side, "
                        "within --budget-s (default 150); fastrpe.bench.gpu_warm")
    g.add_argument("--only", default=None, metavar="PATTERNS",
                   help="comma-separated row patterns, competitor[:family][@L] (fnmatch, e.g. 'fla-*', "
                        "'fastrpe-fft:learned*@65536'): time only these rows")
    g.add_argument("--skip", default=None, metavar="PATTERNS",
                   help="comma-separated row patterns (as --only): leave these rows to another run")
    g.add_argument("--warm-first", default=None, metavar="PATTERNS",
                   help="with --warm: compile the rows of these patterns (as --only) first: "
                        "flex@65536 is Flex at that length only")
    g.add_argument("--passes", default=None, metavar="0,1,2",
                   help="the rows section's passes to run: 0 the rows the criteria read, 1 those of them "
                        "under torch.compile, 2 every other row (default all)")
    g.add_argument("--sections", default=None,
                   help=f"comma-separated, run in this order, from {','.join(SECTIONS)} (default: {','.join(SECTIONS)})")


def _ints(s: str, what: str) -> tuple:
    from .._validate import FastRPEError

    try:
        vals = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise FastRPEError(f"{what}: expected comma-separated integers, got {s!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise FastRPEError(f"{what}: expected positive integers, got {s!r}")
    return vals


def _patterns(s: str, what: str, cfg: GpuConfig) -> tuple:
    """Comma-separated row patterns (`split_pattern`: `competitor[:family][@L]`), each
    competitor part matching some competitor and each family part some family (a typo would
    silently select nothing)."""
    from .._validate import FastRPEError

    pats = tuple(x.strip() for x in s.split(",") if x.strip())
    names = list(registry(cfg))
    lengths = [x.partition("@")[2] for x in pats if "@" in x]
    odd = [x for x in lengths if not x.isdigit() or int(x) < 1]
    if odd:
        raise FastRPEError(f"{what}: after '@', expected a length in tokens, got {', '.join(map(repr, odd))}")
    parts = [split_pattern(x) for x in pats]
    bad = [x for x, (comp, _, _) in zip(pats, parts) if not any(matches(n, (comp,)) for n in names)]
    if not pats or bad:
        raise FastRPEError(f"{what}: {', '.join(map(repr, bad)) or repr(s)} matches no competitor; "
                           f"known: {', '.join(names)}")
    fams = ("none", *FAMILIES)
    bad = [x for x, (_, fam, _) in zip(pats, parts) if not any(fnmatch.fnmatchcase(f, fam) for f in fams)]
    if bad:
        raise FastRPEError(f"{what}: the family of {', '.join(map(repr, bad))} matches none of {', '.join(fams)}")
    return pats


def config_from_args(args) -> GpuConfig:
    from .._validate import FastRPEError

    cfg = smoke_config() if args.smoke else GpuConfig()
    kw = {}
    if args.lengths:
        kw["lengths"] = _ints(args.lengths, "--lengths")
    if args.families:
        fams = tuple(f for f in args.families.split(",") if f)
        bad = [f for f in fams if f not in FAMILIES]
        if bad or not fams:
            raise FastRPEError(f"--families: unknown {bad}; known: {', '.join(FAMILIES)}")
        kw["families"] = fams
    if args.sections:
        secs = tuple(x for x in args.sections.split(",") if x)
        bad = [x for x in secs if x not in SECTIONS]
        if bad or not secs or len(set(secs)) != len(secs):
            raise FastRPEError(f"--sections: expected distinct names from {', '.join(SECTIONS)}, got {args.sections!r}")
        kw["sections"] = secs
    if args.passes:
        passes = tuple(x.strip() for x in args.passes.split(",") if x.strip())
        if not passes or any(x not in ("0", "1", "2") for x in passes) or len(set(passes)) != len(passes):
            raise FastRPEError(f"--passes: expected distinct passes from 0,1,2, got {args.passes!r}")
        kw["passes"] = tuple(sorted(int(x) for x in passes))
    for opt in ("only", "skip", "warm_first"):
        if getattr(args, opt, None) is not None:
            kw[opt] = _patterns(getattr(args, opt), f"--{opt.replace('_', '-')}", cfg)
    if not isinstance(args.dtype, _Unset):
        kw["dtype"] = args.dtype
    if not isinstance(args.repeats, _UnsetInt):
        if args.repeats < 1:
            raise FastRPEError(f"--repeats: must be >= 1, got {args.repeats}")
        kw["repeats"] = args.repeats
    for name in ("budget_s", "time_limit_s", "call_cap_s", "accuracy_length", "decode_context", "flex_max_length",
                 "compiled_max_length", "compile_mode"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if not args.smoke:
        kw["device"] = args.device
    cfg = replace(cfg, **kw)
    # smoke: the accuracy rows at one of the lengths run; on a GPU they stay at 65,536 (a phase
    # of other lengths has none: the criteria take them from the phase that ran 65,536)
    if cfg.smoke and "accuracy_length" not in kw and cfg.accuracy_length not in cfg.lengths:
        kw_len = [L for L in sorted(cfg.lengths) if L <= cfg.accuracy_length] or [min(cfg.lengths)]
        cfg = replace(cfg, accuracy_length=kw_len[-1])
    return cfg


def run_cli(args) -> int:
    """`fastrpe bench --suite gpu ...` (see `add_arguments`)."""
    out = Path(args.out)
    if args.check is not None:
        path = Path(args.check) if args.check else out / "gpu.json"
        if not path.exists():
            print(f"--check: no result at {path}")
            return 2
        return print_check(json.loads(path.read_text()))
    cfg = config_from_args(args)
    if not cfg.smoke and (torch.device(cfg.device).type != "cuda" or not torch.cuda.is_available()):
        print("fastrpe bench --suite gpu: needs CUDA (no GPU here); --smoke runs the harness at toy sizes on CPU")
        return 2
    # the words typed (`fastrpe bench ...` or `python -c '...main(sys.argv[1:])' bench ...`, as
    # benchmarks/gpu_run.sh runs it); rebuilt from the parsed options only when called otherwise
    if args.warm is not None:
        from .gpu_warm import warm

        warm(cfg, out, which=args.warm, budget_s=150.0 if cfg.budget_s is None else cfg.budget_s)
        return 0
    command = "fastrpe " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else \
        "fastrpe bench " + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                                    if k not in ("_module", "command") and v not in (None, False))
    if args.retry_errors and not args.resume:
        from .._validate import FastRPEError

        raise FastRPEError("--retry-errors needs --resume (it measures again problems of OUT/gpu.json)")
    res = run_gpu_suite(cfg, out, command=command, resume=args.resume, retry=args.retry_errors)
    return CONTEXT_LOST_EXIT if res.get("context_lost") else 0
