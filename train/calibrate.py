"""Train a calibration (cache mapper + synthesizer LoRA) for a frozen base model: `braid calibrate`.

    braid calibrate --model models/braid-reference            # writes models/braid-reference/calibration

A step draws `tasks_per_step` tasks from the generators (branch counts from `--branches`, branch work of length
1..`--max-length`, a placement from `--placements`) and builds, for each, exactly what the cache path sees at
serving time, with the base weights and no gradient:

  - the shared system prompt's KV (the synthesizer's own prefix: never mapped);
  - each branch's message KV, encoded where the worker encoded it (after the prefix and its own context),
    then re-encoded to the placement by the engine's RoPE kernel. Worker replies are the ones the model itself
    decodes greedily: the reference reply is checked against the model's argmax in one forward, and decoded
    token by token where the two differ.

The branches then go through the mapper, and the LoRA synthesizer (the only trainable parts, with the mapper)
reads them and its prompt and is trained on the answer. Three data sources (Parallel-Synthesis), mixed by `--sources`:

  parallel   continued pretraining on parallel caches: the text-concatenated trace the model was trained on, its
             branch replies encoded as independent texts after the prefix (no private context), and the
             question and answer as the continuation that needs them;
  synthesis  multi-source synthesis: the four task families with worker replies decoded under their contexts;
             target: the reference answer;
  distill    the same branches; target: the text pipeline's own greedy answer, plus a KL term to its logits
             (`--kl-weight`).

Branch counts not in `--branches` and lengths above `--max-length` are never trained on, so evaluation can show
generalisation to them; calibration task seeds lie in their own range, disjoint from evaluation's small seeds
and from the base model's training seeds. At every evaluation (teacher-forced held-out answer accuracy) the run
writes the calibration (mapper, adapter, manifest with the training record), `loss.png` and a resume state.
"""

import dataclasses
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from braid.engine import attention
from braid.engine.model import fingerprint_checkpoint
from braid.kernels import rerotate_keys_torch
from braid.methods.calibration import ADAPTER_DIR, MANIFEST, CacheMapper, Calibration, LoraSettings, MapperConfig
from braid.methods.synthesis import Placement, Refresh, kept_apart, place_branches, refresh_of
from braid.models.chat import END, WORKER_HEADER, TemplateError, task_renderer, turn
from braid.models.tasks import MAX_BRANCHES, TASKS, WITHOUT_WORKERS, Task, generate
from braid.models.traces import TraceWorkflow, load_trace_workflows, split
from braid.train.train import run_cli

log = logging.getLogger("braid.calibrate")
SOURCES = ("parallel", "synthesis", "distill")
CALIBRATION_SEEDS = 2 << 40  # [2^41, 3 * 2^40): disjoint from evaluation (small seeds) and the base model's training
RESUME = "resume.pt"
HELD_OUT_BRANCHES = (4, 5, 8)  # the teacher-forced held-out set during training (5 and 8 are held out by default)


@dataclass
class CalibrateConfig:
    model: str = "models/braid-reference"  # the frozen base model the calibration is for
    out: str = ""  # default: <model>/calibration
    seed: int = 0  # every step's tasks depend on it and the step alone
    steps: int = 1500  # optimizer steps (the schedule's length)
    tasks_per_step: int = 8  # tasks drawn per step, each one training example
    lr: float = 2e-3  # LoRA's peak learning rate (AdamW; linear warmup, then cosine)
    mapper_lr: float = 5e-3  # the cache mapper's peak learning rate
    warmup: int = 50  # warmup steps
    lora_rank: int = 16  # the synthesizer LoRA's rank
    lora_alpha: int = 32  # its scale numerator (peft's lora_alpha)
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj"  # the attention projections it adapts
    mapper_rank: int = 0  # a low-rank residual in the mapper as well as the affine terms (0: affine only)
    mapper_conditioned: bool = True  # the mapper's affine terms also depend on the branch's length and the count
    mapper_branch_slots: int = 16  # a learned K/V shift per branch index (0: none)
    kl_weight: float = 1.0  # weight of the KL term to the text pipeline's logits (distill examples)
    # source=weight: how often each is drawn; "none": no synthetic task at all, only --traces (and no synthetic
    # held-out set either: the check is on the held-out traces)
    sources: str = "parallel=1,synthesis=2,distill=1"
    branches: str = "2,3,4,6,7,9,10,12"  # branch counts trained on (5, 8 and 11 held out by default)
    max_length: int = 8  # branch work lengths 1..max_length are trained on (above: held out)
    placements: str = "branch_point,sequential"  # where branches are re-encoded to, drawn uniformly
    tasks: str = ",".join(TASKS)  # the tasks drawn, uniformly (a name twice is drawn twice as often)
    worker_max_tokens: int = 48  # as braid eval decodes workers
    answer_max_tokens: int = 160  # the text pipeline's answers (the distillation targets)
    eval_every: int = 100  # steps between held-out evaluations (each saves the calibration and resume.pt)
    held_out_per_cell: int = 24  # held-out tasks per (task, branch count) in the training-time check
    device: str = "auto"  # cpu, cuda or auto
    dtype: str = "float32"  # the frozen base model's weights (bfloat16 halves an 8B model's memory on a GPU); the
    # mapper and the LoRA train in float32 either way
    threads: int = 0  # torch threads (0: torch's default)
    resume: bool = True  # continue from <out>/resume.pt when it is there
    # start from this calibration's LoRA and mapper weights (a fresh optimizer and schedule; mapper parts it
    # lacks start at their init)
    init_from: str = ""
    # tokens at each end of every branch re-encoded with the earlier branches in view, as the served cache path
    # does with refresh_tokens (methods.synthesis.Refresh): the synthesizer trains on what it will read
    refresh: int = 0
    # tokens re-encoded at the end of every branch, when that differs from refresh (-1: as many as refresh)
    refresh_tail: int = -1
    # recorded workflows to train on as well (comma-separated JSONL files: braid serve --record, or written by hand;
    # the format is braid.models.traces): the target is the model's own answer from text, or a trace's reference
    traces: str = ""
    trace_weight: float = 4.0  # how often a trace is drawn, against the sources' weights
    # about one in this many traces of each kind (branch count and task) is held out of training, by a hash of each
    # workflow (models.traces.split): the check here, and what braid eval --traces --held-out-traces N (the same
    # N) verifies on (0: none)
    held_out_traces: int = 10

    def __post_init__(self):
        if not self.out:
            self.out = os.path.join(self.model, "calibration")
        for name in ("steps", "tasks_per_step", "lora_rank", "lora_alpha", "eval_every", "held_out_per_cell",
                     "worker_max_tokens", "answer_max_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not (0 < self.lr < 1 and 0 < self.mapper_lr < 1) or self.warmup < 0 or self.kl_weight < 0:
            raise ValueError(f"lr and mapper_lr must be in (0, 1), warmup and kl_weight >= 0; got {self.lr}, "
                             f"{self.mapper_lr}, {self.warmup}, {self.kl_weight}")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model {self.model!r} is not a checkpoint directory (no config.json)")
        if not self.source_weights and not self.trace_files:
            raise ValueError("sources none leaves nothing to train on: give --traces, or some sources")
        bad = [m for m in self.branch_counts if not 2 <= m <= MAX_BRANCHES]
        if bad or not self.branch_counts:
            raise ValueError(f"branches must be counts in 2..{MAX_BRANCHES}, got {self.branches!r}")
        if self.refresh < 0 or self.refresh_tail < -1:
            raise ValueError(f"refresh must be >= 0 (0: none) and refresh_tail >= -1 (-1: as refresh), got "
                             f"{self.refresh} and {self.refresh_tail}")
        if not 1 <= self.max_length <= 12:
            raise ValueError(f"max_length must be in 1..12, got {self.max_length}")
        try:
            self.placement_list  # noqa: B018
        except ValueError:
            raise ValueError(f"placements must name some of {[p.value for p in Placement if p is not Placement.NONE]}"
                             f", got {self.placements!r}") from None
        unknown = [t for t in self.task_names if t not in TASKS]
        if unknown or not self.task_names:
            raise ValueError(f"tasks must name some of {', '.join(TASKS)}, got {self.tasks!r}")
        if self.init_from and not os.path.isfile(os.path.join(self.init_from, MANIFEST)):
            raise ValueError(f"init_from {self.init_from!r} is not a calibration directory (no {MANIFEST})")
        missing = [p for p in self.trace_files if not os.path.isfile(p)]
        if missing or self.trace_weight < 0 or self.held_out_traces < 0:
            raise ValueError(f"traces must name JSONL files (missing: {missing}); trace_weight and held_out_traces "
                             f"must be >= 0, got {self.trace_weight} and {self.held_out_traces}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def trace_files(self) -> list[str]:
        return [p.strip() for p in self.traces.split(",") if p.strip()]

    @property
    def source_weights(self) -> dict[str, float]:
        out = {}
        if self.sources.strip() == "none":
            return out
        for part in self.sources.split(","):
            name, _, weight = part.partition("=")
            try:
                out[name.strip()] = float(weight or 1)
            except ValueError:
                raise ValueError(f"sources entry {part!r} must look like name=weight") from None
        if not out or any(n not in SOURCES for n in out) or any(w < 0 for w in out.values()) or not sum(out.values()):
            raise ValueError(f"sources must weight some of {', '.join(SOURCES)} (name=weight,...), or be none "
                             f"(with --traces), got {self.sources!r}")
        return out

    @property
    def refresh_spec(self) -> Refresh | None:
        """The boundary refresh the synthesizer is trained to read (None: none)."""
        return refresh_of(self.refresh, self.refresh_tail)

    @property
    def branch_counts(self) -> tuple[int, ...]:
        return tuple(int(b) for b in self.branches.split(",") if b.strip())

    @property
    def placement_list(self) -> tuple[Placement, ...]:
        out = tuple(Placement(p.strip()) for p in self.placements.split(",") if p.strip())
        if not out or Placement.NONE in out:
            raise ValueError("no placement")
        return out

    @property
    def task_names(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.tasks.split(",") if t.strip())


# ---- one task's example: what the cache path sees ---------------------------------------------------------------
@dataclass
class Example:
    """One task, ready for the synthesizer's forward. KV tensors are [L, 2, H, T, D], base weights, no grad."""

    prefix_kv: torch.Tensor  # the system prompt, at 0..n-1
    branches: list[torch.Tensor]  # each branch message's KV, re-encoded to its placed offset
    num_branches: int
    prompt: list[int]
    target: list[int]  # the answer the synthesizer is trained on (ends with the end-of-turn token)
    new_offset: int  # where the prompt starts
    teacher: torch.Tensor | None  # [len(target), V] log-probabilities of the text pipeline (distill only)
    source: str
    task: Task | None  # None: a recorded workflow's (source "traces")
    # per branch, with a refresh: (bool [T] of its re-encoded tokens, their KV [L, 2, H, T, D] there); the mapper
    # leaves those tokens alone
    refreshed: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def context(self) -> int:
        return self.prefix_kv.shape[3] + sum(b.shape[3] for b in self.branches)


class Encoder:
    """Tokenizes tasks as the engine does (each message on its own) and runs the base model's no-grad passes."""

    def __init__(self, model, tokenizer, inv_freq: torch.Tensor, cfg: CalibrateConfig, renderer=None):
        """`renderer`: how the synthetic tasks are laid out for this model (synthetic_renderer; None: the reference
        role tokens)."""
        self.model, self.tok, self.inv_freq, self.cfg, self.renderer = model, tokenizer, inv_freq, cfg, renderer
        ids = model.generation_config.eos_token_id if model.generation_config is not None else None
        ids = tokenizer.eos_token_id if ids is None else ids
        self.eos = set(ids) if isinstance(ids, (list, tuple)) else {ids}  # the engine's stop tokens
        self.end = ids[0] if isinstance(ids, (list, tuple)) else ids  # the one that ends a turn (listed first)
        if renderer is not None:  # (in a model's own template: the stop token its turns close with, where it has one)
            marked = renderer.render([{"role": "worker", "content": "Braid"}], [{"role": "user", "content": "y"}])
            self.end = next((t for t in self.ids(marked.rsplit("Braid", 1)[1]) if t in self.eos), self.end)
        self.device = next(model.parameters()).device

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def closed(self, text: str) -> list[int]:
        """A synthetic reply or answer as it ends: with the reference END in the reference layout (the reference
        model's end of turn), else with the model's own end-of-turn token (the stop token its template closes an
        assistant turn with: Llama 3's <|eot_id|>, not the first of its stop tokens, <|end_of_text|>)."""
        return self.ids(text + END) if self.renderer is None else self.ids(text) + [self.end]

    @torch.no_grad()
    def forward(self, rows: list[list[int]], want_logits: bool = False):
        """Plain causal sequences from position 0 (right-padded): (argmax [B, T], KV [L, 2, B, H, T, D], logits)."""
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.tok.pad_token_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
        out = self.model(input_ids=ids.to(self.device), use_cache=True)
        cache = out.past_key_values
        kv = torch.stack([torch.stack([layer.keys, layer.values]) for layer in cache.layers])
        logits = out.logits.float()
        return logits.argmax(-1).cpu(), kv, (logits if want_logits else None)

    @torch.no_grad()
    def greedy(self, context: list[int], candidate: list[int], argmax: list[int], max_tokens: int) -> list[int]:
        """What the engine's greedy decode after `context` writes (stopping at an end token or after
        max_tokens), given a candidate and the argmax of one forward over context + candidate: the candidate
        where the model agrees with it, else decoded on from the first token where it departs."""
        base, i = len(context) - 1, 0
        while i < min(len(candidate), max_tokens) and argmax[base + i] == candidate[i]:
            if candidate[i] in self.eos:
                return candidate[:i + 1]
            i += 1
        if i == max_tokens:
            return candidate[:i]
        head = candidate[:i] + [argmax[base + i]]  # the model's own token where it departs (or goes on)
        if head[-1] in self.eos or len(head) == max_tokens:
            return head
        out = self.model.generate(torch.tensor([context + head], device=self.device),
                                  max_new_tokens=max_tokens - len(head), do_sample=False,
                                  eos_token_id=sorted(self.eos), pad_token_id=self.tok.pad_token_id)
        return head + out[0, len(context) + len(head):].tolist()

    def example(self, task: "Task | TraceWorkflow", source: str, placement: Placement) -> Example:
        if source == "traces":
            return self.trace_example(task, placement)
        cfg = self.cfg
        workers = task.has_workers and source != "parallel"
        # (as served: a worker-shaped task in the model's own layout; the others in the reference role tokens, which
        # only a model served in them is trained on: synthetic_renderer)
        texts = task.workflow_texts(self.renderer) if workers else (turn("system", task.system), [], "", task.prompt())
        system = self.ids(texts[0])
        n = len(system)
        if workers:  # each branch: its context, then the worker's reply, decoded greedily by the model itself
            header = self.ids(texts[2])
            contexts = [self.ids(c) for c in texts[1]]
            replies = [header + self.closed(b.output) for b in task.branches]
            rows = [system + c + r for c, r in zip(contexts, replies)]
            argmax, kv, _ = self.forward(rows)
            fixed = [header + self.greedy(system + c + header, r[len(header):], argmax[i].tolist(),
                                          cfg.worker_max_tokens) for i, (c, r) in enumerate(zip(contexts, replies))]
            if fixed != replies:
                replies, rows = fixed, [system + c + r for c, r in zip(contexts, fixed)]
                _, kv, _ = self.forward(rows)
            starts = [n + len(c) for c in contexts]
        else:  # each branch: its message prefilled right after the prefix (MultiQA's questions; `parallel`)
            replies = [self.ids(b.message()) for b in task.branches]
            _, kv, _ = self.forward([system + r for r in replies])
            starts = [n] * len(replies)
        branches, new_offset, kept, refreshed = self.placed(kv, n, starts, replies, placement)
        prompt = self.ids(texts[3])
        # branches all kept apart at one position show no order: the answer as such a reader writes it (what
        # run 10 of the reference model was trained on), and no text teacher, whose answer follows the order
        apart = all(kept)
        target = self.closed(task.answer_apart() if apart else task.answer)
        teacher = None
        if source == "distill" and not apart:  # the text pipeline: the replies' tokens re-prefilled after the prefix
            context = system + [t for r in replies for t in r] + prompt
            argmax, _, logits = self.forward([context + target], want_logits=True)
            answer = self.greedy(context, target, argmax[0].tolist(), cfg.answer_max_tokens)
            if answer != target:
                target = answer
                _, _, logits = self.forward([context + target], want_logits=True)
            teacher = F.log_softmax(logits[0, len(context) - 1:len(context) - 1 + len(target)], dim=-1)
        return Example(kv[:, :, 0, :, :n], branches, len(branches), prompt, target, new_offset, teacher, source, task,
                       refreshed)

    def placed(self, kv: torch.Tensor, n: int, starts: list[int], replies: list[list[int]], placement: Placement):
        """The branches' KV (rows of `kv` [L, 2, B, H, T, D], each reply at its start) re-encoded to `placement`
        after an n-token prefix, as the cache path places them: (branches, the prompt's offset, which were kept
        apart, what the boundary refresh re-encodes or None)."""
        lengths = [len(r) for r in replies]
        offsets, new_offset = place_branches(n, lengths, placement, starts)
        kept = kept_apart(n, starts, placement)  # (as the engine: MIXED reads these as encoded, unrefreshed)
        branches = []
        for j, (start, length, off) in enumerate(zip(starts, lengths, offsets)):
            block = kv[:, :, j, :, start:start + length]  # [L, 2, H, T, D]
            keys = rerotate_keys_torch(block[:, 0], torch.full((length,), off - start, device=block.device),
                                       self.inv_freq)
            branches.append(torch.stack([keys, block[:, 1]], dim=1))
        refreshed = (self.refresh(kv[:, :, 0, :, :n], branches, replies, offsets, kept)
                     if self.cfg.refresh_spec is not None else None)
        return branches, new_offset, kept, refreshed

    @torch.no_grad()
    def decode(self, context: list[int], max_tokens: int) -> list[int]:
        """The engine's greedy decode after `context`: up to max_tokens, ending with an end token if one comes."""
        out = self.model.generate(torch.tensor([context], device=self.device), max_new_tokens=max_tokens,
                                  do_sample=False, eos_token_id=sorted(self.eos), pad_token_id=self.tok.pad_token_id)
        new = out[0, len(context):].tolist()
        return new[:next((i + 1 for i, t in enumerate(new) if t in self.eos), len(new))]

    def trace_example(self, w: TraceWorkflow, placement: Placement) -> Example:
        """A recorded workflow as the cache path reads it: its task, each worker's reply after its prompt (the
        recorded one where these weights wrote it, else decoded again), placed; the target is the trace's
        reference answer, else the model's own answer from the text pipeline (self-distillation, with its
        logits as the teacher)."""
        cfg = self.cfg
        system, header = self.ids(w.task), self.ids(w.header)
        contexts = [self.ids(p) for p in w.prompts]
        replies = ([header + self.ids(r) for r in w.replies] if w.replies is not None else
                   [header + self.decode(system + c + header, cfg.worker_max_tokens) for c in contexts])
        _, kv, _ = self.forward([system + c + r for c, r in zip(contexts, replies)])
        n = len(system)
        branches, new_offset, _, refreshed = self.placed(kv, n, [n + len(c) for c in contexts], replies, placement)
        prompt = self.ids(w.synthesis)
        context = system + [t for r in replies for t in r] + prompt
        teacher = None
        if w.reference is not None:
            target = self.ids(w.reference) + [self.end]
        else:
            target = self.decode(context, cfg.answer_max_tokens)
            _, _, logits = self.forward([context + target], want_logits=True)
            teacher = F.log_softmax(logits[0, len(context) - 1:len(context) - 1 + len(target)], dim=-1)
        return Example(kv[:, :, 0, :, :n], branches, len(branches), prompt, target, new_offset, teacher, "traces",
                       None, refreshed)

    @torch.no_grad()
    def refresh(self, prefix_kv: torch.Tensor, branches: list[torch.Tensor], replies: list[list[int]],
                offsets: list[int], kept: list[bool]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """What methods.synthesis.refresh_branches computes, in one forward: each branch's boundary runs
        re-encoded at their placed positions, a run starting at token a of branch j seeing the prefix, branches
        0..j-1 and branch j's tokens before a (as shipped), and its own run causally; none of a `kept` branch."""
        spec = self.cfg.refresh_spec
        if all(kept):
            return [(torch.zeros(b.shape[3], dtype=torch.bool, device=b.device), b) for b in branches]
        n = prefix_kv.shape[3]
        ctx = torch.cat([prefix_kv, *branches], dim=3)  # [L, 2, H, C, D]
        owner = torch.cat([torch.full((n,), -1), *(torch.full((b.shape[3],), j) for j, b in enumerate(branches))])
        index = torch.cat([torch.arange(n), *(torch.arange(b.shape[3]) for b in branches)])
        rows = []  # (branch, run start, token index)
        for j, b in enumerate(branches):
            rows += [(j, a, t) for a, e in ([] if kept[j] else spec.runs(b.shape[3])) for t in range(a, e)]
        j_, a_, t_ = (torch.tensor(x) for x in zip(*rows))
        sees_ctx = (owner[None] < j_[:, None]) | ((owner[None] == j_[:, None]) & (index[None] < a_[:, None]))
        same_run = (j_[None] == j_[:, None]) & (a_[None] == a_[:, None]) & (t_[None] <= t_[:, None])
        mask = torch.cat([sees_ctx, same_run], dim=1)[None, None].to(self.device)
        ids = torch.tensor([[replies[j][t] for j, _, t in rows]], device=self.device)
        positions = torch.tensor([[offsets[j] + t for j, _, t in rows]], device=self.device)
        capture = CaptureCache(list(ctx[:, 0, None]), list(ctx[:, 1, None]))
        self.model.model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=capture,
                         use_cache=True)
        new = torch.stack([torch.stack([k[0], v[0]]) for k, v in capture.new])  # [L, 2, H, R, D]
        out = []
        for j, b in enumerate(branches):
            mine = (j_ == j).nonzero().flatten()
            where = torch.zeros(b.shape[3], dtype=torch.bool)
            where[t_[mine]] = True
            fixed = b.clone()
            fixed[:, :, :, t_[mine]] = new[:, :, :, mine.to(new.device)]
            out.append((where.to(b.device), fixed))
        return out


# ---- the synthesizer's forward, with gradients into the mapper and the LoRA -------------------------------------
class ContextCache:
    """A past for transformers' attention: fixed context KV per layer, the new tokens' KV concatenated on."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values  # per layer [B, H, C, D]

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        return (torch.cat([self.keys[layer_idx], key_states], dim=2),
                torch.cat([self.values[layer_idx], value_states], dim=2))


class CaptureCache(ContextCache):
    """A ContextCache that keeps each layer's new KV (the refreshed tokens'), for `Encoder.refresh`."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        super().__init__(keys, values)
        self.new: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        self.new.append((key_states, value_states))
        return super().update(key_states, value_states, layer_idx, cache_kwargs)


@dataclass
class StepOutput:
    loss: torch.Tensor
    ce: float
    kl: float
    task_correct: list[bool]  # every target token is the argmax


def synthesizer_logits(model, mapper: CacheMapper | None, examples: list[Example]) -> torch.Tensor:
    """`model` (its LoRA on, where it has one) over [prefix | mapped branches | prompt + target], batched with
    padding: fp32 logits [B, T, V] of each example's prompt + target tokens. `mapper` None: branches unmapped."""
    device = next(model.parameters()).device
    width_c = max(e.context for e in examples)
    width_t = max(len(e.prompt) + len(e.target) for e in examples)
    B = len(examples)
    keys, values, valid = [], [], torch.zeros(B, width_c, dtype=torch.bool)
    ids = torch.full((B, width_t), 0, dtype=torch.long)
    positions = torch.zeros(B, width_t, dtype=torch.long)
    for i, e in enumerate(examples):
        blocks = [e.prefix_kv]
        for j, b in enumerate(e.branches):
            if mapper is not None:
                f = mapper.features(torch.tensor([b.shape[3]]), torch.tensor([e.num_branches]))
                b = mapper.apply(b[None], f.to(device), torch.tensor([j]))[0]
            if e.refreshed is not None:  # re-encoded tokens are read as they are, never mapped
                where, fixed = e.refreshed[j]
                b = torch.where(where[None, None, None, :, None], fixed, b)
            blocks.append(b)
        ctx = torch.cat(blocks, dim=3)  # [L, 2, H, C_i, D]
        ctx = F.pad(ctx, (0, 0, 0, width_c - ctx.shape[3]))
        keys.append(ctx[:, 0])
        values.append(ctx[:, 1])
        valid[i, :e.context] = True
        seq = e.prompt + e.target
        ids[i, :len(seq)] = torch.tensor(seq)
        positions[i] = e.new_offset + torch.arange(width_t)
    k = torch.stack(keys, dim=1)  # [L, B, H, C, D]
    v = torch.stack(values, dim=1)
    causal = torch.ones(width_t, width_t, dtype=torch.bool).tril()
    mask = torch.cat([valid[:, None, :].expand(B, width_t, width_c), causal.expand(B, -1, -1)], dim=2)[:, None]
    out = model.model(input_ids=ids.to(device), position_ids=positions.to(device), attention_mask=mask.to(device),
                      past_key_values=ContextCache(list(k), list(v)), use_cache=True)
    return model.lm_head(out.last_hidden_state).float()


def synthesizer_loss(model, mapper: CacheMapper | None, examples: list[Example], kl_weight: float) -> StepOutput:
    """Per example, the mean cross-entropy over its target tokens plus kl_weight * the mean KL(text pipeline ||
    this) over them (for examples that carry the text pipeline's log-probabilities); averaged over examples, so
    a long answer (MultiQA at 12 branches) weighs as much as a short one."""
    logits = synthesizer_logits(model, mapper, examples)
    device = logits.device
    ce, kl, correct = [], [], []
    for i, e in enumerate(examples):
        rows = logits[i, len(e.prompt) - 1:len(e.prompt) - 1 + len(e.target)]
        target = torch.tensor(e.target, device=device)
        ce.append(F.cross_entropy(rows, target))
        correct.append(bool((rows.argmax(-1) == target).all()))
        if e.teacher is not None and kl_weight:
            kl.append(F.kl_div(F.log_softmax(rows, -1), e.teacher.to(device), log_target=True, reduction="sum")
                      / len(e.target))
    ce_mean = torch.stack(ce).mean()
    kl_sum = torch.stack(kl).sum() if kl else torch.zeros((), device=device)
    # the loss spreads the KL over every example; the report is its mean over those that carry a teacher
    return StepOutput(ce_mean + kl_weight * kl_sum / len(examples), ce_mean.item(),
                      (kl_sum / max(1, len(kl))).item(), correct)


# ---- the run -----------------------------------------------------------------------------------------------------
def synthetic_renderer(cfg: CalibrateConfig, tokenizer):
    """How this run lays the synthetic tasks out (models.chat.task_renderer: None, the reference role tokens), or a
    ValueError where it cannot lay out what it is asked to draw as the model is served: a template that cannot render
    a workflow, or (in a model's own template) tasks without workers or the `parallel` source, whose layouts exist
    only in the reference role tokens."""
    if not cfg.source_weights:
        return None
    try:
        renderer = task_renderer(tokenizer, cfg.model)
    except TemplateError as e:
        raise ValueError(f"--sources {cfg.sources}: the synthetic tasks cannot be laid out as {cfg.model} is served "
                         f"({e}); calibrate from your own workflows with --sources none --traces FILE") from None
    reference_only = [t for t in cfg.task_names if t in WITHOUT_WORKERS] + \
        (["the parallel source"] if cfg.source_weights.get("parallel") else [])
    if renderer is not None and reference_only:
        raise ValueError(f"{', '.join(reference_only)}: laid out only in the reference model's role tokens, which "
                         f"{cfg.model}'s chat template does not use; draw worker tasks "
                         f"({', '.join(t for t in TASKS if t not in WITHOUT_WORKERS)}) from the synthesis and distill "
                         "sources, or calibrate from your own workflows (--sources none --traces FILE)")
    return renderer


def draw(cfg: CalibrateConfig, rng: random.Random, traces: list[TraceWorkflow] = ()
         ) -> tuple["Task | TraceWorkflow", str, Placement]:
    """One training item: a synthetic task of a source drawn by weight, or (with `traces`) a recorded workflow."""
    names, weights = zip(*cfg.source_weights.items()) if cfg.source_weights else ((), ())
    if traces:
        names, weights = (*names, "traces"), (*weights, cfg.trace_weight)
    source = rng.choices(names, weights)[0]
    if source == "traces":
        return rng.choice(traces), source, rng.choice(cfg.placement_list)
    lo = rng.randint(1, cfg.max_length)
    task = generate(rng.choice(cfg.task_names), rng.randrange(CALIBRATION_SEEDS, CALIBRATION_SEEDS + (1 << 40)),
                    rng.choice(cfg.branch_counts), (lo, rng.randint(lo, cfg.max_length)))
    return task, source, rng.choice(cfg.placement_list)


def held_out_set(cfg: CalibrateConfig) -> list[tuple[Task, str, Placement]]:
    """Fixed held-out tasks (their own seed range, default lengths) at the first trained placement; none where no
    synthetic source is drawn (sources none)."""
    if not cfg.source_weights:
        return []
    return [(t, "synthesis", cfg.placement_list[0]) for name in cfg.task_names for m in HELD_OUT_BRANCHES
            for t in [generate(name, 1_000_000 + i, m) for i in range(cfg.held_out_per_cell)]]


def lr_factor(cfg: CalibrateConfig, step: int) -> float:
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def teacher_forced(peft_model, mapper, batches: Iterable[list[Example]], key: Callable[[Example], str]
                   ) -> dict[str, float]:
    """The share of examples whose every target token is the argmax (the LoRA on, in eval mode), per `key`;
    `batches` may be built lazily (with the adapter off: see held_out_accuracy)."""
    peft_model.eval()
    right: dict[str, list[bool]] = {}
    for examples in batches:
        for e, ok in zip(examples, synthesizer_loss(peft_model.get_base_model(), mapper, examples, 0.0).task_correct):
            right.setdefault(key(e), []).append(ok)
    peft_model.train()
    return {name: sum(v) / len(v) for name, v in right.items()}


def held_out_accuracy(peft_model, mapper, encoder: Encoder, held, batch: int = 16) -> dict[str, float]:
    """Teacher-forced: the share of held-out answers whose every token is the argmax, per task."""
    def batches():
        for i in range(0, len(held), batch):
            with peft_model.disable_adapter():  # (the branches' encodings: base weights)
                examples = [encoder.example(*h) for h in held[i:i + batch]]
            yield examples  # (outside the with: the synthesizer's forward runs with the LoRA on)

    return teacher_forced(peft_model, mapper, batches(), lambda e: e.task.name if e.task is not None else "traces")


def held_out_postfix(evals: list[dict], next_check: int = 0) -> str:
    """The progress bar's postfix: the last held-out check (held_out_accuracy: the share of held-out answers whose
    every token is the argmax, teacher-forced; on traces without a reference, agreement with text's answer), per
    task and for the traces, with its step. (The training loss, which the record keeps, tells little on a bar.)"""
    if not evals:
        return f"held-out check at step {next_check}" if next_check else "held-out check: none yet"
    last = evals[-1]
    return "held-out right " + " ".join(f"{k} {v:.1%}" for k, v in last.items() if k != "step") + \
        f" (step {last['step']})"


def untrained(model, lora: LoraSettings, mapper_rank: int = 0, conditioned: bool = True, branch_slots: int = 0):
    """A calibration's trainable parts at their init (the identity) for `model`: (PeftModel, CacheMapper).
    The LoRA is injected into `model` itself; its own weights should be frozen."""
    from peft import get_peft_model

    peft_model = get_peft_model(model, lora.peft_config())
    c = model.config
    mapper = CacheMapper(MapperConfig(c.num_hidden_layers, c.num_key_value_heads,
                                      model.model.layers[0].self_attn.head_dim, mapper_rank, conditioned,
                                      branch_slots))
    return peft_model, mapper.to(next(model.parameters()).device)


def write_untrained(model_path: str, out: str, lora: LoraSettings = LoraSettings(), mapper_rank: int = 0,
                    branch_slots: int = 16, scale: float = 0.0, fingerprint: str | None = None,
                    name: str = "untrained") -> str:
    """Write a calibration for `model_path` that was never trained: at its init (scale 0: the identity), or
    with every mapper and LoRA weight drawn from N(0, scale^2) (seeded). For tests, and for measuring what
    a calibration costs at serving time, which does not depend on its values."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    peft_model, mapper = untrained(model, lora, mapper_rank, True, branch_slots)
    if scale:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in [*mapper.parameters(), *(p for n, p in peft_model.named_parameters() if "lora_" in n)]:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    Calibration(mapper, lora, fingerprint or fingerprint_checkpoint(model_path), name).save(out, peft_model)
    return out


def calibrate(cfg: CalibrateConfig) -> dict:
    from peft import set_peft_model_state_dict

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, cfg.dtype),
                                                 attn_implementation=attention.NAME)
    model = model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    renderer = synthetic_renderer(cfg, tokenizer)
    for p in model.parameters():
        p.requires_grad_(False)
    lora = LoraSettings.of(cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    peft_model, mapper = untrained(model, lora, cfg.mapper_rank, cfg.mapper_conditioned, cfg.mapper_branch_slots)
    inv_freq = model.model.rotary_emb.inv_freq.float().cpu()
    encoder = Encoder(model, tokenizer, inv_freq.to(device), cfg, renderer)
    lora_params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": lora_params, "lr": cfg.lr, "weight_decay": 0.0},
                             {"params": list(mapper.parameters()), "lr": cfg.mapper_lr, "weight_decay": 0.0}])
    base_lrs = [cfg.lr, cfg.mapper_lr]
    fingerprint = fingerprint_checkpoint(cfg.model)
    record = {"config": dataclasses.asdict(cfg), "loss": [], "ce": [], "kl": [], "held_out_accuracy": [],
              "train_seconds": 0.0, "steps": 0, "torch": torch.__version__, "device": str(device),
              "trainable_parameters": {"lora": sum(p.numel() for p in lora_params),
                                       "mapper": sum(p.numel() for p in mapper.parameters())}}
    resume = os.path.join(cfg.out, RESUME)
    resuming = cfg.resume and os.path.isfile(resume)
    state = torch.load(resume, map_location=device, weights_only=False) if resuming else None
    if state is not None and state["record"].get("init_from", {}).get("path", "") != cfg.init_from:
        raise ValueError(f"{cfg.out} holds a run to resume ({RESUME}) that did not start from --init-from "
                         f"{cfg.init_from or '(none)'}; pass --resume false to start over, or another --out")
    if state is not None and state.get("lora") is not None and state["record"]["config"].get("lora_rank") not in (
            None, cfg.lora_rank):
        raise ValueError(f"{resume} was trained with LoRA rank {state['record']['config']['lora_rank']}, "
                         f"not {cfg.lora_rank}; pass the same settings, or --resume false")
    if state is not None:
        was = (state["record"]["config"].get("refresh", 0), state["record"]["config"].get("refresh_tail", -1))
        if was != (cfg.refresh, cfg.refresh_tail):
            raise ValueError(f"{resume} was trained with refresh {was[0]} and refresh_tail {was[1]}, not "
                             f"{cfg.refresh} and {cfg.refresh_tail}; pass the same settings, or --resume false")
    if cfg.init_from and not resuming:
        start = Calibration.load(cfg.init_from)
        if start.fingerprint != fingerprint:
            raise ValueError(f"init_from {cfg.init_from} calibrates another model ({start.fingerprint}); "
                             f"{cfg.model} is {fingerprint}")
        if start.lora != lora:
            raise ValueError(f"init_from {cfg.init_from} has a LoRA of {start.lora}; this run asks for {lora}")
        missing, unexpected = mapper.load_state_dict(start.mapper.state_dict(), strict=False)
        if unexpected:
            raise ValueError(f"init_from {cfg.init_from}: its mapper has parts this one lacks: {unexpected}")
        set_peft_model_state_dict(peft_model, load_file(os.path.join(cfg.init_from, ADAPTER_DIR,
                                                                     "adapter_model.safetensors")))
        record["init_from"] = {"path": cfg.init_from, "record": start.record}
        log.info("starting from %s (mapper parts at init: %s)", cfg.init_from, ", ".join(missing) or "none")
    if state is not None:
        if state["fingerprint"] != fingerprint:
            raise ValueError(f"{resume} continues a calibration of another model ({state['fingerprint']}); "
                             f"{cfg.model} is {fingerprint}")
        set_peft_model_state_dict(peft_model, state["lora"])
        try:
            mapper.load_state_dict(state["mapper"])
        except RuntimeError as e:
            raise ValueError(f"{resume} holds a mapper of another shape ({e}); pass the same mapper settings, "
                             "or --resume false") from None
        opt.load_state_dict(state["optimizer"])
        record = state["record"]
        log.info("resuming %s at step %d", cfg.out, record["steps"])
    held = held_out_set(cfg)
    traces: list[TraceWorkflow] = []
    if cfg.trace_files:  # (a line this model cannot render is refused here, naming its file and line)
        every = load_trace_workflows(cfg.trace_files, tokenizer, fingerprint, WORKER_HEADER, cfg.model)
        traces, held_traces = split(every, cfg.held_out_traces)
        held += [(w, "traces", cfg.placement_list[0]) for w in held_traces]
        record["traces"] = {"files": cfg.trace_files, "workflows": len(every), "held_out": len(held_traces),
                            "replies_decoded_again": sum(w.replies is None for w in every)}
        log.info("%d traces (%d held out); %d recorded by other weights, their replies decoded again", len(every),
                 len(held_traces), record["traces"]["replies_decoded_again"])
        if not traces:
            raise ValueError(f"every trace in {cfg.traces} is held out (held_out_traces={cfg.held_out_traces}): "
                             "give more traces, or a larger held_out_traces")
    calibration = Calibration(mapper, lora, fingerprint, os.path.basename(os.path.normpath(cfg.model)))

    def save() -> None:
        calibration.record = {k: v for k, v in record.items()}
        calibration.save(cfg.out, peft_model)
        from peft import get_peft_model_state_dict

        torch.save({"fingerprint": fingerprint, "lora": get_peft_model_state_dict(peft_model),
                    "mapper": mapper.state_dict(), "optimizer": opt.state_dict(), "record": record}, resume)
        plot(record, os.path.join(cfg.out, "loss.png"))

    first = record["steps"]
    peft_model.train()
    bar = tqdm(range(first, cfg.steps), initial=first, total=cfg.steps, desc="calibrating", unit="step")
    next_check = min(cfg.steps, (first // cfg.eval_every + 1) * cfg.eval_every)
    bar.set_postfix_str(held_out_postfix(record["held_out_accuracy"], next_check), refresh=False)
    for step in bar:
        began = time.perf_counter()
        rng = random.Random(f"calibrate:{cfg.seed}:{step}")
        with peft_model.disable_adapter():  # workers and branch encodings: the base weights
            examples = [encoder.example(*draw(cfg, rng, traces)) for _ in range(cfg.tasks_per_step)]
        for group, base in zip(opt.param_groups, base_lrs):
            group["lr"] = base * lr_factor(cfg, step)
        out = synthesizer_loss(model, mapper, examples, cfg.kl_weight)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_([*lora_params, *mapper.parameters()], 1.0)
        opt.step()
        record["loss"].append(round(out.loss.item(), 5))
        record["ce"].append(round(out.ce, 5))
        record["kl"].append(round(out.kl, 5))
        record["steps"] = step + 1
        record["train_seconds"] = round(record["train_seconds"] + time.perf_counter() - began, 2)
        record.setdefault("step_seconds", []).append(round(time.perf_counter() - began, 4))
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            acc = held_out_accuracy(peft_model, mapper, encoder, held)
            record["held_out_accuracy"].append({"step": step + 1, **acc})
            bar.set_postfix_str(held_out_postfix(record["held_out_accuracy"]))
            log.info("step %d loss %.4f held-out answers (teacher-forced) %s", step + 1, out.loss.item(),
                     " ".join(f"{k}={v:.2f}" for k, v in acc.items()))
            save()
    if first >= cfg.steps:
        log.info("%s already holds %d steps; nothing to do", cfg.out, first)
    return record


def lineage(record: dict) -> list[dict]:
    """The runs that led to this calibration, first to last (each `--init-from` keeps its start's record)."""
    runs = [record]
    while "init_from" in runs[0]:
        runs.insert(0, runs[0]["init_from"]["record"])
    return runs


def plot(record: dict, path: str, title: str = "calibration loss (LoRA synthesizer over mapped branch KV)",
         held_title: str = f"held-out tasks at {', '.join(map(str, HELD_OUT_BRANCHES))} branches") -> None:
    """The loss curve and the held-out accuracy of a training record (this trainer's, or braid.train.turns')."""
    from braid.results import pyplot

    plt = pyplot()
    if plt is None:
        return
    runs = lineage(record)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    series = {key: [x for run in runs for x in run[key]] for key in ("loss", "ce", "kl") if key in record}
    n = len(series["loss"])
    window = max(1, n // 50)
    for key, values in series.items():
        smooth = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
                  for i in range(n)]
        a.plot(range(1, n + 1), smooth, label=f"{key} (mean of {window})")
    starts, evals, at = [], [], 0
    for run in runs:  # each run counts its steps from 0
        starts.append(at)
        evals += [{**e, "step": e["step"] + at} for e in run["held_out_accuracy"]]
        at += len(run["loss"])
    for start in starts[1:]:
        a.axvline(start, color="grey", ls=":")
    a.set(yscale="log", xlabel="step", title=title)
    a.legend()
    for name in dict.fromkeys(k for e in evals for k in e if k != "step"):
        b.plot([e["step"] for e in evals if name in e], [e[name] for e in evals if name in e], marker="o", label=name)
    b.set(xlabel="step", ylabel="answers right (teacher-forced)", ylim=(0, 1.02), title=held_title)
    b.legend()
    mapper = record["trainable_parameters"].get("mapper")
    fig.suptitle(f"{record['trainable_parameters']['lora'] / 1e3:.0f}k LoRA"
                 + (f" + {mapper / 1e3:.1f}k mapper" if mapper is not None else "") + " parameters, "
                 f"{sum(r['train_seconds'] for r in runs) / 60:.0f} min on {record['device']}"
                 + (f", {len(runs)} runs" if len(runs) > 1 else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)  # (a run plots at every evaluation: pyplot keeps figures until closed)


def main(argv=None, prog: str = "python -m braid.train.calibrate") -> int:
    return run_cli(CalibrateConfig, calibrate, argv, prog, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
