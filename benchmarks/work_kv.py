"""The engine's work KV two ways side by side in one run: parents in place or copied, blocks on demand or up front.

Concurrent requests of the serving engine's shape: each prefills one shared task prompt (the same text for all,
so the prefix cache answers all but the first) and its own context after it, then decodes a reply reading both.
Two engines of the same model alternate, on the same work-KV budget, sized to hold `--budget-calls` calls that
copy their parents and reserve their whole `--max-tokens`. `--compare`:
- `parents`: `share_parents` on (a parent placed where it was encoded is one run in the pool for every call that
  reads it) and off (each call copies its parents into its own blocks); past the budget, calls wait;
- `on-demand`: `kv_on_demand` on (a call takes blocks as it decodes; when none are left the newest request is
  preempted and encoded again later) and off (a call waits until its whole max_tokens fits). Replies end
  early, as real ones do: sampled (seeded per request, so both engines give the same tokens), they stop at any
  of `--stop-share` of the vocabulary.
Per concurrency: the work KV's peak, the most engine calls running at once, requests and reply tokens per
second, mean time to the first reply token, and preemptions. Writes JSON and a plot.
"""

import argparse
import random
import statistics
import tempfile
import threading
import time

import torch
from tqdm import tqdm

from braid.engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
from braid.models.checkpoints import add_model_arguments, benchmark_model
from braid.results import grouped_bars, write_json, written

MODES = {"parents": ("in place", "copied"), "on-demand": ("on demand", "up front")}


def request(eng: Engine, task: str, context: str, sampling: SamplingParams) -> tuple[float, int]:
    """One request; returns the seconds from its start to its reply's first token, and its reply's tokens."""
    start = time.perf_counter()
    prefix = eng.prefill([PrefillCall(task)])
    ctx = eng.prefill([PrefillCall(context, parents=prefix)])
    stream = eng.decode_stream([DecodeCall("Assistant:", parents=[*prefix, *ctx], sampling=sampling)])
    first, tokens = None, 0
    for _ in stream:
        first, tokens = first or time.perf_counter() - start, tokens + 1
    eng.free(ctx[0])
    for mid in stream.ids:
        eng.free(mid)
    eng.free(prefix[0])
    return first, tokens


def run_level(eng: Engine, n: int, task: str, sampling: list[SamplingParams], context_words: int) -> dict:
    peak = {"bytes": 0, "running": 0}
    done = threading.Event()

    def watch():
        while not done.is_set():
            load = eng.scheduler.load
            peak["bytes"] = max(peak["bytes"], load["reserved_bytes"])
            peak["running"] = max(peak["running"], load["running"])
            time.sleep(0.002)

    ttft, tokens = [0.0] * n, [0] * n
    contexts = [" ".join(f"c{i}w{j}" for j in range(context_words)) for i in range(n)]
    preempted = eng.scheduler.preemptions

    def one(i):
        ttft[i], tokens[i] = request(eng, task, contexts[i], sampling[i % len(sampling)])

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
    return {"requests_per_s": n / seconds, "tokens_per_s": sum(tokens) / seconds,
            "ttft_mean_ms": 1e3 * statistics.mean(ttft), "reply_tokens_mean": statistics.mean(tokens),
            "preemptions": eng.scheduler.preemptions - preempted, "peak_work_kv_bytes": peak["bytes"],
            "most_running": peak["running"], "seconds": seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--compare", choices=list(MODES), default="parents",
                   help="parents: read in place vs copied; on-demand: blocks as calls decode vs up front "
                        "(default: parents)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--task-words", type=int, default=400, help="words in the shared task prompt (default: 400)")
    p.add_argument("--context-words", type=int, default=16, help="words in each request's context (default: 16)")
    p.add_argument("--max-tokens", type=int, default=32, help="a reply's max_tokens (default: 32)")
    p.add_argument("--stop-share", type=float, default=0.0,
                   help="on-demand: the share of the vocabulary a sampled reply stops at (0: replies are greedy and "
                        "run to max_tokens; default: 0)")
    p.add_argument("--budget-calls", type=int, default=8,
                   help="the work-KV budget holds this many calls that copy their parents (default: 8)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per level and mode, after a warm-up")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the plot")
    args = p.parse_args(argv)
    if min(args.concurrency) < 1 or args.repeats < 1 or args.budget_calls < 1:
        p.error("--concurrency, --repeats and --budget-calls must be >= 1")
    if not 0 <= args.stop_share < 1:
        p.error(f"--stop-share must be in [0, 1), got {args.stop_share}")
    task = " ".join(f"t{j % 97}" for j in range(args.task_words))
    new, old = MODES[args.compare]
    with tempfile.TemporaryDirectory() as tmp:
        path, device = benchmark_model(args, tmp)
        probe = Engine(EngineConfig(path, device=device))
        per_call = (len(probe.tokenize(task)) + 4 * args.context_words + 8 + args.max_tokens) * probe.scheduler.slot_bytes
        budget = args.budget_calls * per_call
        vocab = probe.spec.vocab_size
        if args.stop_share:  # (any token of this share ends a reply; each request samples with its own seed)
            stops = tuple(random.Random(0).sample(range(vocab), max(1, round(args.stop_share * vocab))))
            sampling = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i, stop_token_ids=stops,
                                       ignore_eos=True) for i in range(max(args.concurrency))]
        else:
            sampling = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)]
        flag = "share_parents" if args.compare == "parents" else "kv_on_demand"
        engines = {mode: Engine(EngineConfig(path, device=device, kv_budget_bytes=budget, **{flag: mode == new}))
                   for mode in (new, old)}
        weights = probe.fingerprint
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
                         "throughput_ratio": med[new]["requests_per_s"] / med[old]["requests_per_s"],
                         "peak_kv_ratio": med[new]["peak_work_kv_bytes"] / med[old]["peak_work_kv_bytes"]})
    print(f"work-KV budget {budget / 2**20:.1f} MiB ({args.budget_calls} calls that copy and reserve max_tokens)")
    print(f"{'conc':>4} {'req/s ' + old:>15} {'req/s ' + new:>15} {'ratio':>6} {'TTFT ' + old:>14} "
          f"{'TTFT ' + new:>14} {'peak KV ' + old:>17} {'peak KV ' + new:>17} {'most running':>13} {'reply':>6} "
          f"{'preempted':>9}")
    for r in rows:
        o, w = r[old], r[new]
        print(f"{r['concurrency']:>4} {o['requests_per_s']:>15.2f} {w['requests_per_s']:>15.2f} "
              f"{r['throughput_ratio']:>5.2f}x {o['ttft_mean_ms']:>12.0f}ms {w['ttft_mean_ms']:>12.0f}ms "
              f"{o['peak_work_kv_bytes'] / 2**20:>14.1f}MiB {w['peak_work_kv_bytes'] / 2**20:>14.1f}MiB "
              f"{o['most_running']:>6.0f} / {w['most_running']:<6.0f}{w['reply_tokens_mean']:>6.1f} "
              f"{w['preemptions']:>9.0f}")
    name = "shared_parents" if args.compare == "parents" else "kv_on_demand"
    stem = write_json(args.out, f"{name}_{device.split(':')[0]}", {
        "rows": rows, "config": vars(args), "budget_bytes": budget, "device": device, "torch": torch.__version__},
        device=device, model=weights, calibration=None)
    what = "parents" if args.compare == "parents" else "work KV"
    grouped_bars(stem, f"{what} {new} vs {old} ({device})", [str(r["concurrency"]) for r in rows],
                 [(label, {f"{what} {mode}": [r[mode][key] for r in rows] for mode in (old, new)})
                  for key, label in (("requests_per_s", "requests per second"), ("ttft_mean_ms", "mean TTFT (ms)"),
                                     ("peak_work_kv_bytes", "peak work KV (bytes)"))], xlabel="concurrent requests")
    print(written(stem + ".json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
