"""Interleaved A/B of a benchmark: this tree's copy against another revision's, in turns, medians compared.

Each repeat runs the benchmark once per side, each side its own revision's script under its own `braid`
(benchmarks.revision), the side going first alternating, so that a slow spell of the machine hits both alike.
The figures compared are read from each run's JSON (FIGURES: per benchmark, which numbers and whether higher
is better): the median over the repeats of each side, this tree over the other revision, and the median of the
repeats' own ratios (each repeat's two runs are next to each other in time, so that one holds up where the
machine drifts from repeat to repeat). Writes JSON and a plot of every repeat's figures.

    python benchmarks/ab.py --against 6f629b6 --repeats 5 synthesis_ttft -- --lengths 512 --repeats 3
    python benchmarks/ab.py --against 6f629b6 --repeats 5 serving -- --concurrency 16
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (benchmarks.revision)

from benchmarks.revision import labels, sides  # noqa: E402
from braid.results import pyplot, write_json, written  # noqa: E402


def _ttft(result: dict) -> dict[str, float]:
    """synthesis_ttft: each mode's median TTFT (ms) at each branch length."""
    return {f"{key[:-8]}@{row['branch_tokens']}": value for row in result["rows"]
            for key, value in row.items() if key.endswith("_ttft_ms")}


def _serving(result: dict) -> dict[str, float]:
    """serving: the scheduler's output token throughput (tok/s) and median TTFT (ms) per transport and level."""
    out = {}
    for row in result["rows"]:
        if row["engine"] == "scheduler":
            at = f"{row['transport']}@c{row['concurrency']}"
            out[f"tok_per_s/{at}"] = row["generated_token_throughput"]
            out[f"median_ttft_ms/{at}"] = row["median_ttft_ms"]
    return out


# benchmark -> (its script, the JSON it writes (a glob in its --out), figures from it, is a figure better higher)
FIGURES = {
    "synthesis_ttft": ("benchmarks/synthesis_ttft.py", "synthesis_ttft_*.json", _ttft, lambda name: False),
    "serving": ("benchmarks/serving.py", "serving_cpu.json", _serving, lambda name: name.startswith("tok_per_s")),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", required=True, metavar="REV", help="the other git revision")
    p.add_argument("--repeats", type=int, default=5, help="runs per side (at least 5 for a claim)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the plot")
    p.add_argument("--name", help="the result's name (default: ab_<benchmark>)")
    p.add_argument("benchmark", choices=sorted(FIGURES))
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark, after --")
    return p.parse_args(argv)


def run_side(tree: str, pythonpath: str, script: str, pattern: str, args: list[str], out: str) -> dict:
    """One run of `script` from checkout `tree` under `pythonpath`; its JSON result."""
    env = {**os.environ, "PYTHONPATH": pythonpath}
    subprocess.run([sys.executable, os.path.join(tree, script), *args, "--out", out], check=True, cwd=tree, env=env,
                   stdout=subprocess.DEVNULL)
    found = sorted(glob.glob(os.path.join(out, pattern)))
    if not found:
        raise RuntimeError(f"{script} wrote no {pattern} in {out}")
    with open(found[0]) as f:
        return json.load(f)


def main(argv=None) -> int:
    args = parse_args(argv)
    script, pattern, figures, higher = FIGURES[args.benchmark]
    extra = args.args[1:] if args.args[:1] == ["--"] else args.args
    this, rev = labels(args.against)
    runs: dict[str, list[dict[str, float]]] = {"this": [], "against": []}  # (the labels may be one commit)
    stamps: dict[str, dict | None] = {}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory(prefix="braid-ab-") as tmp, sides(args.against, tmp) as paths:
        trees = {"this": root, "against": os.path.join(tmp, "tree")}
        pythonpaths = dict(zip(("this", "against"), paths.values()))
        label = {"this": this, "against": rev}
        for i in range(args.repeats):
            order = ["this", "against"] if i % 2 == 0 else ["against", "this"]
            for side in order:
                raw = run_side(trees[side], pythonpaths[side], script, pattern, extra,
                               os.path.join(tmp, "out", side, str(i)))
                stamps.setdefault(side, raw.get("stamp"))  # (this tree's run stamps its result; another may not)
                got = figures(raw)
                runs[side].append(got)
                print(f"repeat {i + 1}/{args.repeats} {label[side]}: "
                      + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
    names = [n for n in runs["this"][0] if all(n in r for r in runs["this"] + runs["against"])]
    compared = {}
    for n in names:
        a, b = statistics.median(r[n] for r in runs["this"]), statistics.median(r[n] for r in runs["against"])
        paired = statistics.median(x[n] / y[n] for x, y in zip(runs["this"], runs["against"]))
        slower = b / a if higher(n) else a / b  # (above 1: this tree is slower)
        compared[n] = {"this_median": a, "against_median": b, "this_over_against": a / b,
                       "paired_ratio_median": paired, "slowdown": slower - 1, "higher_is_better": higher(n)}
        print(f"{n:<36} {this} {a:10.1f}  {rev} {b:10.1f}  {this}/{rev} {a / b:.3f} (paired {paired:.3f})  "
              f"({'slower' if slower > 1 else 'faster'} by {100 * abs(slower - 1):.1f}%)")
    result = {"benchmark": args.benchmark, "args": extra, "this": this, "against": rev, "repeats": args.repeats,
              "runs": runs, "compared": compared}
    measured = stamps["this"]  # (what the benchmark's own run stamped: its device and fingerprints)
    stem = write_json(args.out, args.name or f"ab_{args.benchmark}", result, device=measured["device"],
                      model=measured["model"], calibration=measured["calibration"])
    plot(result, stem + ".png")
    print(written(stem + ".json"))
    return 0


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = list(result["compared"])
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(names)), 3.6))
    for k, side in enumerate(("this", "against")):
        for j, n in enumerate(names):
            ys = [r[n] / result["compared"][n]["against_median"] for r in result["runs"][side]]
            ax.scatter([j + (k - 0.5) * 0.2] * len(ys), ys, s=12, color=f"C{k}",
                       label=result[side] if j == 0 else None)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    ax.set(ylabel=f"over {result['against']}'s median", title=f"{result['benchmark']}: interleaved A/B")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
