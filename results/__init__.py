"""What every benchmark and evaluation does with its result: a stamped JSON file, and a plot when matplotlib is there.

The measurement contract: every results JSON carries a `stamp` that says what was measured and where: the commit
(and whether the tree had uncommitted changes), the weights' and the calibration's fingerprints, the device and
its name, and the torch version. `write_json` adds it; the docs' result pages read it back
(`benchmarks/report.py`), so a table says which checkpoint its rows were measured on. `unclean` says why a file's
figures do not stand as measured (a dirty tree, a stamp backfilled afterwards): the headline and the target tests
read only files it passes.

Outside a git checkout (a copy of the tree on a device machine, an installed wheel), $BRAID_COMMIT and
$BRAID_DIRTY name the commit; with neither, it is "unknown".
"""

import datetime
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # (the checkout, also through a linked package)
UNKNOWN = "unknown"  # a stamp field that was not recorded when the file was written
NONE = "none"  # no weights (or no calibration) were part of the measurement
STAMP_FIELDS = ("commit", "dirty", "model", "calibration", "device", "device_name", "torch", "written")


def device_name(device: str) -> str:
    """A result's device: "cpu", or the GPU's name ("unknown" stays so: a server measured from its client)."""
    device = str(device)
    if not device.startswith("cuda"):
        return device
    import torch

    return torch.cuda.get_device_name(device)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def commit() -> tuple[str, bool | None]:
    """(the commit the code was measured at, whether tracked files differed from it); ("unknown", None) when
    neither git nor $BRAID_COMMIT says."""
    if os.environ.get("BRAID_COMMIT"):
        dirty = os.environ.get("BRAID_DIRTY")
        return os.environ["BRAID_COMMIT"], None if dirty is None else dirty.lower() in ("1", "true", "yes")
    head = _git("rev-parse", "HEAD")
    if head is None:
        return UNKNOWN, None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return head.strip(), None if status is None else bool(status.strip())


def stamp(*, device: str, model: str | None, calibration: str | None) -> dict:
    """The measurement contract's record. `device`: "cpu" or a CUDA device ("cuda", "cuda:0");
    `model`: the fingerprint of the weights measured (the engine's `fingerprint`), None when no weights were;
    `calibration`: the digest of the calibration served (`Calibration.digest`), None when none was."""
    import torch

    sha, dirty = commit()
    return {"commit": sha, "dirty": dirty, "model": model or NONE, "calibration": calibration or NONE,
            "device": device, "device_name": device_name(device), "torch": torch.__version__,
            "written": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def write_json(out_dir: str, name: str, result: dict, *, device: str, model: str | None,
               calibration: str | None) -> str:
    """Writes out_dir/name.json, `result` under its stamp (see `stamp` for the keywords); returns the path stem
    for the plot."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, name)
    text = json.dumps({"stamp": stamp(device=device, model=model, calibration=calibration), **result}, indent=2)
    with open(stem + ".json.tmp", "w") as f:  # (whole or not at all: a failed dump leaves an old result intact)
        f.write(text)
    os.replace(stem + ".json.tmp", stem + ".json")
    return stem


def write_json_to(path: str, result: dict, *, device: str, model: str | None, calibration: str | None) -> str:
    """`write_json` to a file path (".json" or none); returns the path stem for the plot."""
    return write_json(os.path.dirname(os.path.abspath(path)), os.path.splitext(os.path.basename(path))[0], result,
                      device=device, model=model, calibration=calibration)


def unclean(result: dict) -> str | None:
    """Why a result's figures do not stand as measured under the contract, or None where they do. A figure stands
    when its stamp names the commit it ran at, that tree had no uncommitted changes, and the stamp was written by the
    run (a backfilled one names the commit that last wrote the file, from the history, afterwards). Where the file's
    own record names the tree it measured (an A/B's or an `--against` run's `this`, "abc1234" or
    "abc1234+changes"), the stamp must say the same."""
    stamp = result.get("stamp")
    if not isinstance(stamp, dict):
        return "no stamp"
    sha = str(stamp.get("commit") or UNKNOWN)
    why = []
    if stamp.get("backfilled"):
        why.append(f"backfilled stamp: never measured under the stamp contract (its commit, {sha[:7]}, is the last "
                   "that wrote the file)")
    elif sha == UNKNOWN:
        why.append("its stamp names no commit")
    elif stamp.get("dirty") is None:
        why.append(f"not known whether the tree at commit {sha[:7]} was clean")
    elif stamp.get("dirty"):
        why.append(f"dirty tree at commit {sha[:7]}")
    this = result.get("this")
    if isinstance(this, str) and this:
        head, changes = this.removesuffix("+changes"), this.endswith("+changes")
        if not sha.startswith(head) or (changes and not stamp.get("dirty")) or (not changes and stamp.get("dirty")):
            said = f"{head} with uncommitted changes" if changes else f"{head} as committed"
            stamped = f"{sha[:7]}{' with uncommitted changes' if stamp.get('dirty') else ''}"
            why.append(f"its record says it measured {said}, its stamp {stamped}")
    return "; ".join(why) or None


def pyplot():
    """matplotlib.pyplot on a file backend, or None when matplotlib is missing (`written` then says so)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def written(json_path: str, plot_path: str | None = None) -> str:
    """The line a tool prints once it wrote `json_path` and tried its plot (default: the same stem's .png): the
    plot named only where it was written."""
    plot_path = plot_path or os.path.splitext(json_path)[0] + ".png"
    if pyplot() is None:
        return f"wrote {json_path} (no plot: matplotlib is not installed; pip install 'braid[bench]' adds it)"
    return f"wrote {json_path} and its plot, {plot_path}" if os.path.exists(plot_path) else f"wrote {json_path}"


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
