"""Where a decode step's time goes: the engine's batch-1 decode beside plain transformers on the same weights.

Both decode `--tokens` tokens greedily after a `--context`-token prompt; the engine through `decode_stream`
(its scheduler thread, paged work cache and masks), transformers through the model's own forward with a
DynamicCache and SDPA. Prints ms per token for each, and the engine's forward alone (runner.step of one decode
row, in this thread), then torch.profiler's tables of those forwards (top ops by self CPU time and by device
time, and the host-device copies and synchronisations). Writes JSON.
"""

import argparse
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from braid.engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
from braid.engine.runner import GroupInput, WorkCache
from braid.models.checkpoints import add_model_arguments, benchmark_model
from braid.results import device_name, write_json


PROFILED = 4  # decode forwards under the profiler


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p, shape="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=0, help="override the shape's layer count (0: keep it)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rows", type=int, default=30, help="rows per profiler table")
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
    pool = eng.scheduler.pool
    cache = WorkCache(eng.lm, context + steps, pool, pool.allocate(context + steps))
    cache.append(torch.randn(*pool.kv.shape[:3], context, pool.kv.shape[4], dtype=pool.kv.dtype,
                             device=pool.kv.device), segment=0)
    dev = pool.kv.device
    visible = torch.ones(1, 2, dtype=torch.bool, device=dev)
    sync()
    start = time.perf_counter()
    for step in range(steps):
        eng.runner.step([GroupInput(cache, visible, torch.tensor([5], device=dev),
                                    torch.tensor([context + step], device=dev), torch.zeros(1, dtype=torch.long,
                                                                                            device=dev),
                                    torch.zeros(1, dtype=torch.long, device=dev))])
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


def main(argv=None):
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path, device = benchmark_model(args, tmp, **({"num_hidden_layers": args.layers} if args.layers else {}))
        eng = Engine(EngineConfig(path, device=device))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=eng.lm.dtype, attn_implementation="sdpa").to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    prompt = torch.randint(3, eng.spec.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    ctx = eng.prefill([PrefillCall(prompt[0].tolist())])
    engine_decode(eng, ctx, 4), hf_decode(hf, prompt.to(device), 4, sync), runner_steps(eng, args.context, 2, sync)
    result = {"device": device_name(device), "torch": torch.__version__,
              "shape": args.shape, "layers": eng.spec.num_layers, "context": args.context, "tokens": args.tokens,
              "engine_ms_per_token": 1e3 * engine_decode(eng, ctx, args.tokens),
              "transformers_ms_per_token": 1e3 * hf_decode(hf, prompt.to(device), args.tokens, sync),
              "engine_forward_ms": 1e3 * runner_steps(eng, args.context, args.tokens, sync)}
    if device != "cpu":  # transformers again, with SDPA's cuDNN backend off (a process-wide switch; one thread here)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            result["transformers_no_cudnn_ms_per_token"] = 1e3 * hf_decode(hf, prompt.to(device), args.tokens, sync)
        print(f"transformers without cuDNN attention: {result['transformers_no_cudnn_ms_per_token']:.1f} ms/token")
    print(f"{result['device']}, {args.shape} with {result['layers']} layers, context {args.context}: engine "
          f"{result['engine_ms_per_token']:.1f} ms/token (its forward alone {result['engine_forward_ms']:.1f} ms), "
          f"transformers {result['transformers_ms_per_token']:.1f} ms/token", flush=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
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
        result["device_ms_per_forward"] = sum(e.self_device_time_total for e in table) / 1e3 / PROFILED
        print(f"per forward: {result['kernel_launches_per_forward']:.0f} kernel launches, device busy "
              f"{result['device_ms_per_forward']:.2f} ms")
    write_json(args.out, f"profile_decode_{'cpu' if device == 'cpu' else 'cuda'}", result)


if __name__ == "__main__":
    main()
