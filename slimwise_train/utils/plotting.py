"""matplotlib without a display, and figures written atomically (a reader never sees half a PNG)."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str | Path, dpi: int = 120) -> None:
    from slimwise_train.utils.atomic import atomic_path

    plt = pyplot()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    plt.close(fig)
