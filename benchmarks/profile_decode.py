"""Where a decode step's time goes: the engine's decode with and without CUDA graphs, beside plain transformers.

All decode `--tokens` tokens greedily after a `--context`-token prompt; the engine through `decode_stream` (its
scheduler thread, paged work cache and masks), once with its decode forwards replayed as CUDA graphs
(engine.cuda_graphs; "eager" on CPU: the same padded forwards, uncaptured) and once as they come, on the same
weights, side by side; transformers through the model's own forward with a DynamicCache and SDPA. Then
`--concurrency` calls decoding at once (one thread each, batched by the scheduler): tokens/s, graphs on and off.
Prints ms per token for each, the engine's forward alone (runner.step of one decode row, in this thread), then
torch.profiler's tables of the forwards as they come (top ops by self CPU time and by device time, and the host-
device copies and synchronisations) and the launches of a graphed one. With `--flex`, a second engine on the same
checkpoint whose attention reads the KV pool in place (attention: flex, FlexAttention through page tables; compiled
on CUDA, eager on CPU) decodes the same way, its rounds alternating with the first engine's graphed ones, and at
each concurrency; `--paged` likewise for attention: paged (the decode attention reading the pool through its slot
tables, kernels.paged_decode; its decode graphs on where there are any). With `--overlap`, the first engine's
scheduler (graphs on) with and without overlap (EngineConfig.overlap: each step launched before the tokens of the
one before are read), alternating: ms per token at batch 1 and tokens/s at each concurrency. With `--compile`, the
first engine's forwards with and without the decoder compiled (EngineConfig.compile), alternating, each with decode
graphs of its own: the time of the first decode (compiling and capturing), ms per token at batch 1, tokens/s at each
concurrency, the time of a `--context`-token prefill (forwards that carry prefill rows run as they come, so the
host's time counts), and the kernel launches of a compiled forward. Writes JSON after each part (a run cut short
keeps what it measured)."""

import argparse
import itertools
import tempfile
import threading
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from braid.engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
from braid.models.checkpoints import add_model_arguments, benchmark_model
from braid.results import device_name, grouped_bars, write_json

PROFILED = 4  # decode forwards under the profiler


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p, shape="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=0, help="override the shape's layer count (0: keep it)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rows", type=int, default=30, help="rows per profiler table")
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 16, 64],
                   help="calls decoding at once, for the throughput table (none: skip it)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each side-by-side timing (median kept)")
    p.add_argument("--flex", action="store_true", help="also time an engine with attention: flex (module doc)")
    p.add_argument("--paged", action="store_true",
                   help="also time an engine with attention: paged, its graphs on where it has them (module doc)")
    p.add_argument("--overlap", action="store_true", help="also time the scheduler's overlap on against off")
    p.add_argument("--compile", action="store_true", help="also time the decoder compiled against as it comes")
    p.add_argument("--compile-only", action="store_true",
                   help="time only that, into profile_decode_compile_<device>.json (a device run's step of its own)")
    p.add_argument("--kv-gib", type=float, default=0.0,
                   help="each engine's work KV in GiB (0: the engine's default; give one with --flex on a GPU, so "
                        "that two engines and transformers' copy fit)")
    p.add_argument("--out", default="benchmarks/results")
    return p.parse_args(argv)


def engine_decode(eng, ctx, tokens):
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    stream = eng.decode_stream([DecodeCall([5], parents=ctx, sampling=sampling)])
    list(stream)
    eng.free(stream.ids[0])
    return stream.timings["decode"] / (tokens - 1)


def runner_steps(eng, context, steps, sync):
    """`steps` forwards of one decode row over a `context`-token work cache, as the scheduler runs them."""
    from braid.engine.model_runner import RequestInput
    try:  # (step_host imports this module under other revisions too: before engine.kv_cache the runner claimed slots)
        from braid.engine.kv_cache import WorkCache
    except ImportError:
        from braid.engine.model_runner import WorkCache

    def claimed(cache, calls) -> tuple:  # (the rows' slots, where the step's builder claims them)
        return (cache.claim(calls, 1),) if hasattr(cache, "claim") else ()

    pool = eng.scheduler.pool
    cache = WorkCache(eng.lm, context + steps, pool, pool.allocate(context + steps))
    cache.append(*torch.randn(*pool.kv.shape[:3], context, pool.kv.shape[4], dtype=pool.kv.dtype,
                              device=pool.kv.device).unbind(1), segment=0)
    dev = pool.kv.device
    visible = torch.ones(1, 2, dtype=torch.bool, device=dev)
    sync()
    start = time.perf_counter()
    for step in range(steps):
        calls = torch.zeros(1, dtype=torch.long, device=dev)
        eng.runner.step([RequestInput(cache, visible, torch.tensor([5], device=dev),
                                      torch.tensor([context + step], device=dev), calls, [0],
                                      *claimed(cache, calls), plain=True)])  # (one call that sees its cache)
    sync()
    took = (time.perf_counter() - start) / steps
    pool.release(cache.blocks)
    return took


@torch.inference_mode()
def hf_decode(model, prompt, tokens, sync):
    cache = DynamicCache()
    out = model(prompt, past_key_values=cache, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    sync()
    start = time.perf_counter()
    for _ in range(tokens - 1):
        out = model(token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        token.item()  # (the engine reads each token back too)
    sync()
    return (time.perf_counter() - start) / (tokens - 1)


def device_ms(table) -> float:
    """The device's busy time in a profiler table: its kernels' (and copies') own time, in ms."""
    return sum(e.self_device_time_total for e in table if e.device_type != torch.autograd.DeviceType.CPU) / 1e3


def concurrent_decode(eng, ctx, tokens, n):
    """Tokens per second of `n` calls decoding at once after the same context, each from its own thread."""
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    streams = [eng.decode_stream([DecodeCall([5 + i], parents=ctx, sampling=sampling)]) for i in range(n)]
    start = time.perf_counter()
    threads = [threading.Thread(target=lambda s=s: list(s)) for s in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - start
    for s in streams:
        eng.free(s.ids[0])
    return n * tokens / took


def side_by_side(eng, graphs, rounds, measure):
    """`measure()` with the engine's decode graphs off and on, alternating, `rounds` times: the medians."""
    runs = {"eager": [], "graphs": []}
    for _ in range(rounds):
        for mode in runs:
            eng.runner.graphs = graphs if mode == "graphs" else None
            runs[mode].append(measure())
    eng.runner.graphs = graphs
    return {mode: sorted(v)[len(v) // 2] for mode, v in runs.items()}


def attention_side_by_side(eng, other, name, prompt, args) -> dict:
    """The engine `other`, whose attention is `name` (flex, paged), against `eng` (sdpa, its graphs on where it has
    them), rounds alternating: ms per token at batch 1, then tokens/s at each concurrency (the first round of each
    warms compiled kernels up, untimed)."""
    ctx, octx = eng.prefill([PrefillCall(prompt[0].tolist())]), other.prefill([PrefillCall(prompt[0].tolist())])
    start = time.perf_counter()
    engine_decode(other, octx, 4)
    warm = time.perf_counter() - start
    runs = {"sdpa": [], name: []}
    for _ in range(args.rounds):
        runs["sdpa"].append(engine_decode(eng, ctx, args.tokens))
        runs[name].append(engine_decode(other, octx, args.tokens))
    sdpa_ms, other_ms = (1e3 * sorted(v)[len(v) // 2] for v in runs.values())
    out = {"first_decode_s": warm, "sdpa_ms_per_token": sdpa_ms, f"{name}_ms_per_token": other_ms,
           f"{name}_speedup": sdpa_ms / other_ms, "concurrency": []}
    print(f"attention {name}: {other_ms:.1f} ms/token against {sdpa_ms:.1f} ({out[f'{name}_speedup']:.2f}x; its "
          f"first decode, compiling, {warm:.1f} s)", flush=True)
    for n in args.concurrency:
        concurrent_decode(other, octx, args.tokens, n)
        rates = {"sdpa": concurrent_decode(eng, ctx, args.tokens, n),
                 name: concurrent_decode(other, octx, args.tokens, n)}
        out["concurrency"].append({"calls": n, "sdpa_tokens_per_s": rates["sdpa"],
                                   f"{name}_tokens_per_s": rates[name]})
        print(f"  {n} calls at once: {name} {rates[name]:.1f} tokens/s, sdpa {rates['sdpa']:.1f} "
              f"({rates[name] / rates['sdpa']:.2f}x)", flush=True)
    eng.free(ctx[0])
    other.free(octx[0])
    return out


def overlap_side_by_side(eng, ctx, args) -> dict:
    """The engine's scheduler with overlap off and on (the same engine, switched between runs), rounds alternating:
    ms per token at batch 1, then tokens/s at each concurrency (medians)."""
    def both(measure):
        runs = {False: [], True: []}
        for _ in range(args.rounds):
            for on in runs:
                eng.scheduler.overlap = on
                runs[on].append(measure())
        eng.scheduler.overlap = eng.config.overlap
        return [sorted(v)[len(v) // 2] for v in runs.values()]

    off_s, on_s = both(lambda: engine_decode(eng, ctx, args.tokens))
    out = {"off_ms_per_token": 1e3 * off_s, "on_ms_per_token": 1e3 * on_s, "speedup": off_s / on_s,
           "concurrency": []}
    print(f"overlap: {1e3 * on_s:.2f} ms/token against {1e3 * off_s:.2f} without ({out['speedup']:.2f}x)", flush=True)
    for n in args.concurrency:
        off, on = both(lambda: concurrent_decode(eng, ctx, args.tokens, n))
        out["concurrency"].append({"calls": n, "off_tokens_per_s": off, "on_tokens_per_s": on})
        print(f"  {n} calls at once: overlap {on:.1f} tokens/s, without {off:.1f} ({on / off:.2f}x)", flush=True)
    return out


def compile_side_by_side(eng, graphs, ctx, args, sync, activities) -> dict:
    """The engine's forwards with the decoder compiled and without (module doc): the runner switched between runs,
    each side with decode graphs of its own where the engine has them (a graph replays the forward it captured)."""
    from braid.engine.cuda_graphs import DecodeGraphs

    runner = eng.runner
    compiled_graphs = DecodeGraphs(runner, eng.scheduler.pool, graphs.capture) if graphs is not None else None
    sides = {"off": (None, graphs), "on": (runner.compiled_decoder(), compiled_graphs)}

    def on(side):
        runner.compiled, runner.graphs = sides[side]

    def both(measure):
        runs = {"off": [], "on": []}
        for _ in range(args.rounds):
            for side in runs:
                on(side)
                runs[side].append(measure())
        on("off")
        return [sorted(v)[len(v) // 2] for v in runs.values()]

    rounds = itertools.count()

    def prefill():  # (a new prompt each time: nothing of it in the prefix cache)
        prompt = torch.randint(3, eng.spec.vocab_size, (args.context,),
                               generator=torch.Generator().manual_seed(1000 + next(rounds))).tolist()
        start = time.perf_counter()
        ids = eng.prefill([PrefillCall(prompt)])
        took = time.perf_counter() - start
        eng.free(ids[0])
        return took

    ran = runner.compiled_forwards
    on("on")  # (the first forwards of each kind compile: one row, several rows; decode buckets are captured)
    start = time.perf_counter()
    engine_decode(eng, ctx, 4)
    prefill()
    for n in args.concurrency:
        concurrent_decode(eng, ctx, 4, n)
    out = {"first_forwards_s": time.perf_counter() - start}
    print(f"compile: the first forwards (compiling, capturing) {out['first_forwards_s']:.1f} s", flush=True)
    off_s, on_s = both(lambda: engine_decode(eng, ctx, args.tokens))
    out.update({"off_ms_per_token": 1e3 * off_s, "on_ms_per_token": 1e3 * on_s, "speedup": off_s / on_s})
    print(f"compiled: {1e3 * on_s:.2f} ms/token against {1e3 * off_s:.2f} ({out['speedup']:.2f}x)", flush=True)
    off_s, on_s = both(prefill)
    out.update({"off_prefill_ms": 1e3 * off_s, "on_prefill_ms": 1e3 * on_s, "prefill_speedup": off_s / on_s})
    print(f"compiled: a {args.context}-token prefill {1e3 * on_s:.1f} ms against {1e3 * off_s:.1f} "
          f"({out['prefill_speedup']:.2f}x)", flush=True)
    out["concurrency"] = []
    for n in args.concurrency:
        off, on_rate = both(lambda: concurrent_decode(eng, ctx, args.tokens, n))
        out["concurrency"].append({"calls": n, "off_tokens_per_s": off, "on_tokens_per_s": on_rate})
        print(f"  {n} calls at once: compiled {on_rate:.1f} tokens/s, as it comes {off:.1f} ({on_rate / off:.2f}x)",
              flush=True)
    # (the forwards that ran compiled: 0 where compiling failed, and every "on" figure is then as it comes)
    out["compiled_forwards"] = runner.compiled_forwards - ran
    if len(activities) > 1:  # (a compiled forward's launches, as it comes: what a graph of it replays)
        runner.compiled, runner.graphs = sides["on"][0], None
        with torch.profiler.profile(activities=activities) as prof:
            runner_steps(eng, args.context, PROFILED, sync)
        on("off")
        table = prof.key_averages()
        out["kernel_launches_per_forward"] = sum(
            e.count for e in table if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel"))) / PROFILED
        out["device_ms_per_forward"] = device_ms(table) / PROFILED
        print(f"compiled, per forward: {out['kernel_launches_per_forward']:.0f} kernel launches, device busy "
              f"{out['device_ms_per_forward']:.2f} ms", flush=True)
    return out


def main(argv=None):
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path, device = benchmark_model(args, tmp, **({"num_hidden_layers": args.layers} if args.layers else {}))
        kv = int(args.kv_gib * (1 << 30))
        eng = Engine(EngineConfig(path, device=device, decode_graphs="auto" if device != "cpu" else "eager",
                                  kv_budget_bytes=kv))
        more = not args.compile_only
        flex = Engine(EngineConfig(path, device=device, attention="flex", kv_budget_bytes=kv)) if args.flex and more \
            else None
        paged = Engine(EngineConfig(path, device=device, attention="paged", kv_budget_bytes=kv,
                                    decode_graphs="auto" if device != "cpu" else "eager")) if args.paged and more \
            else None
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=eng.lm.dtype, attn_implementation="sdpa").to(device) \
            if more else None
    graphs = eng.runner.graphs
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    prompt = torch.randint(3, eng.spec.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    ctx = eng.prefill([PrefillCall(prompt[0].tolist())])
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    result = {"device": device_name(device), "torch": torch.__version__, "shape": args.shape,
              "layers": eng.spec.num_layers, "context": args.context, "tokens": args.tokens}
    if args.compile_only:
        for n in args.concurrency:  # (the graphs of the side without compile captured, as in the full run)
            concurrent_decode(eng, ctx, 4, n)
        result["compile"] = compile_side_by_side(eng, graphs, ctx, args, sync, activities)
        write_json(args.out, f"profile_decode_compile_{'cpu' if device == 'cpu' else 'cuda'}", result,
                   device=device, model=eng.fingerprint, calibration=None)
        return
    side_by_side(eng, graphs, 1, lambda: (engine_decode(eng, ctx, 4), runner_steps(eng, args.context, 2, sync)))
    hf_decode(hf, prompt.to(device), 4, sync)
    decode = side_by_side(eng, graphs, args.rounds, lambda: engine_decode(eng, ctx, args.tokens))
    forward = side_by_side(eng, graphs, args.rounds, lambda: runner_steps(eng, args.context, args.tokens, sync))
    result.update({"engine_ms_per_token": 1e3 * decode["eager"], "engine_graphs_ms_per_token": 1e3 * decode["graphs"],
                   "graphs_speedup": decode["eager"] / decode["graphs"],
                   "transformers_ms_per_token": 1e3 * hf_decode(hf, prompt.to(device), args.tokens, sync),
                   "engine_forward_ms": 1e3 * forward["eager"], "engine_graphs_forward_ms": 1e3 * forward["graphs"]})
    if device != "cpu":  # transformers again, with SDPA's cuDNN backend off (a process-wide switch; one thread here)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            result["transformers_no_cudnn_ms_per_token"] = 1e3 * hf_decode(hf, prompt.to(device), args.tokens, sync)
        print(f"transformers without cuDNN attention: {result['transformers_no_cudnn_ms_per_token']:.1f} ms/token")
    print(f"{result['device']}, {args.shape} with {result['layers']} layers, context {args.context}: engine "
          f"{result['engine_ms_per_token']:.1f} ms/token (its forward alone {result['engine_forward_ms']:.1f} ms), "
          f"with decode graphs {result['engine_graphs_ms_per_token']:.1f} ms/token "
          f"({1e3 / result['engine_graphs_ms_per_token']:.1f} tokens/s, {result['graphs_speedup']:.2f}x; forward "
          f"alone {result['engine_graphs_forward_ms']:.1f} ms), transformers "
          f"{result['transformers_ms_per_token']:.1f} ms/token", flush=True)
    result["concurrency"] = []
    for n in args.concurrency:
        side_by_side(eng, graphs, 1, lambda: concurrent_decode(eng, ctx, args.tokens, n))  # (graphs captured)
        rate = side_by_side(eng, graphs, 1, lambda: concurrent_decode(eng, ctx, args.tokens, n))
        result["concurrency"].append({"calls": n, "eager_tokens_per_s": rate["eager"],
                                      "graphs_tokens_per_s": rate["graphs"]})
        print(f"{n} calls at once: {rate['eager']:.1f} tokens/s as they come, {rate['graphs']:.1f} with graphs "
              f"({rate['graphs'] / rate['eager']:.2f}x)", flush=True)
    if flex is not None:
        result["flex"] = attention_side_by_side(eng, flex, "flex", prompt, args)
    if paged is not None:
        result["paged"] = attention_side_by_side(eng, paged, "paged", prompt, args)
    name = f"profile_decode_{'cpu' if device == 'cpu' else 'cuda'}"

    def save():
        return write_json(args.out, name, result, device=device, model=eng.fingerprint, calibration=None)

    save()
    if args.overlap:
        result["overlap"] = overlap_side_by_side(eng, ctx, args)
        save()
    if graphs is not None:
        result["graph_buckets"], result["graph_captures"] = len(graphs.buckets), graphs.captures
    eng.runner.graphs = None  # (the forwards as they come: where the host time goes)
    with torch.profiler.profile(activities=activities) as prof:
        runner_steps(eng, args.context, PROFILED, sync)
    table = prof.key_averages()
    for sort in ["self_cpu_time_total"] + (["self_device_time_total"] if len(activities) > 1 else []):
        print(f"\nengine, {PROFILED} decode forwards, by {sort}:\n" + table.table(sort_by=sort, row_limit=args.rows),
              flush=True)
    syncs = [e for e in table if any(k in e.key for k in ("Synchronize", "Memcpy", "item", "_local_scalar"))]
    print("\ncopies and synchronisations:")
    for e in syncs:
        print(f"  {e.key:<50} x{e.count:<6} self CPU {e.self_cpu_time_total / 1e3:8.2f} ms")
    result["syncs"] = {e.key: e.count for e in syncs}
    if len(activities) > 1:  # per forward: kernel launches, and the time the device was busy
        result["kernel_launches_per_forward"] = sum(
            e.count for e in table if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel"))) / PROFILED
        result["device_ms_per_forward"] = device_ms(table) / PROFILED
        print(f"per forward: {result['kernel_launches_per_forward']:.0f} kernel launches, device busy "
              f"{result['device_ms_per_forward']:.2f} ms")
    if len(activities) > 1 and graphs is not None and graphs.capture:  # the same forwards replayed as graphs
        eng.runner.graphs = graphs
        with torch.profiler.profile(activities=activities) as prof:
            runner_steps(eng, args.context, PROFILED, sync)
        table = prof.key_averages()
        print(f"\ngraphed, {PROFILED} decode forwards, by self_device_time_total:\n"
              + table.table(sort_by="self_device_time_total", row_limit=args.rows), flush=True)
        result["graphs_launches_per_forward"] = sum(
            e.count for e in table if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch"))
        ) / PROFILED
        result["graphs_device_ms_per_forward"] = device_ms(table) / PROFILED
        print(f"graphed: {result['graphs_launches_per_forward']:.0f} launches per forward (kernels and graphs), "
              f"device busy {result['graphs_device_ms_per_forward']:.2f} ms")
    stem = save()
    if args.compile:  # (last: its compiling takes the longest, and a run cut short keeps what came before)
        result["compile"] = compile_side_by_side(eng, graphs, ctx, args, sync, activities)
        stem = save()
    plot(stem, result)


def plot(stem: str, result: dict) -> None:
    """stem.png: decode tokens/s at each concurrency, the engine's forwards as they come against graphed."""
    runs, flex, paged = result.get("concurrency", []), result.get("flex"), result.get("paged")
    if runs:
        grouped_bars(stem, f"decode, {result['shape']} ({result['layers']} layers), {result['device']}",
                     [str(r["calls"]) for r in runs],
                     [("tokens/s", {"as they come": [r["eager_tokens_per_s"] for r in runs],
                                    "CUDA graphs" if result["device"] != "cpu" else "padded (eager)":
                                    [r["graphs_tokens_per_s"] for r in runs],
                                    **({"attention flex": [r["flex_tokens_per_s"] for r in flex["concurrency"]]}
                                       if flex else {}),
                                    **({"attention paged": [r["paged_tokens_per_s"] for r in paged["concurrency"]]}
                                       if paged else {})})], "calls decoding at once")

if __name__ == "__main__":
    main()
