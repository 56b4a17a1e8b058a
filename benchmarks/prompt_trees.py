"""Prompt-tree training step vs flat training, side by side in one run, across cached-token ratios.

Each setting is one tree: a shared prefix of P tokens and F leaves of S supervised
tokens each. Packed, it is one row of P + F*S tokens under the graph mask
(`train.prompt_tree`, the backend `attention_backend` picks for the device); flat, it is F
rows of P + S tokens under plain causal attention, as a trainer without trees runs it.
The cached-token ratio is F(P + S) / (P + F*S). Both compute the same loss (checked
in each run); the step is forward, loss and backward, timed as the median of
`--repeats` after one warm-up. Attention's share of the packed step is measured by
timing the same step with attention skipped (values passed through).
"""

import argparse
import logging
import statistics
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AttentionInterface, AutoModelForCausalLM

from braid.engine import attention
from braid.models.checkpoints import SHAPES, make_config
from braid.results import pyplot, write_json, written
from braid.train.prompt_tree import PromptGraph, attention_backend, dense_mask, graph_loss, pack

# (P, F, S): cached-token ratios about 1, 4, 16 and 64 at 1024 packed tokens
SETTINGS = [(512, 1, 512), (824, 5, 40), (824, 20, 10), (880, 72, 2)]
SKIP = "bench-skip-attention"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="small", choices=sorted(SHAPES), help="model shape (random weights)")
    p.add_argument("--family", default="llama")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--settings", default=None,
                   help="P:F:S,... prefix tokens, fan-out, leaf tokens (default: " +
                        ",".join(":".join(map(str, s)) for s in SETTINGS) + ")")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per side (median reported)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the plot")
    return p.parse_args(argv)


def tree(prefix: list[int], leaves: list[list[int]]) -> PromptGraph:
    g = PromptGraph()
    root = g.add(prefix)
    for leaf in leaves:
        g.add(leaf, True, parents=(root,))
    return g


def flat_loss(model, prefix: torch.Tensor, leaves: torch.Tensor) -> torch.Tensor:
    """F rows [prefix, leaf], plain causal attention; mean cross-entropy over the leaf tokens."""
    ids = torch.cat([prefix.expand(len(leaves), -1), leaves], 1)  # [F, P + S]
    model.config._attn_implementation = "sdpa"  # transformers' own causal path
    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
    p = prefix.shape[1]
    logits = model.lm_head(hidden[:, p - 1:-1]).float()  # [F, S, vocab]: each leaf token from its predecessor
    return F.cross_entropy(logits.flatten(0, 1), leaves.flatten())


def timed(device, step, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def skip_attention(module, query, key, value, attention_mask, **kwargs):
    """No scores: each query takes its own value (shapes as the real one)."""
    groups = query.shape[1] // value.shape[1]
    return value.repeat_interleave(groups, 1).transpose(1, 2).contiguous(), None


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = attention_backend(device)
    settings = ([tuple(int(x) for x in s.split(":")) for s in args.settings.split(",")] if args.settings
                else SETTINGS)
    config = make_config(args.family, args.shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    AttentionInterface.register(SKIP, skip_attention)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for p, fan, s in tqdm(settings, desc="settings", unit="tree"):
        prefix = torch.randint(3, config.vocab_size, (1, p), generator=gen)
        leaves = torch.randint(3, config.vocab_size, (fan, s), generator=gen)
        packed = pack([tree(prefix[0].tolist(), leaves.tolist())], width=p + fan * s, pad_id=0).to(device)
        prefix, leaves = prefix.to(device), leaves.to(device)

        def packed_step():
            model.zero_grad(set_to_none=True)
            graph_loss(model, packed, backend).loss.backward()

        def flat_step():
            model.zero_grad(set_to_none=True)
            flat_loss(model, prefix, leaves).backward()

        with torch.no_grad():
            gap = abs(graph_loss(model, packed, backend).loss.item() - flat_loss(model, prefix, leaves).item())
        t_packed = timed(device, packed_step, args.repeats)
        t_flat = timed(device, flat_step, args.repeats)
        t_mask = timed(device, lambda: dense_mask(packed), args.repeats) if backend == "sdpa" else None
        name, attention.NAME = attention.NAME, SKIP  # the packed step without attention's cost
        try:
            t_skip = timed(device, packed_step, args.repeats) if backend == "sdpa" else None
        finally:
            attention.NAME = name
        ratio = fan * (p + s) / (p + fan * s)
        rows.append({"prefix": p, "fan_out": fan, "leaf": s, "cached_token_ratio": round(ratio, 2),
                     "packed_tokens": p + fan * s, "flat_tokens": fan * (p + s),
                     "packed_step_s": round(t_packed, 6), "flat_step_s": round(t_flat, 6),
                     "speedup": round(t_flat / t_packed, 2), "speedup_over_ratio": round(t_flat / t_packed / ratio, 2),
                     "packed_tokens_per_s": round((p + fan * s) / t_packed),
                     "flat_tokens_per_s": round(fan * (p + s) / t_flat),
                     "attention_share": None if t_skip is None else round(max(0.0, 1 - t_skip / t_packed), 3),
                     "mask_build_s": None if t_mask is None else round(t_mask, 5), "loss_gap": gap})
        tqdm.write(f"ratio {ratio:6.2f}: packed {1e3 * t_packed:8.1f} ms  flat {1e3 * t_flat:8.1f} ms  "
                   f"speedup {t_flat / t_packed:6.2f}x  (ratio x {t_flat / t_packed / ratio:.2f})"
                   + (f"  attention {rows[-1]['attention_share']:.0%} of packed" if t_skip is not None else ""))
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "threads": torch.get_num_threads(), "torch": torch.__version__, "backend": backend,
              "dtype": str(dtype), "model": {"family": args.family, "shape": args.shape,
                                             "parameters": sum(q.numel() for q in model.parameters())},
              "repeats": args.repeats, "rows": rows}
    # (a random model made here, never saved: no checkpoint was measured)
    stem = write_json(args.out, f"prompt_trees_{'cpu' if device.type == 'cpu' else 'cuda'}", result, device=str(device),
                      model=None, calibration=None)
    plot(result, stem + ".png")
    print(written(stem + ".json"))
    return result


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    ratio = [r["cached_token_ratio"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(ratio, [r["speedup"] for r in rows], "o-", label="measured (flat step / packed step)")
    a.plot(ratio, ratio, ":", color="grey", label="the cached-token ratio")
    a.plot(ratio, [0.8 * x for x in ratio], "--", color="grey", label="0.8 x the ratio")
    a.set(xscale="log", yscale="log", xlabel="cached-token ratio", ylabel="speedup", title="prompt-tree step speedup")
    a.legend()
    b.plot(ratio, [r["flat_tokens_per_s"] for r in rows], "o-", label="flat: tokens trained / s")
    b.plot(ratio, [r["flat_tokens"] / r["packed_step_s"] for r in rows], "o-",
           label="packed: flat-equivalent tokens / s")
    b.plot(ratio, [r["packed_tokens_per_s"] for r in rows], "o--", label="packed: tokens encoded / s")
    b.set(xscale="log", yscale="log", xlabel="cached-token ratio", ylabel="tokens / s", title="throughput")
    b.legend()
    m = result["model"]
    fig.suptitle(f"{m['family']} {m['shape']} ({m['parameters'] / 1e6:.1f}M), {result['device']}, "
                 f"{result['dtype']}, attention: {result['backend']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
