"""matplotlib, when installed (the `[bench]`/`[train]`/`[test]` extras): every command that
draws a plot skips it, and still writes its JSON, on a base install."""
from __future__ import annotations


def pyplot():
    """`matplotlib.pyplot` with the non-interactive Agg backend, or None if matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(fig, path, dpi: int = 120) -> None:
    """Lay out `fig`, write it to `path` and free it (pyplot keeps every open figure)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
