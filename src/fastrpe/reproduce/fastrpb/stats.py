"""FastRPB reproduction: the per-cell statistics (mean ± std over seeds, paired differences)."""
from __future__ import annotations

import math


def subsample(xs: list[float], n: int = 100) -> list[list[float]]:
    """About `n` `[step, value]` points of a curve, the last one included, non-finite ones dropped."""
    step = max(1, math.ceil(len(xs) / n))
    keep = list(range(0, len(xs), step)) + ([len(xs) - 1] if xs and (len(xs) - 1) % step else [])
    return [[i, xs[i]] for i in keep if math.isfinite(xs[i])]


def mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (None for an empty list; std None for one value)."""
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    return m, ((sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else None)


def t_quantile(df: int, level: float = 0.95) -> float:
    """The two-sided `level` quantile of Student's t with `df` degrees of freedom (bisection on
    the p-value of `reproduce.extrapolation`)."""
    from ..extrapolation import t_two_sided_p

    lo, hi = 0.0, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > 1 - level else (lo, mid)
    return (lo + hi) / 2


def paired(diffs: list[float]) -> dict:
    """Paired test of the differences `diffs` (with − without): two-sided t-test p-value, t,
    and the 95 % interval of their mean (None each with fewer than two)."""
    from ..extrapolation import paired_t_test

    test = paired_t_test(diffs, [0.0] * len(diffs))
    mean, std = mean_std(diffs)
    ci = None
    if std is not None:
        half = t_quantile(len(diffs) - 1) * std / math.sqrt(len(diffs))
        ci = [mean - half, mean + half]
    return {"t": test["t"], "p": test["p"], "ci95": ci}


def summarize(runs: list[dict], tasks: list[str], kernels: list[str], seeds: list[int]) -> list[dict]:
    """One row per task × kernel: accuracy and loss without / with FastRPB (mean, std over
    seeds), diverged runs, and the paired accuracy difference (with − without, same seed):
    mean, std, per-seed signs, paired t-test and 95 % interval."""
    summary = []
    for task in tasks:
        for kernel in kernels:
            cell = {(r["fastrpb"], r["seed"]): r for r in runs if r["task"] == task and r["kernel"] == kernel}
            row = {"task": task, "kernel": kernel, "seeds": len(seeds)}
            for fastrpb, key in ((False, "without"), (True, "with")):
                rs = [r for (f, _), r in cell.items() if f == fastrpb]
                row[f"acc_{key}"], row[f"acc_{key}_std"] = mean_std([r["val_acc"] for r in rs])
                row[f"loss_{key}"], row[f"loss_{key}_std"] = mean_std(
                    [r["val_loss"] for r in rs if r["val_loss"] is not None])
                row[f"diverged_{key}"] = sum(r["diverged"] for r in rs)
            diffs = [cell[(True, s)]["val_acc"] - cell[(False, s)]["val_acc"] for s in seeds]
            row["acc_diff"], row["acc_diff_std"] = mean_std(diffs)
            row["with_better"] = sum(d > 0 for d in diffs)
            row["diffs"] = diffs
            row.update(paired(diffs))
            summary.append(row)
    return summary


def pooled(summary: list[dict]) -> dict:
    """Per task, the paired test over every kernel × seed difference of `summary`."""
    out = {}
    for task in dict.fromkeys(r["task"] for r in summary):
        diffs = [d for r in summary if r["task"] == task for d in r["diffs"]]
        out[task] = {"acc_diff": mean_std(diffs)[0], "n": len(diffs), "with_better": sum(d > 0 for d in diffs),
                     **paired(diffs)}
    return out
