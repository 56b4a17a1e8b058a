"""Host time of decode steps with many calls: this tree's engine against another revision's, side by side.

A decode step of G calls costs the model's forward plus host work that grows with G: picking each call's rows,
its slots and mask, the shared attention's gathers, sampling, events. With a model too small to cost anything
(--shape tiny, the default), a step's time is that host work. Each side runs in processes of its own, the sides
taking turns, a fresh process each round, on the same random weights: this tree, and `--against REV`, checked
out with `git worktree` and imported in its place (its package layout read from its pyproject). For each G:
the scheduler's busy time per step (median over rounds), tokens per second, and this tree's speedup. JSON and
a plot.

    python benchmarks/step_host.py --against 63de3fa
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (benchmarks.profile_decode: the concurrent decode, measured the same way here; last, so that a revision's
# `braid` on PYTHONPATH comes first)
sys.path.append(ROOT)


def parse_args(argv=None):
    from braid.models.checkpoints import add_model_arguments

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p, shape="tiny")
    p.add_argument("--against", default="HEAD~1", help="the git revision to run side by side (default: HEAD~1)")
    p.add_argument("--calls", type=int, nargs="+", default=[1, 4, 16, 64], help="calls decoding at once")
    p.add_argument("--tokens", type=int, default=32, help="tokens each call decodes")
    p.add_argument("--context", type=int, default=64, help="tokens of the prompt every call reads")
    p.add_argument("--repeats", type=int, default=3, help="measurements per process (its median kept)")
    p.add_argument("--rounds", type=int, default=5, help="fresh processes per side, taking turns")
    p.add_argument("--decode-graphs", default="auto", choices=["auto", "off", "eager"],
                   help="EngineConfig.decode_graphs (auto: graphs on CUDA, forwards as they come on CPU; eager: "
                        "the static padded forwards without capturing them)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # (a measuring process: the checkpoint to load)
    p.add_argument("--out", default="benchmarks/results")
    return p.parse_args(argv)


def measure(args) -> dict:
    """(In a child process) the busy time per step and tokens/s at each --calls, on the engine importable here."""
    import torch

    from benchmarks.profile_decode import concurrent_decode
    from braid.engine import Engine, EngineConfig, PrefillCall

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    eng = Engine(EngineConfig(args.child, device=device, decode_graphs=args.decode_graphs))
    ctx = eng.prefill([PrefillCall(list(range(3, 3 + args.context)))])
    out = {}
    for n in args.calls:
        concurrent_decode(eng, ctx, 8, n)  # (warm-up: buckets, allocator)
        runs = []
        for _ in range(args.repeats):
            steps, busy = eng.scheduler.steps, eng.scheduler.busy_s
            rate = concurrent_decode(eng, ctx, args.tokens, n)
            runs.append((1e3 * (eng.scheduler.busy_s - busy) / (eng.scheduler.steps - steps), rate))
        out[n] = {"ms_per_step": statistics.median(r[0] for r in runs),
                  "tokens_per_s": statistics.median(r[1] for r in runs)}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(measure(args)))
        return 0
    from tqdm import tqdm

    from benchmarks.revision import labels, sides
    from braid.engine.model import fingerprint_checkpoint
    from braid.models.checkpoints import benchmark_model
    from braid.results import device_name, grouped_bars, write_json, written

    head, rev = labels(args.against)
    with tempfile.TemporaryDirectory(prefix="braid-step-host-") as tmp:
        path, device = benchmark_model(args, os.path.join(tmp, "model"))
        weights = fingerprint_checkpoint(path)
        with sides(args.against, tmp) as paths:
            runs = {name: [] for name in paths}
            # (the measuring code, benchmarks.profile_decode's concurrent decode, is this tree's for both sides)
            child = [sys.executable, os.path.abspath(__file__), "--child", os.path.abspath(path), "--device", device,
                     "--calls", *map(str, args.calls), "--tokens", str(args.tokens), "--context", str(args.context),
                     "--repeats", str(args.repeats), "--decode-graphs", args.decode_graphs]
            for k in tqdm(range(args.rounds), desc="rounds", unit="round"):
                for name, pythonpath in list(paths.items())[::1 if k % 2 == 0 else -1]:  # (each side first in turn)
                    done = subprocess.run(child, env=dict(os.environ, PYTHONPATH=pythonpath), check=True,
                                          capture_output=True, text=True)
                    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
                    runs[name].append(json.loads(line.removeprefix("RESULT ")))
    rows = []
    for n in args.calls:
        row = {"calls": n}
        for name in runs:
            key = "this" if name == "this tree" else "against"
            row[f"{key}_ms_per_step"] = statistics.median(r[str(n)]["ms_per_step"] for r in runs[name])
            row[f"{key}_tokens_per_s"] = statistics.median(r[str(n)]["tokens_per_s"] for r in runs[name])
        row["speedup"] = row["against_ms_per_step"] / row["this_ms_per_step"]
        rows.append(row)
        print(f"{n:>3} calls: {row['this_ms_per_step']:6.2f} ms/step ({row['this_tokens_per_s']:7.0f} tokens/s) "
              f"against {row['against_ms_per_step']:6.2f} ms ({row['against_tokens_per_s']:7.0f}) at {rev}: "
              f"{row['speedup']:.2f}x", flush=True)
    result = {"device": device_name(device), "model": args.checkpoint or f"random {args.shape}-shape llama",
              "this": head, "against": rev, "decode_graphs": args.decode_graphs, "calls": args.calls,
              "tokens": args.tokens, "context": args.context, "rounds": args.rounds, "repeats": args.repeats,
              "rows": rows, "runs": runs}
    suffix = "cpu" if device == "cpu" else "cuda"
    graphs = "" if args.decode_graphs == "auto" else f"_{args.decode_graphs}"
    stem = write_json(args.out, f"step_host_{args.shape if not args.checkpoint else 'model'}{graphs}_{suffix}", result,
                      device=device, model=weights, calibration=None)
    grouped_bars(stem, f"decode step host time ({result['model']}, {result['device']})",
                 [str(n) for n in args.calls],
                 [("ms per step", {f"this tree ({head})": [r["this_ms_per_step"] for r in rows],
                                   rev: [r["against_ms_per_step"] for r in rows]}),
                  ("tokens/s", {f"this tree ({head})": [r["this_tokens_per_s"] for r in rows],
                                rev: [r["against_tokens_per_s"] for r in rows]})],
                 xlabel="calls decoding at once")
    print(written(stem + ".json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
