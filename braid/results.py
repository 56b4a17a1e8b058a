"""What every benchmark and evaluation does with its result: a JSON file, and a plot when matplotlib is there."""

import json
import os
import sys


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
