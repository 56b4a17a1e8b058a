"""What every benchmark and evaluation does with its result: a JSON file, and a plot when matplotlib is there."""

import json
import os
import sys


def device_name(device: str) -> str:
    """A result's device: "cpu", or the GPU's name."""
    if device == "cpu":
        return device
    import torch

    return torch.cuda.get_device_name(device)


def write_json(out_dir: str, name: str, result: dict) -> str:
    """Writes out_dir/name.json; returns the path stem for the plot."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, name)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    return stem


def pyplot():
    """matplotlib.pyplot on a file backend, or None (with a note) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return None
    return plt


def grouped_bars(stem: str, title: str, groups: list[str], panels: list[tuple[str, dict[str, list[float]]]],
                 xlabel: str = "") -> None:
    """stem.png: panels side by side, each (its y label, {series: one value per group}) drawn as bars grouped by
    `groups`, the series side by side in each group (the first panel carries the legend). Nothing without
    matplotlib."""
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False)
    for ax, (ylabel, series) in zip(axes[0], panels):
        width = 0.8 / len(series)
        for k, (name, values) in enumerate(series.items()):
            ax.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))], values, width, label=name)
        ax.set_xticks(list(range(len(groups))), groups)
        ax.set(xlabel=xlabel, ylabel=ylabel)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=110)
