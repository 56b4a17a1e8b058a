"""What calibrating a model from traces costs on one device: steps and tokens per second, and peak memory.

`braid calibrate --traces` on workflows of a chosen size (branches, prompt, reply and answer tokens), on a
checkpoint of any shape (random weights: the cost does not depend on their values), e.g. the Llama-3.1-8B shape on
one GPU in the device run (benchmarks/device_run.sh, step calibration_cost). The traces carry their workers' replies
recorded by these weights and a reference answer, as a cluster recording with a labelled set gives them, so a step
costs what training costs: the branches' forward, placement and the synthesizer's forward and backward through the
LoRA and mapper; generating missing replies or text answers (self-distillation) is a per-trace cost on top, once
per draw. Steps after the first `--warmup` are timed (the median is reported).

    python benchmarks/calibration_cost.py --shape llama-3.1-8b --device cuda --dtype bfloat16 --steps 12
"""

import argparse
import json
import os
import random
import resource
import statistics
import tempfile
import time

import torch

from braid.engine.model import fingerprint_checkpoint
from braid.models.checkpoints import make_random_checkpoint
from braid.results import pyplot, write_json
from braid.train.calibrate import CalibrateConfig, calibrate


def words(tokenizer, n: int, rng: random.Random) -> str:
    """About n tokens of text (words of the tokenizer's own vocabulary)."""
    vocab = [w for w in tokenizer.get_vocab() if w.isalpha()] or ["word"]
    text = ""
    while len(tokenizer(text, add_special_tokens=False).input_ids) < n:
        text += " ".join(rng.choice(vocab) for _ in range(max(1, n // 4))) + " "
    return text.strip()


def write_traces(path: str, model: str, n: int, branches: int, prompt: int, reply: int, answer: int) -> float:
    """n string traces whose replies these weights 'wrote' (their fingerprint) and with reference answers; returns
    the mean tokens a trace's example reads (its branches' prompts and replies, and its answer)."""
    from transformers import AutoTokenizer

    tok, rng, fp = AutoTokenizer.from_pretrained(model), random.Random(0), fingerprint_checkpoint(model)
    count = lambda text: len(tok(text, add_special_tokens=False).input_ids)  # noqa: E731
    tokens = 0
    with open(path, "w") as f:
        for _ in range(n):
            trace = {"version": 1, "kind": "workflow", "task": words(tok, 16, rng),
                     "branches": [{"prompt": words(tok, prompt, rng), "reply": words(tok, reply, rng)}
                                  for _ in range(branches)],
                     "synthesis": {"prompt": words(tok, 8, rng)}, "answer": "",
                     "reference": words(tok, answer, rng), "model": fp, "worker_header": " "}
            tokens += sum(count(b["prompt"]) + count(b["reply"]) for b in trace["branches"]) + count(trace["reference"])
            f.write(json.dumps(trace) + "\n")
    return tokens / n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: random weights of --shape)")
    p.add_argument("--shape", default="tiny",
                   help="shape of the random checkpoint, and the result's name (with --model: its shape; "
                        "default: tiny)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--dtype", default="float32", help="the base weights' dtype (default: float32)")
    p.add_argument("--steps", type=int, default=8, help="timed steps after the warmup (default: 8)")
    p.add_argument("--warmup", type=int, default=2, help="steps timed apart first (default: 2)")
    p.add_argument("--tasks-per-step", type=int, default=8, help="traces per step (default: 8)")
    p.add_argument("--branches", type=int, default=4, help="branches per trace (default: 4)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="each worker's prompt (default: 256)")
    p.add_argument("--reply-tokens", type=int, default=128, help="each worker's reply (default: 128)")
    p.add_argument("--answer-tokens", type=int, default=64, help="the answer trained on (default: 64)")
    p.add_argument("--out", default="benchmarks/results", help="results folder (default: benchmarks/results)")
    args = p.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_random_checkpoint(os.path.join(tmp, "model"), "llama", args.shape,
                                                     dtype=getattr(torch, args.dtype), device=device)
        traces = os.path.join(tmp, "traces.jsonl")
        per_trace = write_traces(traces, model, 4 * args.tasks_per_step, args.branches, args.prompt_tokens,
                                 args.reply_tokens, args.answer_tokens)
        cfg = dict(model=model, traces=traces, sources="none", held_out_traces=0, placements="mixed",
                   tasks_per_step=args.tasks_per_step, device=device, dtype=args.dtype, resume=True, warmup=1,
                   worker_max_tokens=args.reply_tokens, answer_max_tokens=args.answer_tokens)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        record = calibrate(CalibrateConfig(**cfg, out=os.path.join(tmp, "cal"), steps=args.warmup + args.steps,
                                           eval_every=args.warmup + args.steps))
        wall = time.perf_counter() - began
        peak = (torch.cuda.max_memory_allocated() if device == "cuda"
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        shape = {k: getattr(__import__("transformers").AutoConfig.from_pretrained(model), k)
                 for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                           "vocab_size")}
        fingerprint = fingerprint_checkpoint(model)
    tokens = args.tasks_per_step * per_trace  # (counted in the traces written: their texts run a little long)
    timed = record["step_seconds"][args.warmup:]
    step_s = statistics.median(timed)
    result = {"config": vars(args), "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "shape": shape, "trainable_parameters": record["trainable_parameters"],
              "tokens_per_step": tokens, "step_seconds": step_s, "steps_per_second": 1 / step_s,
              "tokens_per_second": tokens / step_s, "peak_memory_bytes": peak,
              "warmup_step_seconds": record["step_seconds"][:args.warmup], "timed_step_seconds": timed,
              "wall_seconds": wall, "loss": record["loss"]}
    name = f"calibration_cost_{args.shape}_{device}"
    stem = write_json(args.out, name, result, device=device, model=fingerprint, calibration=None)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(range(1, len(record["loss"]) + 1), record["loss"])
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"calibration from traces, {args.shape}: {1 / step_s:.2f} steps/s, "
                     f"{tokens / step_s:.0f} tok/s, peak {peak / 2**30:.1f} GiB", fontsize=9)
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=110)
        plt.close(fig)
    print(f"{args.shape} on {result['device_name']}: {1 / step_s:.3f} steps/s, {tokens / step_s:.0f} tokens/s, "
          f"peak memory {peak / 2**30:.2f} GiB (median step {step_s:.2f} s; {wall:.0f} s in all, loading included)")
    print(f"wrote {stem}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
