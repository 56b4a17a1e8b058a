"""A soak run: an in-process agent API under steady load for a while, its memory sampled throughout.

`python -m braid.loadtest.soak --minutes 30` serves the reference model (one engine, colocated) with
a small store budget, so the prefix cache and the store must keep evicting, and sends workflows at a
fixed concurrency until the time is up (`--kv-mib` shrinks the work KV, so that calls are preempted and
encoded again all along). Every second it samples the process's resident memory, the store's bytes and
the scheduler's work KV. It passes when every request succeeded, the store stayed
within its budget, and resident memory after the first tenth of the run grew by less than --max-growth-mib.
Writes JSON and a plot.
"""

import argparse
import asyncio
import os
import threading
import time

from braid.cluster.inprocess import start_in_process
from braid.engine import EngineConfig
from braid.loadtest.metrics import summarize
from braid.loadtest.run import format_summary, run_load
from braid.loadtest.workload import Workload
from braid.methods.calibration import fingerprints, load_engine
from braid.models import REFERENCE_MODEL
from braid.results import pyplot, write_json, written
from braid.runtime.directory import Directory, EmbeddedRedis


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(model: str, seconds: float, concurrency: int, store_budget_bytes: int, workload: Workload,
         progress: bool = False, kv_budget_bytes: int = 0) -> dict:
    redis = EmbeddedRedis()
    engine = load_engine(EngineConfig(model, device="cpu", store_budget_bytes=store_budget_bytes,
                                      kv_budget_bytes=kv_budget_bytes))
    server = start_in_process(engine, Directory.connect(redis.url))
    samples, stop = [], threading.Event()
    start = time.perf_counter()

    def sample():
        while not stop.wait(1.0):
            samples.append({"t": time.perf_counter() - start, "rss": rss_bytes(), "store": engine.store.used_bytes,
                            "work_kv": engine.scheduler.load["reserved_bytes"], "messages": len(engine.store),
                            "prefix_entries": len(engine.prefix_cache or ())})

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    records, batch = [], 0
    try:
        while time.perf_counter() - start < seconds:
            requests = Workload(**{**workload.__dict__, "seed": workload.seed + batch}).requests(2 * concurrency)
            got, _ = asyncio.run(run_load(f"127.0.0.1:{server.port}", requests, max_concurrency=concurrency,
                                          progress=progress))
            records += got
            batch += 1
    finally:
        duration = time.perf_counter() - start
        stop.set()
        sampler.join()
        server.stop()
        redis.stop()
    return {"summary": summarize(records, duration, {}), "samples": samples, "store_budget_bytes": store_budget_bytes,
            "evictions": engine.store.evictions, "preemptions": engine.scheduler.preemptions,
            "measured": fingerprints(engine)}


def verdict(result: dict, max_growth_mib: float) -> tuple[bool, str]:
    samples = result["samples"]
    settled = [s for s in samples if s["t"] >= 0.1 * samples[-1]["t"]] if samples else []
    growth = (max(s["rss"] for s in settled) - settled[0]["rss"]) / 2**20 if settled else 0.0
    store_max = max((s["store"] for s in samples), default=0)
    ok = (result["summary"]["failed"] == 0 and store_max <= result["store_budget_bytes"]
          and growth < max_growth_mib)
    return ok, (f"{result['summary']['completed']} workflows, {result['summary']['failed']} failed; store at most "
                f"{store_max / 2**20:.1f} of {result['store_budget_bytes'] / 2**20:.1f} MiB "
                f"({result['evictions']} evictions); {result['preemptions']} calls preempted; resident memory grew "
                f"{growth:.1f} MiB after warm-up "
                f"(limit {max_growth_mib} MiB)")


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None or not result["samples"]:
        return
    s = result["samples"]
    t = [x["t"] / 60 for x in s]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for key, label in [("rss", "resident memory"), ("store", "message store"), ("work_kv", "scheduler work KV")]:
        ax.plot(t, [x[key] / 2**20 for x in s], label=label)
    ax.axhline(result["store_budget_bytes"] / 2**20, ls="--", color="gray", label="store budget")
    ax.set(xlabel="minutes", ylabel="MiB", title="soak: memory under steady load")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=REFERENCE_MODEL, help="checkpoint (default: the reference model)")
    p.add_argument("--minutes", type=float, default=30.0, help="how long to run (default: 30)")
    p.add_argument("--concurrency", type=int, default=8, help="workflows in flight (default: 8)")
    p.add_argument("--store-mib", type=float, default=8.0, help="store budget, MiB (default: 8, to force eviction)")
    p.add_argument("--kv-mib", type=float, default=0.0,
                   help="work-KV budget, MiB (default: 0, the engine's own; small: calls are preempted all along)")
    p.add_argument("--max-growth-mib", type=float, default=256.0,
                   help="resident memory growth allowed after the first tenth of the run (default: 256)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the plot")
    args = p.parse_args(argv)
    if args.kv_mib < 0:
        p.error(f"--kv-mib must be >= 0, got {args.kv_mib}")
    result = soak(args.model, 60 * args.minutes, args.concurrency, int(args.store_mib * 2**20), Workload(),
                  progress=False, kv_budget_bytes=int(args.kv_mib * 2**20))
    ok, line = verdict(result, args.max_growth_mib)
    print(format_summary(result["summary"]))
    print(("PASS: " if ok else "FAIL: ") + line)
    measured = result.pop("measured")
    stem = write_json(args.out, "soak_cpu", {**result, "config": vars(args), "passed": ok, "verdict": line},
                      device="cpu", **measured)
    plot(result, stem + ".png")
    print(written(stem + ".json"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
