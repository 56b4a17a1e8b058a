"""How far KV made while decoding is from KV made by prefilling the same tokens, and what greedy decodes after each do.

A session rebuilt from its lineage (runtime.sessions) encodes a decoded answer again by prefill; its KV then
differs from the KV the decode steps wrote by the device's rounding (one row a step against many rows a forward:
other kernels, other reduction orders), nothing else. For `--answers` answers of `--tokens` tokens, each decoded
greedily after a `--context`-token prompt, this prefills the same tokens at the same place and compares the two
messages' KV over the decoded tokens: the largest absolute difference, and the difference's norm against the KV's
norm, per layer. Then it decodes `--after` tokens greedily after each message and counts the answers whose tokens
agree. On CPU in fp32 the two agree to rounding; the device run measures bf16 on a GPU. Writes JSON and a plot.
"""

import argparse
import tempfile

import torch
from tqdm import tqdm

from braid.engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
from braid.models.checkpoints import add_model_arguments, benchmark_model
from braid.results import pyplot, write_json, written


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--context", type=int, default=512, help="prompt tokens before each answer")
    p.add_argument("--tokens", type=int, default=64, help="tokens decoded in each answer")
    p.add_argument("--after", type=int, default=16, help="tokens decoded greedily after each message, to compare")
    p.add_argument("--answers", type=int, default=4)
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the plot")
    return p.parse_args(argv)


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, ignore_eos=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="braid-kv-drift-") as tmp:
        path, device = benchmark_model(args, tmp)
        eng = Engine(EngineConfig(path, device=device))
        gen = torch.Generator().manual_seed(0)
        layers = torch.zeros(eng.spec.num_layers, dtype=torch.float64)
        rows, agree = [], 0
        for i in tqdm(range(args.answers), desc="answers"):
            prompt = torch.randint(3, eng.spec.vocab_size, (args.context,), generator=gen).tolist()
            ctx, = eng.prefill([PrefillCall(prompt)])
            header = prompt[-1:]  # (one header token: the rest of the answer's KV is written a row a step)
            decoded, = eng.decode([DecodeCall(header, [ctx], sampling=greedy(args.tokens))])
            tokens = list(eng.message(decoded).token_ids)
            prefilled, = eng.prefill([PrefillCall(tokens, [ctx])])
            a = eng.message(decoded).kv.read(1).double()  # [L, 2, H, tokens, D]: the decoded tokens' KV
            b = eng.message(prefilled).kv.read(1).double()
            diff = (a - b).flatten(1)
            per_layer = diff.norm(dim=1) / b.flatten(1).norm(dim=1)
            layers += per_layer.cpu()
            follow = [eng.decode([DecodeCall(header, [ctx, m], sampling=greedy(args.after))])[0]
                      for m in (decoded, prefilled)]
            after = [eng.message(m).token_ids[len(header):] for m in follow]
            agree += after[0] == after[1]
            rows.append({"answer": i, "max_abs_diff": diff.abs().max().item(),
                         "relative_diff": (diff.norm() / b.flatten(1).norm()).item(),
                         "worst_layer_relative_diff": per_layer.max().item(),
                         "greedy_after_agree": after[0] == after[1]})
            print(f"answer {i}: max |decoded - prefilled| {rows[-1]['max_abs_diff']:.3g}, relative "
                  f"{rows[-1]['relative_diff']:.3g}; greedy tokens after agree: {after[0] == after[1]}", flush=True)
            eng.discard([ctx, decoded, prefilled, *follow], when_unpinned=False)
        result = {"shape": args.shape if not args.checkpoint else args.checkpoint, "device": device,
                  "dtype": str(eng.lm.dtype).removeprefix("torch."), "config": vars(args), "rows": rows,
                  "max_abs_diff": max(r["max_abs_diff"] for r in rows),
                  "relative_diff_median": sorted(r["relative_diff"] for r in rows)[len(rows) // 2],
                  "greedy_after_agree": agree, "answers": args.answers,
                  "per_layer_relative_diff": (layers / args.answers).tolist()}
        print(f"decoded against prefilled KV ({result['dtype']}, {device}): max abs {result['max_abs_diff']:.3g}, "
              f"median relative {result['relative_diff_median']:.3g}; greedy decodes after agree on "
              f"{agree}/{args.answers}", flush=True)
        name = f"kv_drift_{'cpu' if device == 'cpu' else 'cuda'}"
        stem = write_json(args.out, name, result, device=device, model=eng.fingerprint, calibration=None)
        plt = pyplot()
        if plt is not None:
            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.plot(result["per_layer_relative_diff"], marker="o")
            ax.set(xlabel="layer", ylabel="|decoded - prefilled| / |prefilled|",
                   title=f"KV made decoding against prefill, {result['dtype']} on {device}")
            fig.tight_layout()
            fig.savefig(stem + ".png")
        print(written(stem + ".json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
