"""How much of each branch the synthesizer needs re-encoded, and in what order, to read it as from text.

    python -m braid.evals.refresh_probe --tasks multiqa --branches 6 --samples 20 \
        --refresh 1-1,3-1,3-10,2-10,4-6,99-0 --json benchmarks/results/refresh_probe_cpu.json

Each `head-tail` refresh (`methods.synthesis.Refresh`) runs twice on the same branches, uncalibrated and at
sequential placement: in parallel (every branch's runs read the earlier branches as shipped; what the served
refresh does) and in order (each run reads the runs before it re-encoded; a whole-branch refresh in order is
text re-prefill). Scored against text on the same tasks, paired, as `braid eval` scores (evals.harness).
"""

import argparse
import sys

from braid.engine import Engine, EngineConfig
from braid.evals.harness import TEXT, EvalConfig, Mode, evaluate, format_table, plot_accuracy, report, summarize
from braid.methods.synthesis import Placement, Refresh, SynthesisMode
from braid.models import REFERENCE_MODEL
from braid.models.tasks import TASKS
from braid.results import write_json_to, written


def parse_refresh(spec: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(x) for x in part.split("-")) for part in spec.split(",")]
    except ValueError:
        out = []
    if not out or any(len(p) != 2 or min(p) < 0 for p in out):
        raise argparse.ArgumentTypeError(f"--refresh takes HEAD-TAIL pairs, comma-separated (e.g. 1-1,3-10); "
                                         f"got {spec!r}")
    return out


def probe_modes(refreshes: list[tuple[int, int]]) -> list[Mode]:
    modes = [TEXT]
    for head, tail in refreshes:
        for order, sequential in (("parallel", False), ("in order", True)):
            modes.append(Mode(f"refresh {head}-{tail} {order}",
                              SynthesisMode(Placement.SEQUENTIAL, refresh=Refresh(head, tail, sequential))))
    return modes


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m braid.evals.refresh_probe", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=REFERENCE_MODEL, help="checkpoint (default: the reference model)")
    p.add_argument("--tasks", default="multiqa", help=f"comma-separated, of {', '.join(TASKS)} (default: multiqa)")
    p.add_argument("--branches", default="6", help="comma-separated branch counts (default: 6)")
    p.add_argument("--samples", type=int, default=20, help="tasks per task and branch count (default: 20)")
    p.add_argument("--seed", type=int, default=0, help="first task seed (default: 0)")
    p.add_argument("--refresh", type=parse_refresh, default=parse_refresh("1-1,3-1,3-10,99-0"),
                   help="HEAD-TAIL tokens re-encoded at each end of every branch, comma-separated "
                        "(default: 1-1,3-1,3-10,99-0; 99-0 is every token)")
    p.add_argument("--json", help="write the table and every answer here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        branches = tuple(int(b) for b in args.branches.split(","))
        config = EvalConfig(tasks=tuple(args.tasks.split(",")), branches=branches, samples=args.samples, seed=args.seed)
    except ValueError as e:
        print(f"refresh_probe: error: {e}", file=sys.stderr)
        return 2
    engine = Engine(EngineConfig(args.model, device="cpu", dtype="float32", calibration="none"))
    modes = probe_modes(args.refresh)
    results = evaluate(engine, config, modes)
    print(format_table(summarize(results, modes)))
    if args.json:
        out = report(config, args.model, engine.fingerprint, modes, results)
        stem = write_json_to(args.json, out, device="cpu", model=engine.fingerprint, calibration=None)
        plot_accuracy(out["summary"], stem + ".png")
        print(written(stem + ".json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
