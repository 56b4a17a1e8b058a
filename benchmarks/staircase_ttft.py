"""Staircase streaming against wait-for-all, side by side in one run, on one engine (colocated: workers and
aggregator share the model, as in `braid serve --colocate`).

For each branch length, 4 workers decode that many tokens (greedy, EOS ignored) after a shared task; the
aggregator answers 64 tokens. Wait-for-all synthesizes once every branch has ended; staircase (Staircase Streaming)
answers from the first chunks and takes in later ones between its own chunks, in the re-prefill and append
variants, from text and from KV. "slow": one worker's call starts --slow-delay seconds late (an injected
delay). TTFT runs from the start of the workers to the first answer token; tokens/s is the answer's rate after
it; E2E ends with the last answer token. Then, at the longest length: redundancy 0 against 1 with the slow
worker, and first chunks of 4, 8, 16 and 32 tokens.
"""

import argparse
import statistics
import time

from tqdm import tqdm

from braid.engine import Engine, EngineConfig, PrefillCall, SamplingParams
from braid.methods.calibration import fingerprints
from braid.methods.fanout import fan_out
from braid.methods.staircase import BranchFeed, StaircaseResult, StaircaseSchedule, Variant, staircase
from braid.methods.synthesis import TEXT, Placement, Refresh, SynthesisMode, synthesis_stream
from braid.models import REFERENCE_MODEL
from braid.models.chat import SYNTHESIZER_HEADER, WORKER_HEADER, turn
from braid.results import pyplot, write_json, written

TASK = turn("system", "workers each report their part; the synthesizer joins them.")
PROMPT = turn("user", "join the parts.") + SYNTHESIZER_HEADER
MODES = {"text": TEXT, "kv": SynthesisMode(Placement.SEQUENTIAL, refresh=Refresh(1, 1))}  # kv: as a cluster serves it


def start_workers(engine: Engine, length: int, slow_s: float):
    """4 branches; with slow_s, the last one in its own call, started that much later."""
    sampling = SamplingParams(max_tokens=length, ignore_eos=True)
    contexts = [turn("user", f"part {j}: report on item {j}.") for j in range(4)]
    if not slow_s:
        return [fan_out(engine, TASK, contexts, WORKER_HEADER, sampling)]
    return [fan_out(engine, TASK, contexts[:3], WORKER_HEADER, sampling),
            fan_out(engine, TASK, contexts[3:], WORKER_HEADER, sampling, on_start=lambda _: time.sleep(slow_s))]


def measure(engine: Engine, length: int, slow_s: float, method: str, transport: str,
            schedule: StaircaseSchedule, answer_tokens: int) -> dict:
    answer = SamplingParams(max_tokens=answer_tokens, ignore_eos=True)
    mode = MODES[transport]
    start = time.perf_counter()
    prefix = engine.prefill([PrefillCall(TASK)])
    fan_outs = start_workers(engine, length, slow_s)
    feed = BranchFeed(fan_outs)
    times = []
    if method == "wait-for-all":
        feed.join()
        ids = [i for f in fan_outs for i in f.ids]
        stream = synthesis_stream(engine, ids, PROMPT, prefix, mode, answer)
        for _ in stream:
            times.append(time.perf_counter())
        engine.free(stream.ids[0])
        rounds = 1
    else:
        result = StaircaseResult()
        for event in staircase(engine, feed, PROMPT, prefix, schedule, Variant(method), mode, answer,
                               result=result):
            if hasattr(event, "token_id"):
                times.append(time.perf_counter())
        feed.join()
        rounds = len(result.rounds)
        for mid in result.message_ids[-1:]:
            engine.free(mid)
    for f in fan_outs:
        f.free()
    ttft, e2e = times[0] - start, times[-1] - start
    return {"length": length, "slow": bool(slow_s), "method": method, "transport": transport, "ttft_s": ttft,
            "e2e_s": e2e, "tokens_per_s": (len(times) - 1) / max(e2e - ttft, 1e-9), "rounds": rounds,
            "first_chunk": schedule.proposer[0], "redundancy": schedule.redundancy}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=REFERENCE_MODEL, help="checkpoint (default: the reference model)")
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512], help="tokens per branch")
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--slow-delay", type=float, default=1.0, help="seconds the slow worker starts late")
    p.add_argument("--repeats", type=int, default=1, help="runs per cell (median)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the plot")
    args = p.parse_args(argv)
    engine = Engine(EngineConfig(args.model))
    base = StaircaseSchedule()  # 8/128/256 for the workers, 8/128 for the aggregator
    cells = [(n, slow, method, transport, base) for n in args.lengths for slow in (0.0, args.slow_delay)
             for method in ("wait-for-all", "reprefill", "append") for transport in MODES]
    longest = max(args.lengths)
    cells += [(longest, args.slow_delay, v, "kv", StaircaseSchedule(redundancy=1)) for v in ("reprefill", "append")]
    cells += [(longest, 0.0, "reprefill", "kv", StaircaseSchedule((first, 128, 256))) for first in (4, 16, 32)]
    measure(engine, 16, 0.0, "reprefill", "kv", base, 4)  # warm-up
    rows = []
    for n, slow, method, transport, schedule in tqdm(cells, desc="runs"):
        runs = [measure(engine, n, slow, method, transport, schedule, args.answer_tokens)
                for _ in range(args.repeats)]
        row = dict(runs[0])
        for key in ("ttft_s", "e2e_s", "tokens_per_s"):
            row[key] = statistics.median(r[key] for r in runs)
        rows.append(row)

    def cell(n, slow, method, transport, first=8, redundancy=0):
        return next(r for r in rows if (r["length"], r["slow"], r["method"], r["transport"], r["first_chunk"],
                                        r["redundancy"]) == (n, slow, method, transport, first, redundancy))

    print(f"{'tokens':>6} {'slow':>5} {'transport':>9} {'method':>12} {'TTFT ms':>9} {'vs wait':>8} {'E2E ms':>8} "
          f"{'tok/s':>7} {'rounds':>6}")
    for n in args.lengths:
        for slow in (False, True):
            for transport in MODES:
                wait = cell(n, slow, "wait-for-all", transport)
                for method in ("wait-for-all", "reprefill", "append"):
                    r = cell(n, slow, method, transport)
                    cut = 1 - r["ttft_s"] / wait["ttft_s"]
                    print(f"{n:>6} {slow!s:>5} {transport:>9} {method:>12} {1e3 * r['ttft_s']:>9.1f} "
                          f"{100 * cut:>7.1f}% {1e3 * r['e2e_s']:>8.0f} {r['tokens_per_s']:>7.1f} {r['rounds']:>6}")
    print(f"\nat {longest} tokens, slow worker, KV: redundancy 1 against 0")
    for method in ("reprefill", "append"):
        r0, r1 = cell(longest, True, method, "kv"), cell(longest, True, method, "kv", redundancy=1)
        print(f"  {method:>9}: TTFT {1e3 * r0['ttft_s']:.1f} ms -> {1e3 * r1['ttft_s']:.1f} ms")
    print(f"at {longest} tokens, re-prefill, KV: first chunk size")
    for first in (4, 8, 16, 32):
        r = cell(longest, False, "reprefill", "kv", first)
        print(f"  {first:>2}: TTFT {1e3 * r['ttft_s']:.1f} ms, E2E {1e3 * r['e2e_s']:.0f} ms")
    stem = write_json(args.out, "staircase_cpu", {"model": args.model, "slow_delay_s": args.slow_delay,
                                                   "answer_tokens": args.answer_tokens, "rows": rows},
                      device=str(engine.lm.device), **fingerprints(engine))
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, slow in zip(axes, (False, True)):
            for method in ("wait-for-all", "reprefill", "append"):
                for transport, style in (("text", "--"), ("kv", "-")):
                    ys = [1e3 * cell(n, slow, method, transport)["ttft_s"] for n in args.lengths]
                    ax.plot(args.lengths, ys, style, marker="o", label=f"{method}, {transport}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens per worker branch")
            ax.set_title(f"4 workers, {'one starting ' + str(args.slow_delay) + ' s late' if slow else 'none slow'}")
        axes[0].set_ylabel("TTFT (ms, workers included)")
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=120)
        print(written(stem + ".json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
