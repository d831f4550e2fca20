"""Memory per decoding step of a causal LM with KERPLE-log kernelized (NPRF) attention:
the sum-of-exponentials state (`backend="soe"`, constant size) against a KV cache
(`backend="auto"`, exact, grows with every token), on CPU.

Decodes `--tokens` tokens one at a time (greedy) after a one-token prompt. At every step it
records the bytes held by the decode state of all layers; every `--every` steps it also
measures the allocator's peak during that step (`fastrpe.bench.memory`). Writes JSON and
a plot, and prints the growth of both between the first and the last quarter of decoding.

    python benchmarks/decode_memory.py --out benchmarks/results/decode_memory.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch


def state_bytes(caches) -> int:
    total = 0
    for c in caches:
        if hasattr(c, "nbytes"):
            total += c.nbytes()
        elif hasattr(c, "S"):
            total += c.S.numel() * c.S.element_size()
        else:  # KVCache
            total += sum(t.numel() * t.element_size() for t in (c.k, c.v) if t is not None)
    return total


def decode(backend: str, tokens: int, every: int, d_model: int, layers: int, heads: int, seed: int) -> list[dict]:
    from fastrpe.bench.memory import allocator_peak_bytes
    from fastrpe.nn import DecoderLM, LMConfig

    torch.manual_seed(seed)
    model = DecoderLM(LMConfig(vocab_size=259, d_model=d_model, n_layers=layers, n_heads=heads, kernel="nprf",
                               position="kerple_log", backend=backend)).eval()
    rows = []
    tok = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        logits, caches = model.step(tok)
        for t in range(1, tokens):
            tok = logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            if t % every == 0 or t == tokens - 1:
                box = {}

                def one_step():
                    box["out"] = model.step(tok, caches)

                peak, _ = allocator_peak_bytes(one_step)
                logits, caches = box["out"]
                rows.append({"step": t, "state_bytes": state_bytes(caches), "step_peak_bytes": peak})
            else:
                logits, caches = model.step(tok, caches)
                rows.append({"step": t, "state_bytes": state_bytes(caches),
                             "seconds": time.perf_counter() - t0})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--every", type=int, default=50, help="measure the allocator peak every this many steps")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--backends", default="soe,auto", help="soe: SoE state; auto: KV cache (exact)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/decode_memory.json")
    a = ap.parse_args()
    runs = {}
    for b in a.backends.split(","):
        rows = decode(b, a.tokens, a.every, a.d_model, a.layers, a.heads, a.seed)
        prof = [r for r in rows if "step_peak_bytes" in r]
        q = max(1, len(prof) // 4)
        first, last = prof[:q], prof[-q:]
        growth = {
            "state_bytes_first_last": [rows[len(rows) // 4]["state_bytes"], rows[-1]["state_bytes"]],
            "step_peak_mean_first_quarter": sum(r["step_peak_bytes"] for r in first) / len(first),
            "step_peak_mean_last_quarter": sum(r["step_peak_bytes"] for r in last) / len(last),
        }
        timed = [r["seconds"] for r in rows if "seconds" in r]
        runs[b] = {"rows": rows, "summary": growth, "mean_step_seconds": sum(timed) / max(1, len(timed))}
        s = growth
        print(f"{b:5s}: state {s['state_bytes_first_last'][0] / 2**10:8.1f} KiB at step {a.tokens // 4} -> "
              f"{s['state_bytes_first_last'][1] / 2**10:8.1f} KiB at step {a.tokens - 1}; per-step allocator peak "
              f"{s['step_peak_mean_first_quarter'] / 2**10:8.1f} KiB (first quarter) -> "
              f"{s['step_peak_mean_last_quarter'] / 2**10:8.1f} KiB (last quarter); "
              f"{runs[b]['mean_step_seconds'] * 1e3:.2f} ms/step", flush=True)
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
            "model": {"d_model": a.d_model, "layers": a.layers, "heads": a.heads, "kernel": "nprf",
                      "position": "kerple_log"}, "tokens": a.tokens, "runs": runs,
            "command": "python benchmarks/decode_memory.py " + " ".join(sys.argv[1:])}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(meta, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: pip install matplotlib")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    labels = {"soe": "soe (SoEState)", "auto": "auto (KV cache)"}
    for b, run in runs.items():
        rows = run["rows"]
        axes[0].plot([r["step"] for r in rows], [r["state_bytes"] / 2**10 for r in rows], label=labels.get(b, b))
        prof = [r for r in rows if "step_peak_bytes" in r]
        axes[1].plot([r["step"] for r in prof], [r["step_peak_bytes"] / 2**10 for r in prof], marker="o",
                     label=labels.get(b, b))
    axes[0].set_ylabel("decode state, all layers (KiB)")
    axes[1].set_ylabel("allocator peak during one step (KiB)")
    for ax in axes:
        ax.set_xlabel("tokens decoded")
        ax.legend(fontsize=8)
    fig.suptitle(f"KERPLE-log NPRF LM decoding, {a.layers} layers, d={a.d_model}, CPU", fontsize=9)
    fig.tight_layout()
    fig.savefig(a.out.replace(".json", ".png"), dpi=120)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
