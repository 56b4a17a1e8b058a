"""CPU forwards on one intra-op thread against torch's default, side by side in one run, each as a server has it.

A server process loads one engine in its main thread and runs its forwards in the scheduler's thread. Each
configuration runs in processes of its own, as a server would (one engine, loaded in the main thread):
forwards on `--threads` intra-op threads (torch's default: the cores), and on 1 (EngineConfig.cpu_threads,
the default). The two take turns, a fresh process each round. Each times decode steps of 1, 16 and 64 calls at
once and a prefill; medians over rounds. Writes JSON and a plot.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from tqdm import tqdm

from braid.engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
from braid.models import REFERENCE_MODEL
from braid.results import grouped_bars, write_json


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=REFERENCE_MODEL, help="checkpoint (default: the reference model)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="the other engine's threads (default: "
                                                                        "the cores, torch's default)")
    p.add_argument("--calls", type=int, nargs="+", default=[1, 16, 64], help="decode calls at once")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per round")
    p.add_argument("--prefill", type=int, nargs="+", default=[128, 256, 512], help="prefills timed (tokens)")
    p.add_argument("--rounds", type=int, default=5, help="processes per configuration")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)  # (one process: this many threads)
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
    """One server-like process: one engine on `args.worker` threads; each case's seconds (the best of 3)."""
    engine = Engine(EngineConfig(args.model, device="cpu", dtype="float32", cpu_threads=args.worker,
                                 prefix_caching=False))
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
    if args.worker:
        with open(args.worker_json, "w") as f:
            json.dump(worker(args), f)
        return 0
    configs = (args.threads, 1)
    times: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in tqdm(range(args.rounds), desc="rounds", unit="round"):
            for n in configs:  # (turns: both see the machine as it is in that round)
                out = os.path.join(tmp, f"{r}-{n}.json")
                subprocess.run([sys.executable, __file__, "--model", args.model, "--steps", str(args.steps),
                                "--prefill", *map(str, args.prefill), "--calls", *map(str, args.calls),
                                "--worker", str(n), "--worker-json", out], check=True, stderr=subprocess.DEVNULL)
                with open(out) as f:
                    for case, seconds in json.load(f).items():
                        times.setdefault((case, n), []).append(seconds)
    cases = list(dict.fromkeys(case for case, _ in times))
    rows = []
    for case in cases:
        many, one = (statistics.median(times[(case, n)]) for n in configs)
        rows.append({"case": case, f"ms_{args.threads}_threads": 1e3 * many, "ms_1_thread": 1e3 * one,
                     "speedup_1_thread": many / one})
        print(f"{case:>24}: {args.threads} threads {1e3 * many:8.1f} ms, 1 thread {1e3 * one:8.1f} ms, "
              f"1 thread {many / one:.2f}x faster")
    result = {"model": args.model, "cores": os.cpu_count(), "torch": torch.__version__, "rounds": args.rounds,
              "threads": args.threads, "rows": rows, "times_s": {f"{c} @ {n}": v for (c, n), v in times.items()}}
    stem = write_json(args.out, "cpu_threads", result)
    plot(result, stem)
    print(f"wrote {stem}.json and its plot")
    return 0


def plot(result: dict, stem: str) -> None:
    rows, n = result["rows"], result["threads"]
    groups = [r["case"].split(", ")[1].replace(" tokens", " tok").replace(" ", "\n") for r in rows]
    grouped_bars(stem, "CPU forwards in a server-like process", groups,
                 [("ms (decode: per step)", {f"{n} threads (torch's default)": [r[f"ms_{n}_threads"] for r in rows],
                                             "1 thread (cpu_threads=1)": [r["ms_1_thread"] for r in rows]})],
                 xlabel="decode steps of N calls, then prefills of N tokens")


if __name__ == "__main__":
    raise SystemExit(main())
