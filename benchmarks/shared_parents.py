"""Parents read in place against parents copied into every call's work KV, side by side in one run.

Concurrent requests of the serving engine's shape: each prefills one shared task prompt (the same text for all,
so the prefix cache answers all but the first) and its own context after it, then decodes a reply reading both.
Two engines of the same model alternate: `share_parents` on (a parent placed where it was encoded is one run
in the pool for every call that reads it) and off (each call copies its parents into its own blocks). Both
get the same work-KV budget, sized to hold `--budget-calls` calls that copy; past that, calls wait. Per
concurrency: the work KV's peak, the most engine calls running at once, requests per second and mean time to
the first reply token. Writes JSON and a plot.
"""

import argparse
import statistics
import tempfile
import threading
import time

import torch
from tqdm import tqdm

from braid.engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
from braid.models.checkpoints import add_model_arguments, benchmark_model
from braid.results import grouped_bars, write_json


def request(eng: Engine, task: str, context: str, sampling: SamplingParams) -> float:
    """One request; returns the seconds from its start to its reply's first token."""
    start = time.perf_counter()
    prefix = eng.prefill([PrefillCall(task)])
    ctx = eng.prefill([PrefillCall(context, parents=prefix)])
    stream = eng.decode_stream([DecodeCall("Assistant:", parents=[*prefix, *ctx], sampling=sampling)])
    first = None
    for _ in stream:
        first = first or time.perf_counter() - start
    eng.free(ctx[0])
    for mid in stream.ids:
        eng.free(mid)
    eng.free(prefix[0])
    return first


def run_level(eng: Engine, n: int, task: str, sampling: SamplingParams, context_words: int) -> dict:
    peak = {"bytes": 0, "running": 0}
    done = threading.Event()

    def watch():
        while not done.is_set():
            load = eng.scheduler.load
            peak["bytes"] = max(peak["bytes"], load["reserved_bytes"])
            peak["running"] = max(peak["running"], load["running"])
            time.sleep(0.002)

    ttft = [0.0] * n
    contexts = [" ".join(f"c{i}w{j}" for j in range(context_words)) for i in range(n)]

    def one(i):
        ttft[i] = request(eng, task, contexts[i], sampling)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    done.set()
    watcher.join()
    return {"requests_per_s": n / seconds, "ttft_mean_ms": 1e3 * statistics.mean(ttft),
            "peak_work_kv_bytes": peak["bytes"], "most_running": peak["running"], "seconds": seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--task-words", type=int, default=400, help="words in the shared task prompt (default: 400)")
    p.add_argument("--context-words", type=int, default=16, help="words in each request's context (default: 16)")
    p.add_argument("--max-tokens", type=int, default=32, help="reply tokens (default: 32)")
    p.add_argument("--budget-calls", type=int, default=8,
                   help="the work-KV budget holds this many calls that copy their parents (default: 8)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per level and mode, after a warm-up")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the plot")
    args = p.parse_args(argv)
    if min(args.concurrency) < 1 or args.repeats < 1 or args.budget_calls < 1:
        p.error("--concurrency, --repeats and --budget-calls must be >= 1")
    task = " ".join(f"t{j % 97}" for j in range(args.task_words))
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        path, device = benchmark_model(args, tmp)
        probe = Engine(EngineConfig(path, device=device))
        per_call = (len(probe.tokenize(task)) + 4 * args.context_words + 8 + args.max_tokens) * probe.scheduler.slot_bytes
        budget = args.budget_calls * per_call
        engines = {mode: Engine(EngineConfig(path, device=device, kv_budget_bytes=budget, share_parents=mode == "in place"))
                   for mode in ("in place", "copied")}
        del probe
    rows = []
    with tqdm(total=len(args.concurrency) * 2 * (args.repeats + 1), desc="levels", unit="run") as bar:
        for n in args.concurrency:
            runs = {mode: [] for mode in engines}
            for r in range(args.repeats + 1):  # alternating; the first pair warms up
                for mode, eng in engines.items():
                    got = run_level(eng, n, task, sampling, args.context_words)
                    if r:
                        runs[mode].append(got)
                    bar.update()
            med = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in runs.items()}
            rows.append({"concurrency": n, **med,
                         "throughput_ratio": med["in place"]["requests_per_s"] / med["copied"]["requests_per_s"],
                         "peak_kv_ratio": med["in place"]["peak_work_kv_bytes"] / med["copied"]["peak_work_kv_bytes"]})
    print(f"work-KV budget {budget / 2**20:.1f} MiB ({args.budget_calls} calls that copy)")
    print(f"{'conc':>4} {'req/s copied':>12} {'req/s in place':>14} {'ratio':>6} {'TTFT copied':>11} "
          f"{'TTFT in place':>13} {'peak KV copied':>14} {'peak KV in place':>16} {'most running':>13}")
    for r in rows:
        c, i = r["copied"], r["in place"]
        print(f"{r['concurrency']:>4} {c['requests_per_s']:>12.2f} {i['requests_per_s']:>14.2f} "
              f"{r['throughput_ratio']:>5.2f}x {c['ttft_mean_ms']:>9.0f}ms {i['ttft_mean_ms']:>11.0f}ms "
              f"{c['peak_work_kv_bytes'] / 2**20:>11.1f}MiB {i['peak_work_kv_bytes'] / 2**20:>13.1f}MiB "
              f"{c['most_running']:>6.0f} / {i['most_running']:<6.0f}")
    stem = write_json(args.out, f"shared_parents_{device.split(':')[0]}", {
        "rows": rows, "config": vars(args), "budget_bytes": budget, "device": device, "torch": torch.__version__})
    grouped_bars(stem, f"parents read in place vs copied ({device})", [str(r["concurrency"]) for r in rows],
                 [(label, {f"parents {mode}": [r[mode][key] for r in rows] for mode in ("copied", "in place")})
                  for key, label in (("requests_per_s", "requests per second"),
                                     ("peak_work_kv_bytes", "peak work KV (bytes)"))], xlabel="concurrent requests")
    print(f"wrote {stem}.json and its plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
