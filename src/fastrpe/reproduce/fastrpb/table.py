"""FastRPB reproduction: the printed accuracy table."""
from __future__ import annotations

KERNEL_LABELS = {"softmax": "softmax", "elu": "elu+1", "exp": "exp (SIKF)", "dpfp": "DPFP", "prf": "Performer"}


def fmt(mean, std, pct: bool = True, signed: bool = False) -> str:
    if mean is None:
        return "—"
    f = (lambda v: f"{100 * v:{'+' if signed else ''}.1f}") if pct else (lambda v: f"{v:.3f}")
    return f(mean) + (f" ± {100 * std if pct else std:.1f}" if std is not None else "")


def format_table(summary: list[dict], seeds: int) -> str:
    """Markdown: validation accuracy (%) without and with FastRPB per task × kernel."""
    lines = [f"validation accuracy (%), {'mean ± std over ' + str(seeds) + ' seeds' if seeds > 1 else 'one seed'}"]
    head = ("task", "kernel", "without FastRPB", "with FastRPB", "difference", "with better")
    rows = [(r["task"], KERNEL_LABELS.get(r["kernel"], r["kernel"]), fmt(r["acc_without"], r["acc_without_std"]),
             fmt(r["acc_with"], r["acc_with_std"]), fmt(r["acc_diff"], r["acc_diff_std"], signed=True),
             f"{r['with_better']}/{r['seeds']}") for r in summary]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(str(x).ljust(w) for x, w in zip(row, widths)) + " |" for row in rows]
    return "\n".join(lines)
