"""Train Braid's reference model on text-concatenated workflow traces, one prompt graph per task.

    python -m braid.train.train --out models/braid-reference                  # the CPU recipe (defaults)
    python -m braid.train.train --num-layers 8 --tasks-per-step 256 --loader-workers 15   # on a GPU

Every step draws fresh tasks (2-12 branches, random branch lengths) from the
generators and renders each as a synthesizer trace (system, the workers' replies, the
question, the answer) and some worker traces (system, its context, its reply). A
task's traces become one prompt graph (`train.prompt_tree`): the system prompt is a node
they all share, encoded once. Graphs are packed into fixed-width rows, and the loss is
the flat one: the mean over the traces' written turns (worker replies and synthesizer
answers), as if each trace were its own sequence (`--packing flat` trains exactly
that, for comparison). A step's batch is a function of the seed and the step, built
ahead by loader processes on request; at every evaluation the run writes the
checkpoint (safetensors), its tokenizer, `training.json` (config, time, sizes, loss
and held-out accuracy over steps) and `loss.png`.
"""

import argparse
import dataclasses
import inspect
import json
import logging
import math
import os
import random
import re
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from braid.engine import attention
from braid.models.chat import END, PAD
from braid.models.tasks import MAX_BRANCHES, TASKS, generate, lookup_drill, synthesizer_trace, worker_trace
from braid.train.prompt_tree import (GraphError, PackedGraphs, PromptGraph, attention_backend, enable_checkpointing,
                               graph_loss, pack, prefix_graph)
from braid.train.tokenizer import train_tokenizer

log = logging.getLogger("braid.train")
RUN_FIELDS = ("config", "train_seconds", "tokens_seen", "flat_tokens_seen", "step_seconds", "torch", "device", "loss",
              "held_out_accuracy")
HELD_OUT = (*TASKS, "chain worker", "vote worker", "trail worker", "lookup drill", "multiqa parallel")
TRAIN_SEEDS = 1 << 40  # training tasks use seeds from here on; evaluation uses small seeds


@dataclass
class TrainConfig:
    out: str = "models/braid-reference"  # where the checkpoint, training.json and loss.png go
    seed: int = 0  # the tokenizer, the initial weights and every step's batch depend on it alone
    steps: int = 2400  # optimizer steps (the schedule's length)
    tasks_per_step: int = 16  # tasks drawn per step, each with its traces (and its drills)
    row_tokens: int = 512  # width of the packed rows
    lr: float = 2e-3  # peak learning rate (AdamW), after a linear warmup, then cosine
    warmup: int = 100  # warmup steps
    weight_decay: float = 0.05
    hidden_size: int = 256  # model shape (Llama): hidden size
    num_layers: int = 4  # decoder layers
    num_heads: int = 8  # query heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention)
    intermediate_size: int = 768  # MLP width
    vocab_size: int = 1024  # the byte-level BPE tokenizer's target vocabulary (it may learn fewer)
    max_length: int = 12  # largest per-branch length drawn in training (evaluation's default is 2-6)
    min_branches: int = 2  # tasks draw min_branches..12 branches
    tasks: str = ",".join(TASKS)  # the tasks drawn, uniformly (a name twice is drawn twice as often)
    worker_traces: int = 2  # worker turns trained per task (of its 2-12 branches), beside the synthesizer's
    lookup_drills: int = 0  # drills per task drawn: chain worker turns over any names (models.tasks.lookup_drill)
    # share of the tasks drawn whose branches are the user's own turns (MultiQA) that also train the synthesizer
    # reading those branches encoded apart, each right after the system prompt, as `cache:branch_point` serves
    # them (Prompt Choreography's fine-tuning on parallel encodings; `parallel_graph`)
    parallel: float = 0.0
    eval_every: int = 250  # steps between held-out evaluations (each saves the checkpoint)
    packing: str = "graph"  # graph: a task's traces share their prefixes; flat: each trace its own sequence
    attention: str = "auto"  # how packed rows attend (train.prompt_tree.attention_backend): auto, sdpa or flex
    checkpointing: bool = False  # recompute each layer's activations in the backward (less memory)
    # bf16: autocast matmuls to bfloat16 (weights and optimizer stay fp32); auto: bf16 on CUDA, fp32 elsewhere
    # (on AVX2-only CPUs bf16 is emulated and measured 10x slower than fp32: 20 s vs 1.8 s a step)
    precision: str = "auto"
    device: str = "auto"  # cpu, cuda or auto
    loader_workers: int = 0  # processes building batches ahead of the model (on a GPU, data is the bottleneck)
    threads: int = 0  # 0: torch's default
    # continue from this checkpoint's weights and tokenizer (a fresh warmup and schedule; the model
    # shape options are then ignored); training time and tokens add up in training.json
    init_from: str = ""
    # seconds: end the run at the first step past this much training time (evaluated and saved there), the
    # schedule reaching its floor by then whatever `steps` says (a lent GPU's fixed time); 0: steps alone
    time_limit: float = 0.0

    @property
    def task_names(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.tasks.split(",") if t.strip())

    def __post_init__(self):
        for name in ("steps", "tasks_per_step", "worker_traces", "row_tokens", "hidden_size", "num_layers", "num_heads",
                     "num_kv_heads", "intermediate_size", "eval_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads or self.hidden_size % self.num_heads:
            raise ValueError("num_heads must divide hidden_size, and num_kv_heads must divide num_heads")
        unknown = [t for t in self.task_names if t not in TASKS]
        if unknown or not self.task_names:
            raise ValueError(f"tasks must name some of {', '.join(TASKS)}, got {self.tasks!r}")
        if self.loader_workers < 0 or self.lookup_drills < 0:
            raise ValueError(f"loader_workers and lookup_drills must be >= 0, got {self.loader_workers}, "
                             f"{self.lookup_drills}")
        if not 0 <= self.parallel <= 1:
            raise ValueError(f"parallel must be a share in [0, 1], got {self.parallel}")
        if self.time_limit < 0:
            raise ValueError(f"time_limit must be >= 0 seconds, got {self.time_limit}")
        if not 0 < self.lr < 1 or self.warmup < 0:
            raise ValueError(f"lr must be in (0, 1) and warmup >= 0, got {self.lr}, {self.warmup}")
        if not 2 <= self.min_branches <= MAX_BRANCHES:
            raise ValueError(f"min_branches must be in 2..{MAX_BRANCHES}, got {self.min_branches}")
        if not 1 <= self.max_length <= 12:
            raise ValueError(f"max_length must be in 1..12, got {self.max_length}")
        if self.row_tokens < 512:
            raise ValueError(f"row_tokens must fit the longest trace (12 branches of length 12): >= 512, "
                             f"got {self.row_tokens}")
        if self.packing not in ("graph", "flat") or self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"packing must be graph or flat and precision auto, bf16 or fp32; got {self.packing!r}, "
                             f"{self.precision!r}")
        if self.init_from and not os.path.isfile(os.path.join(self.init_from, "training.json")):
            raise ValueError(f"init_from {self.init_from!r} is not a checkpoint written by this script")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.precision == "auto":
            self.precision = "bf16" if self.device.startswith("cuda") else "fp32"
        self.attention = attention_backend(self.device, self.attention)  # (refuses an unknown name)
        if self.attention == "flex" and not self.device.startswith("cuda"):
            raise ValueError(f"attention flex trains on CUDA only (torch has no FlexAttention backward on "
                             f"{self.device}); use sdpa")


def draw_task(rng: random.Random, max_length: int, names: tuple[str, ...] = TASKS, min_branches: int = 2):
    name = rng.choice(names)
    lo = rng.randint(1, max_length)
    return generate(name, rng.randrange(TRAIN_SEEDS, 2 * TRAIN_SEEDS), rng.randint(min_branches, MAX_BRANCHES),
                    (lo, rng.randint(lo, max_length)))


def step_rng(seed: int, step: int) -> random.Random:
    """The tasks of one step. A step's batch depends only on (seed, step), so it is the same however many
    loader processes build it, and a continued run (which counts steps on from the checkpoint's) draws new tasks."""
    return random.Random(f"train:{seed}:{step}")


def traces(task, rng: random.Random, workers: int = 2) -> list[list[tuple[str, bool]]]:
    """The synthesizer's trace and `workers` of the workers' (worker replies are short: they cost little)."""
    out = [synthesizer_trace(task)]
    if task.has_workers:
        out += [worker_trace(task, j) for j in rng.sample(range(len(task.branches)), min(workers, len(task.branches)))]
    return out


Pieces = list[tuple[list[int], bool]]  # a trace's messages: (token ids, supervised)


def encode(tokenizer, traces: list[list[tuple[str, bool]]]) -> list[Pieces]:
    """Token ids of each trace's messages, each message encoded on its own as the engine does.

    One batched tokenizer call for all messages: per-message calls made tokenizing most of a step's time.
    """
    pieces = iter(tokenizer([text for trace in traces for text, _ in trace], add_special_tokens=False)["input_ids"])
    return [[(next(pieces), sup) for _, sup in trace] for trace in traces]


def chain(pieces: Pieces) -> PromptGraph:
    """One trace as a graph of one node: a flat sequence."""
    graph = PromptGraph()
    graph.add([t for ids, _ in pieces for t in ids], [sup for ids, sup in pieces for _ in ids])
    return graph


def parallel_graph(pieces: Pieces) -> PromptGraph:
    """A synthesizer trace (system, branches, prompt, answer) whose branches are encoded apart: each sees only
    the system prompt and starts right after it, and the prompt and answer see them all from after the longest,
    exactly as the engine's `cache:branch_point` synthesis places branch KV that was prefilled on its own. (All
    branches sit at the same positions, so nothing shows their order: train it on `synthesizer_trace(task,
    apart=True)`, whose answer does not depend on it.)"""
    (system, _), *branches, (prompt, _), (answer, sup) = pieces
    graph = PromptGraph()
    root = graph.add(system)
    nodes = [graph.add(ids, parents=(root,)) for ids, _ in branches]
    graph.add([*prompt, *answer], [False] * len(prompt) + [sup] * len(answer), parents=(root, *nodes))
    return graph


def task_graphs(traces: list[Pieces], packing: str, width: int) -> list[PromptGraph]:
    """A task's traces as one prompt graph (or, flat, one graph per trace: also where sharing is impossible)."""
    if packing == "graph":
        try:
            graph = prefix_graph(traces)
            if graph.tokens <= width:
                return [graph]
        except GraphError:  # a trace repeated: the flat objective counts it twice, so it stays flat
            pass
    return [chain(t) for t in traces]


def batch(cfg: TrainConfig, tokenizer, step: int) -> PackedGraphs:
    """Step `step`'s packed rows: `tasks_per_step` tasks, each with its traces and drills."""
    rng, drawn, parallel = step_rng(cfg.seed, step), [], []
    apart = random.Random(f"parallel:{cfg.seed}:{step}")  # (its own draws: the tasks are the same either way)
    for _ in range(cfg.tasks_per_step):
        # (each task's traces are drawn right after it)
        task = draw_task(rng, cfg.max_length, cfg.task_names, cfg.min_branches)
        drawn.append(traces(task, rng, cfg.worker_traces))
        if cfg.parallel and not task.has_workers and apart.random() < cfg.parallel:
            parallel.append(synthesizer_trace(task, apart=True))
        drawn += [[lookup_drill(rng)] for _ in range(cfg.lookup_drills)]
    encoded = iter(encode(tokenizer, [t for group in drawn for t in group] + parallel))
    graphs = [g for group in drawn for g in task_graphs([next(encoded) for _ in group], cfg.packing, cfg.row_tokens)]
    graphs += [parallel_graph(pieces) for pieces in encoded]
    return pack(graphs, cfg.row_tokens, tokenizer.pad_token_id)


class Batches(torch.utils.data.IterableDataset):
    """The batches of steps [first, first + count) in order; loader process w of W builds steps w, w + W, ...
    and the loader takes them round-robin, so the order and content do not depend on W."""

    def __init__(self, cfg: TrainConfig, tokenizer, first: int, count: int):
        self.cfg, self.tokenizer, self.first, self.count = cfg, tokenizer, first, count

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, workers = (info.id, info.num_workers) if info else (0, 1)
        for step in range(self.first + w, self.first + self.count, workers):
            yield batch(self.cfg, self.tokenizer, step)


def build_tokenizer(cfg: TrainConfig):
    rng = random.Random(f"tokenizer:{cfg.seed}")
    texts = [text for _ in range(4000) for trace in traces(draw_task(rng, cfg.max_length), rng)
             for text, _ in trace]
    return train_tokenizer(texts, cfg.vocab_size)


def build_model(cfg: TrainConfig, tokenizer) -> LlamaForCausalLM:
    end_id, pad_id = tokenizer.convert_tokens_to_ids([END, PAD])
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.hidden_size // cfg.num_heads, intermediate_size=cfg.intermediate_size,
                         max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=end_id, pad_token_id=pad_id)
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = attention.NAME
    model.generation_config = GenerationConfig(eos_token_id=end_id, pad_token_id=pad_id)
    return model


def load_for_training(path: str):
    """A checkpoint written by this script, through the same path loader the engine uses, and its record."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config._attn_implementation = attention.NAME
    with open(os.path.join(path, "training.json")) as f:
        record = json.load(f)
    record.setdefault("total_steps", record["config"]["steps"])  # records of single runs predate the totals
    record.setdefault("total_train_seconds", record["train_seconds"])
    return model, tokenizer, record


def held_out(cfg: TrainConfig, tokenizer, per_task: int = 32) -> dict[str, PackedGraphs]:
    """Fixed held-out traces (training seeds never reach these): the synthesizer's per task, and one
    worker's per task with workers (`<task> worker`): a task is only answered if both are right. The
    lookup drills show whether the workers' lookup works for any key, not only for chain's."""
    out = {}
    for name in HELD_OUT:
        task_name, _, role = name.partition(" ")
        rng = random.Random(f"held-out:{name}")
        if role == "drill":
            seqs = encode(tokenizer, [lookup_drill(rng) for _ in range(per_task)])
        else:
            tasks = [generate(task_name, -1 - i, rng.randint(2, MAX_BRANCHES), (1, cfg.max_length))
                     for i in range(per_task)]
            # (parallel: the synthesizer reading its branches encoded apart, parallel_graph)
            seqs = encode(tokenizer, [worker_trace(t, rng.randrange(len(t.branches))) if role == "worker"
                                      else synthesizer_trace(t, apart=role == "parallel") for t in tasks])
        build = parallel_graph if role == "parallel" else chain
        out[name] = pack([build(s) for s in seqs], cfg.row_tokens, tokenizer.pad_token_id)
    return out


@torch.no_grad()
def answer_accuracy(model, held: dict[str, PackedGraphs], device, backend: str = "sdpa") -> dict[str, float]:
    """Teacher-forced: the share of held-out answers whose every token is the argmax."""
    model.eval()
    acc = {}
    for name, packed in held.items():
        packed = packed.to(device)
        correct = graph_loss(model, packed, backend).correct
        n = int(packed.graph_of_target.max()) + 1
        wrong = torch.zeros(n, dtype=torch.bool, device=device)
        wrong.index_put_((packed.graph_of_target,), ~correct, accumulate=True)
        acc[name] = 1 - wrong.float().sum().item() / n
    model.train()
    return acc


def lr_at(cfg: TrainConfig, step: int, seconds: float = 0.0) -> float:
    """Linear warmup, then cosine to 5% of the peak; with a time limit, progress is the larger of the step's
    and the training time's (`seconds`) share, so a run stopped by the clock ends at the floor too."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    if cfg.time_limit:
        progress = min(1.0, max(progress, seconds / cfg.time_limit))
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(cfg: TrainConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.loader_workers:  # the loader forks after the tokenizer's first use; its thread pool must not be shared
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    device = torch.device(cfg.device)
    started = time.perf_counter()
    earlier = None
    if cfg.init_from:
        model, tokenizer, earlier = load_for_training(cfg.init_from)
        model = model.to(device)
        shape = model.config  # the shape options are the checkpoint's: record those, not the ignored flags
        cfg.hidden_size, cfg.num_layers, cfg.intermediate_size = (shape.hidden_size, shape.num_hidden_layers,
                                                                  shape.intermediate_size)
        cfg.num_heads, cfg.num_kv_heads = shape.num_attention_heads, shape.num_key_value_heads
        log.info("continuing from %s (%d steps, %.1f min so far)", cfg.init_from, earlier["total_steps"],
                 earlier["total_train_seconds"] / 60)
    else:
        tokenizer = build_tokenizer(cfg)
        model = build_model(cfg, tokenizer).to(device)
    if cfg.checkpointing:
        enable_checkpointing(model)
    params = sum(p.numel() for p in model.parameters())
    log.info("model: %.2fM parameters, vocab %d, on %s", params / 1e6, len(tokenizer), device)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98))
    start = earlier["total_steps"] if earlier else 0
    held = held_out(cfg, tokenizer)
    loader = torch.utils.data.DataLoader(Batches(cfg, tokenizer, start, cfg.steps), batch_size=None,
                                         num_workers=cfg.loader_workers, pin_memory=device.type == "cuda",
                                         prefetch_factor=8 if cfg.loader_workers else None)
    history, evals, tokens_seen, flat_tokens, step_seconds = [], [], 0, 0, 0.0

    def report() -> dict:
        seconds = time.perf_counter() - started
        return {"config": dataclasses.asdict(cfg), "train_seconds": round(seconds, 1),
                "total_steps": start + len(history),
                "total_train_seconds": round(seconds + (earlier["total_train_seconds"] if earlier else 0), 1),
                "earlier_runs": (earlier.get("earlier_runs", []) + [{k: earlier.get(k) for k in RUN_FIELDS}]
                                 if earlier else []),
                "parameters": params, "vocab_size": len(tokenizer), "tokens_seen": tokens_seen,
                "flat_tokens_seen": flat_tokens, "step_seconds": round(step_seconds, 1),
                "torch": torch.__version__, "device": str(device), "loss": history, "held_out_accuracy": evals}

    model.train()
    bar = tqdm(zip(range(cfg.steps), loader), total=cfg.steps, desc="training", unit="step")
    looping = time.perf_counter()
    for step, packed in bar:
        began = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step, began - looping)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
            loss = graph_loss(model, packed.to(device), cfg.attention).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens_seen += packed.tokens
        flat_tokens += packed.flat_tokens
        history.append(round(loss.item(), 5))  # (the .item() syncs; at this model size it costs nothing measurable)
        step_seconds += time.perf_counter() - began
        bar.set_postfix(loss=f"{history[-1]:.4f}", rows=packed.ids.shape[0], refresh=False)
        out_of_time = bool(cfg.time_limit) and time.perf_counter() - looping >= cfg.time_limit
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps or out_of_time:
            acc = answer_accuracy(model, held, device, cfg.attention)
            evals.append({"step": step + 1, **acc})
            log.info("step %d loss %.4f held-out answer accuracy %s", step + 1, loss.item(),
                     " ".join(f"{k}={v:.2f}" for k, v in acc.items()))
            saved = report()
            save(cfg.out, model, tokenizer, saved)  # a stopped run keeps its last evaluated checkpoint
        if out_of_time:
            log.info("time limit (%.0f s) reached at step %d of %d", cfg.time_limit, step + 1, cfg.steps)
            break
    log.info("trained in %.1f min, %d tokens; saved to %s", saved["train_seconds"] / 60, tokens_seen, cfg.out)
    return saved


def save(out: str, model, tokenizer, report: dict) -> None:
    """The checkpoint in Hugging Face format, its training record and loss plot."""
    os.makedirs(out, exist_ok=True)
    model.config._attn_implementation = "sdpa"  # what a reader of the checkpoint gets by default
    model.save_pretrained(out)
    model.config._attn_implementation = attention.NAME
    tokenizer.save_pretrained(out)
    report["model_bytes"] = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)
                                if f.endswith(".safetensors"))
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(report, f)
    plot(report, os.path.join(out, "loss.png"))


def plot(report: dict, path: str) -> None:
    from braid.results import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    runs = [*report["earlier_runs"], report]  # every run that led to this checkpoint, in order
    loss, evals, starts = [], [], []
    for run in runs:
        starts.append(len(loss))
        evals += [{**e, "step": e["step"] + len(loss)} for e in run["held_out_accuracy"]]
        loss += run["loss"]
    window = max(1, len(loss) // 100)
    smooth = [sum(loss[max(0, i - window + 1):i + 1]) / len(loss[max(0, i - window + 1):i + 1])
              for i in range(len(loss))]
    a.plot(range(1, len(loss) + 1), loss, alpha=0.3, label="per step")
    a.plot(range(1, len(loss) + 1), smooth, label=f"mean of {window}")
    a.set(yscale="log", xlabel="step", ylabel="cross-entropy on written turns", title="training loss")
    for start in starts[1:]:
        a.axvline(start, color="grey", ls=":")
    a.legend()
    for name in (n for n in HELD_OUT if any(n in e for e in evals)):  # records before a metric existed lack it
        b.plot([e["step"] for e in evals if name in e], [e[name] for e in evals if name in e], marker="o",
               label=name, ls="-" if name in TASKS else "--")
    b.set(xlabel="step", ylabel="share of answers right (teacher-forced)", ylim=(0, 1.02),
          title="held-out answers and worker replies")
    b.legend()
    tokens = sum(r["tokens_seen"] for r in runs)
    fig.suptitle(f"{report['parameters'] / 1e6:.2f}M-parameter Llama, {report['total_train_seconds'] / 60:.0f} min "
                 f"on {', '.join(dict.fromkeys(r['device'] for r in runs))}, {tokens / 1e6:.1f}M tokens"
                 + (f", {len(runs)} runs" if len(runs) > 1 else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)  # (a run plots at every evaluation: pyplot keeps figures until closed)


def config_parser(config_class, prog: str, doc: str) -> argparse.ArgumentParser:
    """A parser with one --flag per field of a config dataclass, typed by its default (bools take true/false),
    its help the field's comments in the class (those above it and the one after it)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    notes = field_comments(config_class)
    for f in dataclasses.fields(config_class):
        kind = (lambda v: v.lower() in ("1", "true", "yes")) if isinstance(f.default, bool) else type(f.default)
        p.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default,
                       help=notes.get(f.name, "").replace("%", "%%"))
    return p


def run_cli(config_class, run, argv, prog: str, doc: str) -> int:
    """A trainer's command line: its config's flags (config_parser), INFO logging, then `run(config)`."""
    args = config_parser(config_class, prog, doc).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    run(config_class(**vars(args)))
    return 0


def field_comments(config_class) -> dict[str, str]:
    """Each field's comments in the class's source: the comment lines right above it, then the one after it."""
    notes, above = {}, []
    for line in inspect.getsource(config_class).splitlines()[1:]:
        code, _, comment = line.partition("  # ")
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# ").strip())
            continue
        name = re.match(r"\s+(\w+)\s*:", code)
        if name and "(" not in name.group(1):
            notes[name.group(1)] = " ".join([*above, comment.strip()]).strip()
        above = []
    return notes


def main(argv=None) -> int:
    return run_cli(TrainConfig, train, argv, "python -m braid.train.train", __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
