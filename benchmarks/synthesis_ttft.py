"""Synthesis time-to-first-token: text re-prefill vs the cache path, side by side in one run.

For each branch length, m worker branches follow a shared prefix and branch contexts
of different lengths. Branch outputs are prefilled rather than decoded, which gives
the same KV (tests/engine/test_engine.py::test_prefilled_and_decoded_kv_agree) without
spending minutes decoding. TTFT is measured from the synthesis call to the first
sampled token, and includes planning, cache assembly (copy + re-rotation) and the
prompt prefill; worker time is excluded, as in the paper.

The calibrated cache path (mapper on every branch, LoRA on in the synthesizer's
forwards) runs beside the uncalibrated one: with --checkpoint, the checkpoint's own
calibration when it has one; otherwise a calibration of the same shape as a trained
one (LoRA rank 16 on q/k/v/o, affine mapper) with random weights, since its cost does
not depend on their values. So does the served cache path: calibrated, with each branch's first and last
token refreshed (methods.synthesis.Refresh), whose overhead is measured against the sequential cache path,
with the refreshed runs encoded in the synthesizer's own prefill (the engine's way) and, beside it, prefilled
first in a call of their own ("apart"). The modes take turns, one run each per round.
"""

import argparse
import logging
import statistics
import tempfile
import time

import torch
from tqdm import tqdm

from braid.engine import DecodeCall, EngineConfig, PrefillCall, SamplingParams
from braid.methods.calibration import fingerprints, load_engine, served_refresh
from braid.methods.synthesis import Placement, Refresh, synthesize_stream, synthesize_text_stream
from braid.models.checkpoints import add_model_arguments, benchmark_model
from braid.results import device_name, pyplot, write_json
from braid.train.calibrate import write_untrained

FIRST_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="tokens per branch (default: 128 256 512 1024 on CPU, 512 1024 2048 4096 on CUDA)")
    p.add_argument("--branches", type=int, default=4)
    p.add_argument("--prefix-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per mode (median reported)")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens for the batch-1 decode rate (0: skip)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the plot")
    return p.parse_args(argv)


def median_runs(modes, repeats, free, copied=dict):
    """Median TTFT and assembly time per mode, the modes taking turns (one run each per round, so a slow spell
    of the machine hits them alike), after one warm-up round, and the KV bytes a run copied (`copied()`: the
    engine's counters, Engine.kv_copied, read around each run). `free()` drops what a run stored."""
    runs, copies = {name: [] for name in modes}, {}
    for round_ in range(repeats + 1):
        for name, make_stream in modes.items():
            before = copied()
            start = time.perf_counter()
            stream = make_stream()
            events = iter(stream)
            next(events)
            ttft = time.perf_counter() - start
            list(events)
            free()
            copies[name] = {at: n - before.get(at, 0) for at, n in copied().items()}
            if round_:  # (not the warm-up)
                runs[name].append((ttft, stream.timings["assemble"]))
    return {name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs), copies[name])
            for name, rs in runs.items()}


def refresh_apart(eng, make_stream, runs: int):
    """The `runs` refreshed runs prefilled in one call of their own before the synthesizer's (the engine's path
    when they and the synthesizer's call exceed max_parallel_calls), beside encoding them in its prefill."""
    def make():
        limit = eng.config.max_parallel_calls
        eng.config.max_parallel_calls = runs  # (one prefill takes them all; the synthesizer's call is one more)
        try:
            return make_stream()
        finally:
            eng.config.max_parallel_calls = limit
    return make


def build_workflow(eng, gen, args, length):
    rand = lambda n: torch.randint(3, eng.spec.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    prefix = eng.prefill([PrefillCall(rand(args.prefix_tokens))])
    contexts = eng.prefill([PrefillCall(rand(16 * (j + 1)), parents=prefix) for j in range(args.branches)])
    branches = eng.prefill([PrefillCall(rand(length), parents=[*prefix, c]) for c in contexts])
    return prefix, contexts, branches, rand(args.prompt_tokens)


def decode_rate(eng, gen, n_tokens, context=512):
    ctx = eng.prefill([PrefillCall(torch.randint(3, eng.spec.vocab_size, (context,), generator=gen).tolist())])
    stream = eng.decode_stream([DecodeCall([5], parents=ctx, sampling=SamplingParams(max_tokens=n_tokens,
                                                                                      ignore_eos=True))])
    list(stream)
    rate = (n_tokens - 1) / stream.timings["decode"]
    eng.free(stream.ids[0]), eng.free(ctx[0])
    return rate


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        path, device = benchmark_model(args, tmp)
        calibration = EngineConfig(path, calibration="auto" if args.checkpoint else "none").resolved().calibration
        trained = calibration != "none"
        if not trained:
            calibration = write_untrained(path, f"{tmp}/calibration", scale=0.02, name="random")
        eng = load_engine(EngineConfig(path, dtype=args.dtype, device=device, store_budget_bytes=64 << 30,
                                       calibration=calibration))
    hooks = eng.calibration.hooks
    # the served cache path: a trained calibration's placement and refresh; for a random one, the committed
    # calibration's (sequential, a token refreshed at each end)
    served = ((eng.calibration.record.placement, served_refresh(eng.calibration)) if trained
              else (Placement.SEQUENTIAL, Refresh(1, 1)))
    lengths = args.lengths or ([512, 1024, 2048, 4096] if device.startswith("cuda") else [128, 256, 512, 1024])
    gen = torch.Generator().manual_seed(0)
    rows = []
    for length in tqdm(lengths, desc="branch lengths"):
        prefix, contexts, branches, prompt = build_workflow(eng, gen, args, length)
        modes = {
            "text": lambda: synthesize_text_stream(eng, branches, prompt, prefix=prefix, sampling=FIRST_TOKEN),
            "cache_branch_point": lambda: synthesize_stream(eng, branches, prompt, prefix=prefix,
                                                            placement=Placement.BRANCH_POINT, sampling=FIRST_TOKEN),
            "cache_sequential": lambda: synthesize_stream(eng, branches, prompt, prefix=prefix,
                                                          placement=Placement.SEQUENTIAL, sampling=FIRST_TOKEN),
            "cache_calibrated": lambda: synthesize_stream(eng, branches, prompt, prefix=prefix,
                                                          placement=Placement.BRANCH_POINT, sampling=FIRST_TOKEN,
                                                          hooks=hooks),
            "cache_refresh": lambda: synthesize_stream(eng, branches, prompt, prefix=prefix,
                                                       placement=Placement.SEQUENTIAL, sampling=FIRST_TOKEN,
                                                       refresh=Refresh(1, 1)),
            "cache_served": lambda: synthesize_stream(eng, branches, prompt, prefix=prefix, placement=served[0],
                                                      sampling=FIRST_TOKEN, hooks=hooks, refresh=served[1]),
        }
        runs = 2 * args.branches  # (a token at each end of every branch)
        modes["cache_refresh_apart"] = refresh_apart(eng, modes["cache_refresh"], runs)
        modes["cache_served_apart"] = refresh_apart(eng, modes["cache_served"], runs)
        row = {"branch_tokens": length, "branches": args.branches}
        before = set(eng.store.ids())

        def free():
            for mid in set(eng.store.ids()) - before:
                eng.free(mid)

        for name, (ttft, assemble, copies) in median_runs(modes, args.repeats, free, lambda: eng.kv_copied).items():
            row[f"{name}_ttft_ms"], row[f"{name}_assemble_ms"] = 1e3 * ttft, 1e3 * assemble
            row[f"{name}_kv_copied_bytes"] = copies  # (one run's: at reuse and at commit)
        row["speedup_branch_point"] = row["text_ttft_ms"] / row["cache_branch_point_ttft_ms"]
        row["speedup_sequential"] = row["text_ttft_ms"] / row["cache_sequential_ttft_ms"]
        row["speedup_calibrated"] = row["text_ttft_ms"] / row["cache_calibrated_ttft_ms"]
        row["calibration_overhead"] = row["cache_calibrated_ttft_ms"] / row["cache_branch_point_ttft_ms"] - 1
        row["speedup_served"] = row["text_ttft_ms"] / row["cache_served_ttft_ms"]
        row["refresh_overhead"] = row["cache_refresh_ttft_ms"] / row["cache_sequential_ttft_ms"] - 1
        row["refresh_apart_overhead"] = row["cache_refresh_apart_ttft_ms"] / row["cache_sequential_ttft_ms"] - 1
        row["served_overhead"] = row["cache_served_ttft_ms"] / row["cache_sequential_ttft_ms"] - 1
        row["served_apart_overhead"] = row["cache_served_apart_ttft_ms"] / row["cache_sequential_ttft_ms"] - 1
        # The physical limit: text prefills branches + prompt, the cache path the prompt only.
        row["token_ratio"] = (args.branches * length + args.prompt_tokens) / args.prompt_tokens
        rows.append(row)
        for mid in [*prefix, *contexts, *branches]:
            eng.free(mid)
    result = {
        "device": device_name(device),
        "dtype": eng.config.dtype, "shape": args.shape if not args.checkpoint else args.checkpoint,
        "parameters": sum(p.numel() for p in eng.lm.model.parameters()),
        "calibration": calibration if trained else "random weights, trained shape",
        "torch": torch.__version__, "prefix_tokens": args.prefix_tokens, "prompt_tokens": args.prompt_tokens,
        "rows": rows,
    }
    if args.decode_tokens:
        result["decode_tokens_per_s_batch1"] = decode_rate(eng, gen, args.decode_tokens)
    report(result, args.out, device=device, **fingerprints(eng))


def report(result, out_dir, **stamp):
    """Print the table; write the JSON (under `stamp`: braid.results.write_json's keywords) and its plot."""
    header = f"{'tokens/branch':>13} {'text ms':>9} {'cache ms':>9} {'assemble ms':>11} {'speedup':>8} " \
             f"{'seq ms':>8} {'calibrated ms':>13} {'overhead':>8} {'refresh ms':>10} {'overhead':>8} " \
             f"{'apart ms':>9} {'overhead':>8} {'served ms':>9} {'overhead':>8} {'apart ms':>9} {'overhead':>8} " \
             f"{'speedup':>8}"
    print(f"\n{result['device']} {result['dtype']} {result['parameters'] / 1e6:.0f}M params, "
          f"{result['rows'][0]['branches']} branches (refresh and served overheads: against the sequential cache "
          f"path; 'apart': the refreshed runs prefilled first)\n{header}")
    for r in result["rows"]:
        print(f"{r['branch_tokens']:>13} {r['text_ttft_ms']:>9.1f} {r['cache_branch_point_ttft_ms']:>9.1f} "
              f"{r['cache_branch_point_assemble_ms']:>11.1f} {r['speedup_branch_point']:>7.1f}x "
              f"{r['cache_sequential_ttft_ms']:>8.1f} {r['cache_calibrated_ttft_ms']:>13.1f} "
              f"{100 * r['calibration_overhead']:>+7.1f}% {r['cache_refresh_ttft_ms']:>10.1f} "
              f"{100 * r['refresh_overhead']:>+7.1f}% {r['cache_refresh_apart_ttft_ms']:>9.1f} "
              f"{100 * r['refresh_apart_overhead']:>+7.1f}% {r['cache_served_ttft_ms']:>9.1f} "
              f"{100 * r['served_overhead']:>+7.1f}% {r['cache_served_apart_ttft_ms']:>9.1f} "
              f"{100 * r['served_apart_overhead']:>+7.1f}% {r['speedup_served']:>7.1f}x")
    if "decode_tokens_per_s_batch1" in result:
        print(f"batch-1 decode: {result['decode_tokens_per_s_batch1']:.1f} tokens/s")
    stem = write_json(out_dir, f"synthesis_ttft_{'cuda' if 'cpu' != result['device'] else 'cpu'}", result, **stamp)
    plt = pyplot()
    if plt is None:
        return
    xs = [r["branch_tokens"] for r in result["rows"]]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in [("text", "text re-prefill"), ("cache_branch_point", "cache, branch point"),
                       ("cache_sequential", "cache, sequential"), ("cache_calibrated", "cache, calibrated"),
                       ("cache_refresh", "cache, sequential + refresh"),
                       ("cache_served", "cache, calibrated + refresh (served)"),
                       ("cache_served_apart", "served, refresh prefilled first")]:
        ax[0].plot(xs, [r[f"{key}_ttft_ms"] for r in result["rows"]], marker="o", label=label)
    ax[0].set(xscale="log", yscale="log", xlabel="tokens per branch", ylabel="TTFT (ms)",
              title=f"Synthesis TTFT, {result['rows'][0]['branches']} branches")
    ax[1].plot(xs, [r["speedup_branch_point"] for r in result["rows"]], marker="o", label="measured (branch point)")
    ax[1].plot(xs, [r["speedup_calibrated"] for r in result["rows"]], marker="o", label="measured (calibrated)")
    ax[1].plot(xs, [r["speedup_served"] for r in result["rows"]], marker="o", label="measured (served)")
    ax[1].set(xscale="log", xlabel="tokens per branch", ylabel="text TTFT / cache TTFT", title="Speedup")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle(f"{result['device']}, {result['dtype']}, {result['parameters'] / 1e6:.0f}M params")
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=110)
    print(f"wrote {stem}.json and {stem}.png")


if __name__ == "__main__":
    main()
