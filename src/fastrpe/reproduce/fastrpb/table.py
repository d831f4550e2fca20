"""FastRPB reproduction: the printed accuracy table and the verdict table against the paper."""
from __future__ import annotations

KERNEL_LABELS = {"softmax": "softmax", "elu": "elu+1", "exp": "exp (SIKF)", "dpfp": "DPFP", "prf": "Performer",
                 "relu": "ReLU"}


def fmt(mean, std, pct: bool = True, signed: bool = False) -> str:
    if mean is None:
        return "—"
    f = (lambda v: f"{100 * v:{'+' if signed else ''}.1f}") if pct else (lambda v: f"{v:.3f}")
    return f(mean) + (f" ± {100 * std if pct else std:.1f}" if std is not None else "")


def _markdown(head, rows) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    return (["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
            + ["| " + " | ".join(str(x).ljust(w) for x, w in zip(row, widths)) + " |" for row in rows])


def _ci(ci) -> str:
    return "—" if ci is None else f"[{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"


def _p(p) -> str:
    return "—" if p is None else f"{p:.2g}"


def format_table(summary: list[dict], seeds: int) -> str:
    """Markdown: validation accuracy (%) without and with FastRPB per task × kernel, and the
    paired difference (mean ± std, 95 % interval, t-test p, seeds where FastRPB is better)."""
    lines = [f"validation accuracy (%), {'mean ± std over ' + str(seeds) + ' seeds' if seeds > 1 else 'one seed'}"]
    head = ("task", "kernel", "without FastRPB", "with FastRPB", "difference", "95% interval", "paired p",
            "with better")
    rows = [(r["task"], KERNEL_LABELS.get(r["kernel"], r["kernel"]), fmt(r["acc_without"], r["acc_without_std"]),
             fmt(r["acc_with"], r["acc_with_std"]), fmt(r["acc_diff"], r["acc_diff_std"], signed=True),
             _ci(r.get("ci95")), _p(r.get("p")), f"{r['with_better']}/{r['seeds']}") for r in summary]
    return "\n".join(lines + _markdown(head, rows))


def format_verdicts(comparison: list[dict], summary: list[dict], pooled: dict) -> str:
    """Markdown: per paper table and kernel, the paper's accuracy without → with FastRPB next
    to ours (difference, 95 % interval, paired p) and the verdict."""
    ours = {(r["task"], r["kernel"]): r for r in summary}
    head = ("paper table (claim)", "kernel", "paper: without → with (Δ)", "ours: without → with", "our Δ [95%]",
            "paired p", "verdict")
    rows = []
    for c in comparison:
        if c["kernel"] == "pooled":
            pl = pooled[c["task"]]
            paper = "—" if c["paper_diff"] is None else f"mean Δ {c['paper_diff']:+.2f}"
            us = f"{pl['with_better']}/{pl['n']} pairs better with"
            diff, ci, p = pl["acc_diff"], pl["ci95"], pl["p"]
        else:
            r = ours[(c["task"], c["kernel"])]
            paper = f"{c['paper_without']:.2f} → {c['paper_with']:.2f} ({c['paper_diff']:+.2f})"
            us = f"{fmt(r['acc_without'], None)} → {fmt(r['acc_with'], None)}"
            diff, ci, p = r["acc_diff"], r["ci95"], r["p"]
        label = "all kernels, pooled" if c["kernel"] == "pooled" else KERNEL_LABELS.get(c["kernel"], c["kernel"])
        rows.append((f"{c['table']} ({c['claim']})", label, paper, us, f"{fmt(diff, None, signed=True)} {_ci(ci)}",
                     _p(p), c["verdict"]))
    return "\n".join(["against the paper (our digits stand in for both CIFAR10 and MNIST)"] + _markdown(head, rows))
