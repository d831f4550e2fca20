"""FastRPB reproduction: the paper's Tables 1–2 and the verdict rule against them.

Numbers copied from the paper's text (Zubkov & Gavrilov, arXiv:2202.11364): accuracy (%)
mean ± std, "None" (trainable absolute positions only) and "FastRPB" columns of Table 1
(LRA ListOps and CIFAR10) and the "w/o" / "w/ FastRPB" columns of Table 2 (MNIST F1).
Each table's claim, in the paper's words: ListOps, "the best performance was obtained by
the model without any relative positional encoding"; CIFAR, "usage of FastRPB was shown to
decrease the model's performance"; MNIST, "each of the above models equipped with FastRPB
showed superior performance". Table 1 has no ELU+1 row and Table 2 no ReLU row.
"""
from __future__ import annotations

#: paper table -> (claim, our task compared with it, {kernel: ((mean, std) without, (mean, std) with)})
PAPER = {
    "Table 1, ListOps": ("no gain", "listops", {
        "softmax": ((14.43, 4.73), (14.6, 4.14)), "dpfp": ((20.67, 3.95), (17.97, 11.68)),
        "exp": ((12.55, 3.8), (11.47, 4.79)), "relu": ((17.58, 1.01), (17.67, 0.59)),
        "prf": ((17.80, 0.00), (17.75, 0.39))}),
    "Table 1, CIFAR10": ("hurts", "images", {
        "softmax": ((41.88, 0.48), (39.02, 0.22)), "dpfp": ((41.79, 0.27), (38.73, 0.09)),
        "exp": ((41.96, 0.47), (38.89, 0.15)), "relu": ((42.25, 0.01), (38.44, 0.38)),
        "prf": ((41.81, 1.16), (32.26, 9.53))}),
    "Table 2, MNIST (F1)": ("helps", "images", {
        "softmax": ((97.34, 0.23), (98.27, 0.19)), "dpfp": ((97.09, 0.19), (97.66, 0.22)),
        "exp": ((96.49, 0.20), (97.37, 0.35)), "elu": ((94.01, 0.31), (96.71, 0.40)),
        "prf": ((96.6, 0.29), (97.52, 0.26))}),
}
PAPER_ROWS = {"softmax": "Original", "dpfp": "Linear, DPFP", "exp": "Linear, SIKF", "relu": "Linear, ReLU",
              "elu": "Linear, ELU + 1", "prf": "Performer"}
VERDICTS = ("reproduced", "not reproduced", "contradicted", "inconclusive at this scale")
#: "no gain" is reproduced when our 95 % interval of the gain lies below this (accuracy fraction)
NO_GAIN_MARGIN = 0.01


def verdict(claim: str, diff: float | None, p: float | None, ci: tuple[float, float] | None,
            paper_diff: float | None, alpha: float = 0.05) -> str:
    """One of `VERDICTS` for a paper claim ("helps", "hurts", "no gain") against our paired
    accuracy differences (with − without, fractions): `diff` their mean, `p` the two-sided
    paired t-test, `ci` its 95 % interval, `paper_diff` the paper's difference (fraction).

    helps / hurts: significant (p < alpha) in the claimed direction -> reproduced; in the other
    -> contradicted; not significant but the paper's difference outside our interval -> not
    reproduced; else inconclusive. no gain: a significant gain -> contradicted; a gain above
    `NO_GAIN_MARGIN` excluded by our interval -> reproduced; else inconclusive."""
    if diff is None or p is None or ci is None:
        return VERDICTS[3]
    significant = p < alpha
    if claim == "no gain":
        if significant and diff > 0:
            return VERDICTS[2]
        return VERDICTS[0] if ci[1] < NO_GAIN_MARGIN else VERDICTS[3]
    if claim not in ("helps", "hurts"):
        raise ValueError(f"verdict: unknown claim {claim!r}")
    sign = 1.0 if claim == "helps" else -1.0
    if significant and sign * diff > 0:
        return VERDICTS[0]
    if significant and sign * diff < 0:
        return VERDICTS[2]
    if paper_diff is not None and not ci[0] <= paper_diff <= ci[1]:
        return VERDICTS[1]
    return VERDICTS[3]


def compare(summary: list[dict], pooled: dict, alpha: float = 0.05) -> list[dict]:
    """One row per paper table × kernel we ran that the table has (plus a pooled row per table
    over all our kernels of that task): the paper's numbers, ours, and the verdict."""
    rows = []
    for table, (claim, task, cells) in PAPER.items():
        ours = [r for r in summary if r["task"] == task]
        for r in ours:
            if r["kernel"] not in cells:
                continue
            (pw, pws), (pf, pfs) = cells[r["kernel"]]
            paper_diff = (pf - pw) / 100
            rows.append({"table": table, "claim": claim, "task": task, "kernel": r["kernel"],
                         "paper_row": PAPER_ROWS[r["kernel"]], "paper_without": pw, "paper_without_std": pws,
                         "paper_with": pf, "paper_with_std": pfs, "paper_diff": round(100 * paper_diff, 2),
                         "verdict": verdict(claim, r["acc_diff"], r["p"], r["ci95"], paper_diff, alpha)})
        if task in pooled and ours:
            pl = pooled[task]
            diffs = [(cells[r["kernel"]][1][0] - cells[r["kernel"]][0][0]) / 100 for r in ours if r["kernel"] in cells]
            paper_diff = sum(diffs) / len(diffs) if diffs else None
            rows.append({"table": table, "claim": claim, "task": task, "kernel": "pooled",
                         "paper_row": "mean over its rows", "paper_diff": None if paper_diff is None
                         else round(100 * paper_diff, 2),
                         "verdict": verdict(claim, pl["acc_diff"], pl["p"], pl["ci95"], paper_diff, alpha)})
    return rows
