"""FastRPB reproduction: the accuracy bar chart."""
from __future__ import annotations

from .table import KERNEL_LABELS


def plot(result: dict, path) -> None:
    """Bars of validation accuracy without / with FastRPB per kernel, one panel per task."""
    from ...plotting import pyplot, save

    plt = pyplot()
    if plt is None:
        return
    tasks, kernels = result["tasks"], result["kernels"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(1.3 * len(kernels) + 2.5, 3.6) if len(tasks) == 1
                             else (len(tasks) * (1.1 * len(kernels) + 1.5), 3.6), squeeze=False)
    width = 0.38
    for ax, task in zip(axes[0], tasks):
        rows = [r for r in result["summary"] if r["task"] == task]
        xs = range(len(rows))
        for off, key, label, color in ((-width / 2, "without", "without FastRPB", "#9aa5b1"),
                                       (width / 2, "with", "with FastRPB", "#d9534f")):
            means = [100 * (r[f"acc_{key}"] or 0.0) for r in rows]
            errs = [100 * (r[f"acc_{key}_std"] or 0.0) for r in rows]
            ax.bar([x + off for x in xs], means, width, yerr=errs if result["seeds"] > 1 else None, capsize=3,
                   label=label, color=color)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([KERNEL_LABELS.get(r["kernel"], r["kernel"]) for r in rows], fontsize=8)
        name = (f"ListOps, {result['data']['listops']['min_length']}..{result['data']['listops']['max_length']} tokens"
                if task == "listops" else
                f"{result['data']['images']['name']} ({'×'.join(map(str, result['data']['images']['image_size']))}, "
                f"patch {result['data']['images']['patch_size']})")
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("validation accuracy (%)")
        ax.set_ylim(0, 100)
        ax.legend(fontsize=7, loc="upper left")
    sd = f"mean ± std over {result['seeds']} seeds" if result["seeds"] > 1 else "one seed"
    fig.suptitle(f"FastRPB on/off per kernel: {result['steps']} steps, width {result['d_model']}, "
                 f"{result['layers']} layers, base position {result['base_position']}; {sd}", fontsize=9)
    save(fig, path)
