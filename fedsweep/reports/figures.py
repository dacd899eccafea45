"""The one way a report makes a matplotlib figure: the Agg backend (no display needed), one size rule."""

from __future__ import annotations


def figure(width: float = 7, height: float = 4.2):
    """A matplotlib Figure, drawn without a display (Agg, unless a backend was already chosen)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110)
