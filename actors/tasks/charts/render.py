"""A chart drawn to PNG bytes with matplotlib's Agg canvas (headless), the same bytes for the same chart.

    png = render_png(chart)          # 448 x 336 px, RGBA PNG
    url = data_url(png)              # "data:image/png;base64,iVBORw0..."

Every bar and every point carries its value as a label (the whole number the figures hold, with
thousands commas), over light gridlines, so each number a question needs can be read off the
image. The figure's size and DPI are fixed (`WIDTH_PX` x `HEIGHT_PX`), the style is matplotlib's
default whatever the local matplotlibrc says, and the PNG's metadata holds no software version,
so the bytes are a function of the chart (and of the installed matplotlib and fonts).
matplotlib is imported at the first render, not when the task package is imported.
"""
from __future__ import annotations

import base64
import io

from .figures import UNITS, Chart

WIDTH_PX, HEIGHT_PX, DPI = 448, 336, 100
COLORS = ("#1f77b4", "#d62728")


def draw(chart: Chart):
    """The chart as a matplotlib `Figure` (not yet saved); its texts are the labels a reader sees."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI)
    ax = fig.add_subplot()
    positions = list(range(len(chart.categories)))
    top = max(max(s.values) for s in chart.series)
    width = 0.6 / len(chart.series)   # side by side where there are two series
    for i, series in enumerate(chart.series):
        if chart.kind == "bar":
            shift = (i - (len(chart.series) - 1) / 2) * width
            bars = ax.bar([x + shift for x in positions], series.values, width=width, color=COLORS[i],
                          label=series.name)
            ax.bar_label(bars, labels=[f"{v:,}" for v in series.values], padding=2,
                         fontsize=8 if len(chart.series) == 1 else 6.5)
        else:
            ax.plot(positions, series.values, marker="o", color=COLORS[i], label=series.name)
            offset = 6 if i == 0 else -12   # the first series is above the second: labels apart
            for x, v in zip(positions, series.values):
                ax.annotate(f"{v:,}", (x, v), textcoords="offset points", xytext=(0, offset), ha="center",
                            fontsize=8, color=COLORS[i])
    ax.set_xticks(positions, [c.replace(" ", "\n") for c in chart.categories], fontsize=8)
    ax.set_ylim(0, top * (1.18 if len(chart.series) == 1 else 1.4))   # room for the labels (and legend)
    ax.tick_params(axis="y", labelsize=8)
    ax.set_ylabel(UNITS[chart.unit].axis, fontsize=8)
    ax.set_title(chart.title, fontsize=9, wrap=True)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    if len(chart.series) > 1:
        ax.legend(fontsize=7, loc="upper center", ncols=2)
    fig.tight_layout()
    return fig


def render_png(chart: Chart) -> bytes:
    """The chart's PNG bytes, `WIDTH_PX` x `HEIGHT_PX`, deterministic (module docstring)."""
    import matplotlib.style

    with matplotlib.style.context("default"):
        fig = draw(chart)
        out = io.BytesIO()
        fig.savefig(out, format="png", dpi=DPI, metadata={"Software": None})
    return out.getvalue()


def data_url(png: bytes) -> str:
    """`png` as a data URL, what an OpenAI-style image_url content part carries."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")
