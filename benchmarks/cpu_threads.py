"""CPU forwards on every core against one thread, side by side in one run, each in a process as a server has it.

A server process loads one engine in its main thread and runs its forwards in the scheduler's thread. Each
setting runs in processes of its own, as a server would (one engine, loaded in the main thread), the two
taking turns, a fresh process each round: forwards on `--threads` intra-op threads (torch's default: the
cores), and on 1 (EngineConfig.cpu_threads). Each times decode steps of several calls at once and prefills;
medians over rounds. `--shape` or `--checkpoint` pick the model (default: the reference model). `--against REV`
runs both settings on that git revision's engine too, in the same rounds (benchmarks.revision). Writes JSON and a
plot.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext

import torch
from tqdm import tqdm

from braid.engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
from braid.models import REFERENCE_MODEL
from braid.models.checkpoints import add_model_arguments, benchmark_model
from braid.results import grouped_bars, write_json

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (benchmarks.revision; last, so
# that a revision's `braid` on PYTHONPATH comes first)
from benchmarks.revision import labels, sides  # noqa: E402

SETTINGS = {"every core": 0, "one thread": 1}  # name: EngineConfig.cpu_threads (0 here: --threads)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p, shape=None)  # (neither --shape nor --checkpoint: the reference model)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of the 'every core' setting "
                                                                        "(default: the cores, torch's default)")
    p.add_argument("--calls", type=int, nargs="+", default=[1, 16, 64], help="decode calls at once")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per round")
    p.add_argument("--prefill", type=int, nargs="+", default=[128, 256, 512], help="prefills timed (tokens)")
    p.add_argument("--rounds", type=int, default=5, help="processes per configuration")
    p.add_argument("--against", help="also run both settings on this git revision's engine, side by side")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--worker", choices=list(SETTINGS), help=argparse.SUPPRESS)  # (one process: this setting)
    p.add_argument("--worker-json", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def decode_step_s(engine: Engine, parents: list[str], calls: int, steps: int) -> float:
    """Seconds per decode step of `calls` calls at once (each a few header tokens after `parents`)."""
    sampling = SamplingParams(max_tokens=steps, ignore_eos=True)
    stream = engine.decode_stream([DecodeCall(list(range(20, 24 + i % 8)), parents=parents, sampling=sampling)
                                   for i in range(calls)])
    events = iter(stream)
    next(events)  # (from the first token: the headers' prefill is not a decode step)
    start = time.perf_counter()
    for _ in events:
        pass
    took = (time.perf_counter() - start) / (steps - 1)
    for mid in stream.ids:
        engine.free(mid)
    return took


def prefill_s(engine: Engine, tokens: list[int]) -> float:
    start = time.perf_counter()
    ids = engine.prefill([PrefillCall(tokens)])
    took = time.perf_counter() - start
    for mid in ids:
        engine.free(mid)
    return took


def worker(args) -> dict[str, float]:
    """One server-like process: one engine of the setting `args.worker`; each case's seconds (the best of 3)."""
    engine = Engine(EngineConfig(args.checkpoint, device="cpu", dtype="float32",
                                 cpu_threads=SETTINGS[args.worker] or args.threads, prefix_caching=False))
    vocab = engine.spec.vocab_size
    parents = engine.prefill([PrefillCall([8 + i % (vocab - 8) for i in range(64)])])
    cases = {**{f"decode, {c} calls": lambda c=c: decode_step_s(engine, parents, c, args.steps) for c in args.calls},
             **{f"prefill, {n} tokens": lambda n=n: prefill_s(engine, [8 + (7 * i) % (vocab - 8) for i in range(n)])
                for n in args.prefill}}
    for run in cases.values():  # warm-up, not timed
        run()
    return {case: min(run() for _ in range(3)) for case, run in cases.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not (args.checkpoint or args.shape):
        args.checkpoint = REFERENCE_MODEL
    if args.worker:
        with open(args.worker_json, "w") as f:
            json.dump(worker(args), f)
        return 0
    times: dict[tuple[str, str], list[float]] = {}  # (case, setting or "setting @ revision"): seconds per round
    this, rev = labels(args.against) if args.against else (None, None)
    with tempfile.TemporaryDirectory() as tmp:
        args.device = "cpu"
        args.checkpoint, _ = benchmark_model(args, tmp)  # (a random one of --shape, saved for the processes)
        from braid.engine.model import fingerprint_checkpoint  # (here: a worker may run another revision's braid)

        weights = fingerprint_checkpoint(args.checkpoint)
        with sides(args.against, tmp) if args.against else nullcontext({"this tree": ""}) as paths:
            for r in tqdm(range(args.rounds), desc="rounds", unit="round"):
                for side, pythonpath in list(paths.items())[::1 if r % 2 == 0 else -1]:  # (each side first in turn)
                    for i, name in enumerate(SETTINGS):  # (turns: each sees the machine as it is in that round)
                        out = os.path.join(tmp, f"{r}-{side}-{i}.json")
                        env = dict(os.environ, PYTHONPATH=pythonpath) if pythonpath else None
                        subprocess.run([sys.executable, __file__, "--checkpoint", args.checkpoint, "--device", "cpu",
                                        "--steps", str(args.steps), "--threads", str(args.threads),
                                        "--prefill", *map(str, args.prefill),
                                        "--calls", *map(str, args.calls), "--worker", name, "--worker-json", out],
                                       check=True, stderr=subprocess.DEVNULL, env=env)
                        with open(out) as f:
                            for case, seconds in json.load(f).items():
                                key = f"{name} @ {side}" if side == rev else name
                                times.setdefault((case, key), []).append(seconds)
    against = [f"{name} @ {rev}" for name in SETTINGS] if rev else []
    rows = []
    for case in dict.fromkeys(case for case, _ in times):
        ms = {name: 1e3 * statistics.median(times[(case, name)]) for name in [*SETTINGS, *against]}
        rows.append({"case": case, "ms": ms, "one_thread_x": ms["every core"] / ms["one thread"]})
        line = (f"{case:>20}: every core ({args.threads}) {ms['every core']:7.1f} ms, one thread "
                f"{ms['one thread']:7.1f} ms: one thread {rows[-1]['one_thread_x']:.2f}x as fast")
        if against:
            before = ms[f"every core @ {rev}"]
            rows[-1]["every_core_x_against"] = before / ms["every core"]
            line += (f"; every core at {rev}: {before:7.1f} ms "
                     f"({rows[-1]['every_core_x_against']:.2f}x)")
        print(line)
    model = args.shape and f"random {args.shape}-shape llama" or os.path.basename(os.path.normpath(args.checkpoint))
    result = {"model": model, "cores": os.cpu_count(), "torch": torch.__version__, "rounds": args.rounds,
              "threads": args.threads, "this": this, "against": rev, "rows": rows,
              "times_s": {f"{case} @ {name}": v for (case, name), v in times.items()}}
    stem = write_json(args.out, f"cpu_threads_{args.shape or model}{'_against' if against else ''}", result,
                      device="cpu", model=weights, calibration=None)
    plot(result, stem)
    from braid.results import written  # (this tree's: a child under a revision's braid never reaches here)

    print(written(stem + ".json"))
    return 0


def plot(result: dict, stem: str) -> None:
    rows = result["rows"]
    groups = [r["case"].split(", ")[1].replace(" tokens", " tok").replace(" ", "\n") for r in rows]
    grouped_bars(stem, f"CPU threads: {result['model']}", groups,
                 [("ms (decode: per step)", {name: [r["ms"][name] for r in rows] for name in rows[0]["ms"]})],
                 xlabel="decode steps of N calls, then prefills of N tokens")


if __name__ == "__main__":
    raise SystemExit(main())
