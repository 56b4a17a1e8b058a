"""One forward for many decoding calls against one forward each: what continuous batching buys per step.

For G calls (each 3 parallel branches decoding over a context of --context tokens, in the engine's
paged KV pool), times G separate single-call forwards and one forward carrying all G, side by side,
on the reference model, or with --shape a random-weight model of that shape (bf16 on CUDA). Prints the ratio and writes JSON and a plot.
"""

import argparse
import statistics
import tempfile
import time

import torch

from braid.engine import Engine, EngineConfig
from braid.engine.kv_cache import WorkCache
from braid.engine.model_runner import RequestInput
from braid.models import REFERENCE_MODEL
from braid.models.checkpoints import add_model_arguments, benchmark_model
from braid.results import device_name, pyplot, write_json, written


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p, shape=None)  # (neither --shape nor --checkpoint: the reference model)
    p.add_argument("--groups", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--context", type=int, default=150, help="tokens already in each call's cache")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="benchmarks/results")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not (args.checkpoint or args.shape):
        args.checkpoint = REFERENCE_MODEL
    path, device = benchmark_model(args, tempfile.mkdtemp(prefix="braid-batched-"))
    eng = Engine(EngineConfig(path, device=device))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    lm, pool, calls = eng.lm, eng.scheduler.pool, 3
    rows = []
    for g in args.groups:
        caches = []
        for _ in range(g):
            cache = WorkCache(lm, args.context + 4 * args.repeats * 2 + 8, pool,
                              pool.allocate(args.context + 4 * args.repeats * 2 + 8))
            cache.append(*torch.randn(*pool.kv.shape[:3], args.context, pool.kv.shape[4], dtype=pool.kv.dtype,
                                      device=pool.kv.device).unbind(1), segment=0)
            caches.append(cache)
        visible = torch.ones(calls, 1 + calls, dtype=torch.bool)

        def inputs(step):
            dev = pool.kv.device
            of_row = torch.arange(calls, device=dev)
            return [RequestInput(c, visible.to(dev), torch.randint(3, lm.spec.vocab_size, (calls,), device=dev),
                                 torch.full((calls,), args.context + step, device=dev), of_row, list(range(calls)),
                                 c.claim(of_row, 1)) for c in caches]

        alone, together = [], []
        for step in range(args.repeats):  # alternating, so both see the same machine
            batch = inputs(2 * step)
            sync()
            start = time.perf_counter()
            for one in batch:
                eng.runner.step([one])
            sync()
            alone.append(time.perf_counter() - start)
            batch = inputs(2 * step + 1)
            sync()
            start = time.perf_counter()
            eng.runner.step(batch)
            sync()
            together.append(time.perf_counter() - start)
        for c in caches:
            pool.release(c.blocks)
        a, t = statistics.median(alone[2:]), statistics.median(together[2:])
        rows.append({"groups": g, "tokens": g * calls, "separate_ms": 1e3 * a, "batched_ms": 1e3 * t,
                     "speedup": a / t})
        print(f"{g:>3} calls ({g * calls:>3} tokens): separate forwards {1e3 * a:7.1f} ms, one forward "
              f"{1e3 * t:6.1f} ms: {a / t:.2f}x", flush=True)
    on = "cpu" if device == "cpu" else "cuda"
    stem = write_json(args.out, f"batched_forward_{on}", {
        "model": args.checkpoint or f"random {args.shape}-shape llama", "config": vars(args), "rows": rows,
        "device": device_name(device), "dtype": eng.config.dtype,
        "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
        device=device, model=eng.fingerprint, calibration=None)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        ax.plot([r["groups"] for r in rows], [r["separate_ms"] for r in rows], marker="o", label="one forward each")
        ax.plot([r["groups"] for r in rows], [r["batched_ms"] for r in rows], marker="o", label="one forward for all")
        ax.set(xscale="log", yscale="log", xlabel="decoding calls", ylabel="ms per step", title="batched decode step")
        ax.legend()
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=110)
    print(written(stem + ".json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
