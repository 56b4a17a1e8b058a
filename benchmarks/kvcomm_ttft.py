"""KVComm against dense prefill, side by side in one run: TTFT of agents 1-5 reading one shared text.

KVComm's workload (1K input tokens, 512-token agent prefixes), scaled by the CLI: each agent has
its own role prefix (prefix-cached in both methods, as a serving engine would), then the user's text, then a
short reply header. Dense prefill encodes the text after each agent's prefix. KVComm encodes the text's base
once, behind the first agent's prefix, as an agent graph does (the first agent pays it and reads it as it
is; the rest find it in the prefix cache), and interpolates the other agents' offsets from a warmed anchor
pool (--anchors earlier texts, each measured under every agent). Before each KVComm pass over the agents
the prefix cache is cleared and the role prefixes encoded again, so the first agent pays for the base in
every pass, and neither method reads the text's KV from the other's run. TTFT runs from the
agent's call to its first token (one token is decoded: the output length does not enter TTFT). The
measured texts are new to the pool; gamma=1, so the reuse path is always the one timed: how often it is
taken, and at what accuracy, is evals/kvcomm_quality.py's business. Default model: a random-weight 100M-shape
Llama (the CPU proxy); --shape llama-3.1-8b is the paper's scale (bf16 on CUDA), --model another checkpoint.
"""

import argparse
import random
import statistics
import tempfile
import time

import torch
from tqdm import tqdm

from braid.engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
from braid.methods.kvcomm import AgentPrompt, KVComm, KVCommConfig
from braid.models.checkpoints import add_model_arguments, benchmark_model
from braid.results import device_name, pyplot, write_json, written

FIRST = SamplingParams(max_tokens=1, ignore_eos=True)


def words(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(8, vocab) for _ in range(n)]


def dense_ttft(engine: Engine, p: AgentPrompt) -> float:
    start = time.perf_counter()
    pre = engine.prefill([PrefillCall(p.prefix)])
    ctx = engine.prefill([PrefillCall(p.slots[0][1], parents=pre)])
    stream = engine.decode_stream([DecodeCall(p.joins[-1], parents=pre + ctx, sampling=FIRST)])
    events = iter(stream)
    next(events)
    took = time.perf_counter() - start
    for _ in events:
        pass
    for mid in [*pre, *ctx, *stream.ids]:
        engine.free(mid)
    return took


def kvcomm_ttft(comm: KVComm, p: AgentPrompt) -> tuple[float, bool]:
    start = time.perf_counter()
    prep, stream = comm.decode_stream(p, scope="bench")
    events = iter(stream)
    next(events)
    took = time.perf_counter() - start
    for _ in events:
        pass
    for mid in [*prep.owned, *stream.ids]:
        comm.engine.free(mid)
    return took, prep.reused


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap)
    ap.add_argument("--agents", type=int, default=5)
    ap.add_argument("--input-tokens", type=int, default=1024, help="the shared text")
    ap.add_argument("--prefix-tokens", type=int, default=512, help="each agent's role prefix")
    ap.add_argument("--anchors", type=int, default=8, help="texts warmed into the pool before measuring")
    ap.add_argument("--requests", type=int, default=3, help="measured requests (median per agent)")
    ap.add_argument("--recompute", default="0,0.1,0.2",
                    help="comma-separated fractions of the reused text re-encoded (each timed; default: 0,0.1,0.2)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    model, device = benchmark_model(args, tempfile.mkdtemp(prefix=f"braid-{args.shape}-"))
    budget = 24 << 30
    engine = Engine(EngineConfig(model, device=device, store_budget_bytes=budget, max_batched_tokens=2048,
                                 kv_budget_bytes=(1 if device == "cpu" else 8) << 30))
    vocab = engine.spec.vocab_size
    rng = random.Random(0)
    prefixes = [words(rng, vocab, args.prefix_tokens) for _ in range(args.agents)]
    header = words(rng, vocab, 4)
    fractions = [float(f) for f in args.recompute.split(",")]
    configs = [KVCommConfig(gamma=1.0, capacity=max(20, args.anchors), recompute=f) for f in fractions]
    comm = KVComm(engine, configs[0])

    def prompts(text):
        return [AgentPrompt(f"agent{k}", prefixes[k], [("user", text)], [header], FIRST, base_prefix=prefixes[0])
                for k in range(args.agents)]

    def cold():
        """Only the role prefixes cached: what a replica holds when a new text arrives."""
        engine.clear_prefix_cache()
        comm.forget_sketches()
        for prefix in prefixes:
            engine.free(engine.prefill([PrefillCall(prefix)])[0])

    for i in tqdm(range(args.anchors), desc="warming the anchor pool", unit="text"):
        # each text longer than the last: the length criterion makes it an anchor, measured under every agent
        for p in prompts(words(rng, vocab, args.input_tokens + i)):
            kvcomm_ttft(comm, p)
    for p in prompts(words(rng, vocab, 16)):  # warm-up of both code paths at a small size
        dense_ttft(engine, p)
    dense, reused = [[] for _ in range(args.agents)], []
    reuse = {f: [[] for _ in range(args.agents)] for f in fractions}
    for _ in tqdm(range(args.requests), desc="measuring", unit="request"):
        text = words(rng, vocab, args.input_tokens)
        cold()
        for k, p in enumerate(prompts(text)):
            dense[k].append(dense_ttft(engine, p))
        for f, config in zip(fractions, configs):  # (the same pools; only the recomputed share differs)
            comm.config = config
            cold()
            for k, p in enumerate(prompts(text)):
                took, ok = kvcomm_ttft(comm, p)
                reuse[f][k].append(took)
                reused.append(ok)
    rows = [{"agent": k + 1, "dense_ttft_s": statistics.median(dense[k]),
             "kvcomm_ttft_s": statistics.median(reuse[fractions[0]][k]),
             "speedup": statistics.median(dense[k]) / statistics.median(reuse[fractions[0]][k]),
             "by_recompute": {str(f): {"kvcomm_ttft_s": statistics.median(reuse[f][k]),
                                       "speedup": statistics.median(dense[k]) / statistics.median(reuse[f][k])}
                              for f in fractions}} for k in range(args.agents)]
    stats = comm.stats()
    result = {"model": args.checkpoint or f"random {args.shape}-shape llama", "input_tokens": args.input_tokens,
              "device": device_name(device), "dtype": engine.config.dtype,
              "torch": torch.__version__,
              "recompute": fractions,
              "prefix_tokens": args.prefix_tokens, "anchors": stats["anchors"], "pool_bytes": stats["bytes"],
              "measured_reuse_rate": sum(reused) / len(reused), "requests": args.requests, "rows": rows}
    print(f"{'agent':>5} {'dense TTFT ms':>14} " + " ".join(f"{'KVComm r=' + str(f) + ' ms':>17} {'x':>5}"
                                                         for f in fractions))
    for r in rows:
        print(f"{r['agent']:>5} {1e3 * r['dense_ttft_s']:>14.1f} " + " ".join(
            f"{1e3 * r['by_recompute'][str(f)]['kvcomm_ttft_s']:>17.1f} {r['by_recompute'][str(f)]['speedup']:>4.1f}x"
            for f in fractions))
    print(f"anchors {stats['anchors']}, pool {stats['bytes'] / 2**20:.0f} MiB, reuse on measured prompts "
          f"{100 * result['measured_reuse_rate']:.0f}%")
    stem = write_json(args.out, f"kvcomm_{'cpu' if device == 'cpu' else 'cuda'}", result, device=device,
                      model=engine.fingerprint, calibration=None)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        x = [r["agent"] for r in rows]
        ax.bar([i - 0.2 for i in x], [1e3 * r["dense_ttft_s"] for r in rows], 0.4, label="dense prefill")
        ax.bar([i + 0.2 for i in x], [1e3 * r["kvcomm_ttft_s"] for r in rows], 0.4, label="KVComm")
        for r in rows:
            ax.annotate(f"{r['speedup']:.1f}x", (r["agent"] + 0.2, 1e3 * r["kvcomm_ttft_s"]), ha="center",
                        va="bottom", fontsize=8)
        ax.set_xlabel("agent (in order)")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"{args.input_tokens}-token shared text, {args.prefix_tokens}-token prefixes")
        ax.legend()
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=120)
    print(written(stem + ".json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
