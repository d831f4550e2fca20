"""KERPLE (Chi et al., NeurIPS 2022), Table 4: training speed (sec/step) per positional term.

The paper (GPT-NeoX, 162M parameters, L = 512, one A100) reports sec/step 0.307 (KERPLE-log),
0.321 (power), 0.302 (ALiBi), 0.340 (T5), 0.332 (rotary), 0.298 (sinusoidal): the log
variant is "9.7% faster than T5" and "slightly slower than ... ALiBi, Rotary, and
Sinusoidal". Absolute times do not transfer between a 162M model on an A100 and a small
one on a CPU, so the comparison is each term's time relative to KERPLE-log.

Setting: the small causal byte-level LM of `fastrpe extrapolate` (softmax attention,
`backend="auto"`), trained through `fastrpe.train` (`reproduce.lm.train_lm`) with each
positional term, one thread (`torch.set_num_threads(1)`). A step's time is the interval
between consecutive `on_step_end` callbacks (forward, backward, clipping, AdamW); the first
`--skip` steps of a run are dropped (allocation, caches). The terms run in `--rounds`
interleaved rounds (the order rotates each round) so that a change in the machine's load
hits every term alike; a term's sec/step is the median over all its kept steps. The
backend `auto` chose for each term's attention is recorded.
"""
from __future__ import annotations

import statistics
import time

import torch

from .._validate import FastRPEError
from ..train.loop import Callback
from .lm import add_model_arguments, train_lm
from .luo_fig1a import set_timing_threads

POSITIONS = ("kerple_log", "kerple_power", "alibi", "t5", "rotary", "sinusoidal")
PAPER_SEC_PER_STEP = {"kerple_log": 0.307, "kerple_power": 0.321, "alibi": 0.302, "t5": 0.340, "rotary": 0.332,
                      "sinusoidal": 0.298}


def add_arguments(p) -> None:
    p.add_argument("--positions", default=",".join(POSITIONS))
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 40, quick 20)")
    p.add_argument("--skip", type=int, default=3, help="first steps of each run left out of the timing")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3, quick 2)")
    p.add_argument("--train-length", type=int, default=None, help="default 256 (quick 128)")
    add_model_arguments(p)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads while timing")


class _StepTimer(Callback):
    """`fastrpe.train` callback: the wall time between consecutive steps' ends."""

    def __init__(self):
        self.last = None
        self.intervals: list[float] = []

    def on_step_end(self, state) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.intervals.append(now - self.last)
        self.last = now


def chosen_backend(position: str, heads: int, d_model: int, L: int, batch: int) -> str | None:
    """The backend `auto` picks for one attention call of this LM (with gradients)."""
    import fastrpe as fr

    from ..nn.block import position_term

    term = position_term(position, heads, causal=True, max_len=L, head_dim=d_model // heads)
    x = torch.zeros(1, 1, 1, 1).expand(batch, heads, L, d_model // heads).requires_grad_(True)
    return fr.explain(x, x, x, position=term, causal=True).chosen


def run(args, out_dir) -> dict:
    from ..bench.runner import device_name
    from ..data.text import load_corpus
    from ..nn import LMConfig
    from ..nn.block import POSITION_NAMES

    positions = [p for p in args.positions.split(",") if p]
    unknown = [p for p in positions if p not in POSITION_NAMES]
    if unknown:
        raise FastRPEError(f"kerple-table4: unknown position(s) {unknown}; known: {', '.join(POSITION_NAMES)}")
    steps = args.steps or (20 if args.quick else 40)
    rounds = args.rounds or (2 if args.quick else 3)
    L = args.train_length or (128 if args.quick else 256)
    if steps <= args.skip:
        raise FastRPEError(f"kerple-table4: --steps ({steps}) must exceed --skip ({args.skip})")
    corpus = load_corpus("python-stdlib", max_bytes=300_000)
    times: dict[str, list[float]] = {p: [] for p in positions}
    prev = set_timing_threads(args.threads)
    try:
        for r in range(rounds):
            order = positions[r % len(positions):] + positions[:r % len(positions)]
            for pos in order:
                cfg = LMConfig(vocab_size=corpus.vocab_size, d_model=args.d_model, n_layers=args.layers,
                               n_heads=args.heads, kernel="softmax", position=pos, max_len=L)
                timer = _StepTimer()
                train_lm(cfg, corpus.train, length=L, steps=steps, batch_size=args.batch_size, lr=args.lr,
                         seed=args.seed, device=args.device, progress=False, callbacks=[timer])
                times[pos] += timer.intervals[args.skip - 1:] if args.skip else timer.intervals
                print(f"round {r}: {pos:13s} {statistics.median(timer.intervals[max(args.skip - 1, 0):]):.4f} s/step",
                      flush=True)
    finally:
        torch.set_num_threads(prev)
    rows = []
    base = statistics.median(times["kerple_log"]) if "kerple_log" in times else None
    for pos in positions:
        sec = statistics.median(times[pos])
        paper = PAPER_SEC_PER_STEP.get(pos)
        rows.append({"position": pos, "sec_per_step": sec, "steps_timed": len(times[pos]),
                     "ratio_to_log": None if base is None else sec / base,
                     "paper_sec_per_step": paper,
                     "paper_ratio_to_log": None if paper is None else paper / PAPER_SEC_PER_STEP["kerple_log"],
                     "auto_backend": chosen_backend(pos, args.heads, args.d_model, L, args.batch_size)})
    for r in rows:
        print(f"{r['position']:13s} {r['sec_per_step']:.4f} s/step  ratio to log {r['ratio_to_log']:.3f}"
              + (f"  (paper {r['paper_ratio_to_log']:.3f})" if r["paper_ratio_to_log"] else "")
              + f"  auto: {r['auto_backend']}")
    result = {"experiment": "kerple-table4", "device": device_name(torch.device("cpu")), "threads": args.threads,
              "train_length": L, "steps": steps, "skip": args.skip, "rounds": rounds, "batch_size": args.batch_size,
              "d_model": args.d_model, "layers": args.layers, "heads": args.heads, "rows": rows,
              "step_times": times}
    _plot(result, out_dir / "kerple-table4.png")
    return result


def _plot(result: dict, path) -> None:
    from ..plotting import pyplot, save

    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["ratio_to_log"] for r in rows], width=0.4, label="ours (CPU, small LM)")
    ax.bar([i + 0.2 for i in x], [r["paper_ratio_to_log"] or 0 for r in rows], width=0.4,
           label="paper (A100, 162M)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(list(x), [r["position"] for r in rows], fontsize=8)
    ax.set_ylabel("sec/step relative to KERPLE-log")
    ax.set_title(f"KERPLE Table 4: L = {result['train_length']}, d = {result['d_model']}, "
                 f"{result['layers']} layers, {result['threads']} thread", fontsize=9)
    ax.legend(fontsize=7)
    save(fig, path)
