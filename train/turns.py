"""Fine-tune the debaters (Prompt Choreography's fine-tuning): a turn LoRA: `braid calibrate-turns`.

    braid calibrate-turns --model models/braid-reference     # writes models/braid-reference/calibration/turns

A turn is an agent's call that reads other agents' replies through their cached encodings before its own notes
(a debater's later rounds: methods.dag). The reference model was trained to answer from its notes alone; after
other replies it drifts, repeating one of them. The turn LoRA is trained on the contexts the engine really
builds for such turns, with the base weights frozen:

  - a step draws `tasks_per_step` tasks (families from `--tasks`, solver counts from `--solvers`, branch work of
    length 1..`--max-length`) and a workflow for each (`--workflows`: MADiter, MADpar, as
    methods.dag.presets.notes_graph builds them), and runs each graph choreographed (cached replies, base weights)
    on a braid Engine;
  - for every turn in it, the KV its decode call attended to (Engine.context_kv: its parents, each placed where
    the call read it) is the context, the worker header the prompt, and the turn's own lookup (what it says
    from its notes alone) the target. Earlier replies are the base model's, right or wrong: the target stays
    the turn's own.

It lives in the calibration directory (`turns/`: peft's adapter format and `turns.json`, its manifest with the
base model's fingerprint and the training record), so it is bound to the same model. A calibrated graph runs
its turns with it (methods.dag); their outputs are encoded again with base weights, so any reader may take them.
Solver counts not in `--solvers` and lengths above `--max-length` are never trained on; task seeds lie in their
own range, disjoint from every evaluation's. At every evaluation (teacher-forced held-out turns) the run writes
the adapter, its manifest, `loss.png` and a resume state.
"""

import dataclasses
import json
import logging
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from braid.engine import Engine, EngineConfig, attention
from braid.engine.config import CALIBRATION_MANIFEST
from braid.engine.model import fingerprint_checkpoint
from braid.methods.calibration import TURNS_DIR, TURNS_MANIFEST, LoraSettings
from braid.methods.dag import DagRun
from braid.methods.dag.presets import NOTES_WORKFLOWS, notes_graph, notes_turns, solver
from braid.models.chat import END, WORKER_HEADER
from braid.models.tasks import MAX_BRANCHES, Task, generate
from braid.train.calibrate import Example, lr_factor, plot, synthesizer_loss, teacher_forced
from braid.train.train import run_cli

log = logging.getLogger("braid.calibrate_turns")
TURN_SEEDS = 3 << 40  # [3 * 2^40, 4 * 2^40): disjoint from evaluation's, the calibration's and the base model's
HELD_OUT_SOLVERS = (4, 5)  # the teacher-forced held-out set during training (5 is held out by default)
HELD_OUT_SEEDS = 2_000_000
RESUME = "resume.pt"
RUN_SETTINGS = ("calibration", "steps", "eval_every", "threads", "resume")  # what a resumed run may change
FAMILIES = ("chain", "vote", "trail")  # the task families whose branches are worker turns (MultiQA has none)


@dataclass
class TurnsConfig:
    model: str = "models/braid-reference"  # the frozen base model
    calibration: str = ""  # the calibration it belongs to (default: <model>/calibration)
    seed: int = 0  # every step's tasks depend on it and the step alone
    steps: int = 400  # optimizer steps (the schedule's length)
    tasks_per_step: int = 16  # graphs drawn per step; each gives one example per turn
    lr: float = 2e-3  # peak learning rate (AdamW; linear warmup, then cosine)
    warmup: int = 20  # warmup steps
    lora_rank: int = 16  # the turn LoRA's rank
    lora_alpha: int = 32  # its scale numerator (peft's lora_alpha)
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj"  # the projections it adapts
    workflows: str = "mad-iter,mad-par"  # the debate shapes drawn (methods.dag.presets.notes_graph), uniformly
    tasks: str = ",".join(FAMILIES)  # the task families drawn, uniformly
    solvers: str = "2,3,4,6,7"  # solver counts trained on (5 and 8 held out by default)
    max_length: int = 8  # branch work lengths 1..max_length are trained on (above: held out)
    eval_every: int = 50  # steps between held-out evaluations (each saves the adapter and resume.pt)
    held_out_per_cell: int = 8  # held-out graphs per (workflow, family, solver count) in the training-time check
    threads: int = 0  # torch threads (0: torch's default)
    resume: bool = True  # continue from <calibration>/turns/resume.pt when it is there

    def __post_init__(self):
        if not self.calibration:
            self.calibration = os.path.join(self.model, "calibration")
        for name in ("steps", "tasks_per_step", "lora_rank", "lora_alpha", "eval_every", "held_out_per_cell"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.lr < 1 or self.warmup < 0:
            raise ValueError(f"lr must be in (0, 1) and warmup >= 0, got {self.lr} and {self.warmup}")
        if not os.path.isfile(os.path.join(self.calibration, CALIBRATION_MANIFEST)):
            raise ValueError(f"calibration {self.calibration!r} is not a directory written by `braid calibrate` "
                             f"(no {CALIBRATION_MANIFEST}): train the calibration first")
        bad = [w for w in self.workflow_names if w not in NOTES_WORKFLOWS or w == "tot"]
        if bad or not self.workflow_names:
            raise ValueError(f"workflows must be debates with turns (mad-iter, mad-par), got {self.workflows!r}")
        bad = [t for t in self.task_names if t not in FAMILIES]
        if bad or not self.task_names:
            raise ValueError(f"tasks must be of {', '.join(FAMILIES)} (their branches are worker turns), got "
                             f"{self.tasks!r}")
        bad = [m for m in self.solver_counts if not 2 <= m <= MAX_BRANCHES]
        if bad or not self.solver_counts:
            raise ValueError(f"solvers must be counts in 2..{MAX_BRANCHES}, got {self.solvers!r}")
        if not 1 <= self.max_length <= 12:
            raise ValueError(f"max_length must be in 1..12, got {self.max_length}")

    @property
    def out(self) -> str:
        return os.path.join(self.calibration, TURNS_DIR)

    @property
    def workflow_names(self) -> tuple[str, ...]:
        return tuple(w.strip() for w in self.workflows.split(",") if w.strip())

    @property
    def task_names(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.tasks.split(",") if t.strip())

    @property
    def solver_counts(self) -> tuple[int, ...]:
        return tuple(int(m) for m in self.solvers.split(",") if m.strip())

    @property
    def lora(self) -> LoraSettings:
        return LoraSettings.of(self.lora_rank, self.lora_alpha, self.lora_targets)


class TurnData:
    """Turn examples from graphs run on a braid Engine (base weights, choreographed, no prefix cache)."""

    def __init__(self, model: str, workers: int = 16):
        # (one thread for its forwards: the training beside it has the cores; engine.threads)
        self.engine = Engine(EngineConfig(model, calibration="none", prefix_caching=False, dtype="float32",
                                          device="cpu", cpu_threads=1))
        self.header = self.engine.tokenize(WORKER_HEADER)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="turn-data")  # (their calls batch together)

    def examples(self, drawn: list[tuple[Task, str]]) -> list[Example]:
        return [e for got in self.pool.map(lambda d: self._graph(*d), drawn) for e in got]

    def _graph(self, task: Task, workflow: str) -> list[Example]:
        """The task as `workflow`, choreographed: an example per turn (a solver that reads others' replies)."""
        graph = notes_graph(workflow, *task.workflow_texts())
        run = DagRun(self.engine, graph)
        try:
            for _ in run:
                pass
            out = []
            for n in notes_turns(graph):
                mid = run.outputs[n.name]
                out.append(Example(self.engine.context_kv(mid), [], 0, self.header,
                                   self.engine.tokenize(task.branches[solver(n)].output + END),
                                   self.engine.message(mid).offset, None, workflow, task))
            return out
        finally:
            run.free(keep=())


def draw(cfg: TurnsConfig, rng: random.Random) -> tuple[Task, str]:
    lo = rng.randint(1, cfg.max_length)
    task = generate(rng.choice(cfg.task_names), rng.randrange(TURN_SEEDS, TURN_SEEDS + (1 << 40)),
                    rng.choice(cfg.solver_counts), (lo, rng.randint(lo, cfg.max_length)))
    return task, rng.choice(cfg.workflow_names)


def held_out_set(cfg: TurnsConfig) -> list[tuple[Task, str]]:
    """Fixed held-out graphs (their own seed range, default lengths)."""
    return [(generate(name, HELD_OUT_SEEDS + i, m), w) for w in cfg.workflow_names for name in cfg.task_names
            for m in HELD_OUT_SOLVERS for i in range(cfg.held_out_per_cell)]


def held_out_accuracy(peft_model, examples: list[Example], batch: int = 64) -> dict[str, float]:
    """Teacher-forced: the share of held-out turns whose every target token is the argmax, per workflow and
    solver count."""
    got = teacher_forced(peft_model, None, (examples[i:i + batch] for i in range(0, len(examples), batch)),
                         lambda e: f"{e.source} m={len(e.task.branches)}")
    return dict(sorted(got.items()))


def save_turns(out: str, peft_model, fingerprint: str, base_model: str, lora: LoraSettings, record: dict) -> None:
    """The adapter (peft's format) and its manifest."""
    os.makedirs(out, exist_ok=True)
    peft_model.save_pretrained(out)
    manifest = {"base_fingerprint": fingerprint, "base_model": base_model,
                "lora": {**dataclasses.asdict(lora), "targets": list(lora.targets)}, "record": record}
    tmp = os.path.join(out, TURNS_MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(out, TURNS_MANIFEST))


def write_untrained_turns(model_path: str, calibration: str, lora: LoraSettings = LoraSettings(), scale: float = 0.0,
                          fingerprint: str | None = None) -> str:
    """Write a turn LoRA for `model_path` into `calibration` that was never trained: at its init (scale 0: the
    identity), or with every LoRA weight drawn from N(0, scale^2) (seeded). For tests, and for measuring what a
    turn LoRA costs at serving time, which does not depend on its values."""
    from peft import get_peft_model

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
                                lora.peft_config())
    if scale:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.copy_(scale * torch.randn(p.shape, generator=gen))
    out = os.path.join(calibration, TURNS_DIR)
    save_turns(out, peft_model, fingerprint or fingerprint_checkpoint(model_path), "untrained", lora, {})
    return out


def calibrate_turns(cfg: TurnsConfig) -> dict:
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    with open(os.path.join(cfg.calibration, CALIBRATION_MANIFEST)) as f:
        calibration_fingerprint = json.load(f)["base_fingerprint"]
    fingerprint = fingerprint_checkpoint(cfg.model)
    if calibration_fingerprint != fingerprint:
        raise ValueError(f"calibration {cfg.calibration} is for another model ({calibration_fingerprint}); "
                         f"{cfg.model} is {fingerprint}")
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32, attn_implementation=attention.NAME)
    for p in model.parameters():
        p.requires_grad_(False)
    peft_model = get_peft_model(model, cfg.lora.peft_config())
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    record = {"config": dataclasses.asdict(cfg), "loss": [], "held_out_accuracy": [], "train_seconds": 0.0,
              "data_seconds": 0.0, "steps": 0, "examples": 0, "torch": torch.__version__, "device": "cpu",
              "trainable_parameters": {"lora": sum(p.numel() for p in params)}}
    resume = os.path.join(cfg.out, RESUME)
    state = torch.load(resume, weights_only=False) if cfg.resume and os.path.isfile(resume) else None
    if state is not None:
        if state["fingerprint"] != fingerprint:
            raise ValueError(f"{resume} continues a turn LoRA of another model ({state['fingerprint']}); "
                             f"{cfg.model} is {fingerprint}")
        was = state["record"]["config"]
        changed = [k for k, v in dataclasses.asdict(cfg).items() if k not in RUN_SETTINGS and was.get(k) != v]
        if changed:
            settings = ", ".join(f"{k}={was.get(k)!r}" for k in changed)
            raise ValueError(f"{resume} was trained with other settings ({settings}); pass the same ones, or "
                             "--resume false")
        set_peft_model_state_dict(peft_model, state["lora"])
        opt.load_state_dict(state["optimizer"])
        record = state["record"]
        log.info("resuming %s at step %d", cfg.out, record["steps"])
    data = TurnData(cfg.model)
    held = data.examples(held_out_set(cfg))
    base_name = os.path.basename(os.path.normpath(cfg.model))

    def evaluate(step: int) -> None:
        acc = held_out_accuracy(peft_model, held)
        record["held_out_accuracy"].append({"step": step, **acc})
        log.info("step %d held-out turns (teacher-forced) %s", step, " ".join(f"{k}={v:.2f}" for k, v in acc.items()))

    def save() -> None:
        save_turns(cfg.out, peft_model, fingerprint, base_name, cfg.lora, record)
        torch.save({"fingerprint": fingerprint, "lora": get_peft_model_state_dict(peft_model),
                    "optimizer": opt.state_dict(), "record": record}, resume)
        plot(record, os.path.join(cfg.out, "loss.png"), title="turn LoRA loss (debaters after cached replies)",
             held_title=f"held-out turns at {', '.join(map(str, HELD_OUT_SOLVERS))} solvers")

    first = record["steps"]
    if first == 0:
        evaluate(0)  # (the base weights: where the turns start)
    peft_model.train()
    bar = tqdm(range(first, cfg.steps), initial=first, total=cfg.steps, desc="turn LoRA", unit="step")
    for step in bar:
        began = time.perf_counter()
        rng = random.Random(f"turns:{cfg.seed}:{step}")
        examples = data.examples([draw(cfg, rng) for _ in range(cfg.tasks_per_step)])
        trained = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(cfg, step)
        out = synthesizer_loss(model, None, examples, 0.0)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        record["loss"].append(round(out.loss.item(), 5))
        record["steps"] = step + 1
        record["examples"] += len(examples)
        record["data_seconds"] = round(record["data_seconds"] + trained - began, 2)
        record["train_seconds"] = round(record["train_seconds"] + time.perf_counter() - began, 2)
        bar.set_postfix(loss=f"{out.loss.item():.4f}", turns=len(examples))
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            evaluate(step + 1)
            save()
    if first >= cfg.steps:
        log.info("%s already holds %d steps; nothing to do", cfg.out, first)
    return record


def main(argv=None, prog: str = "python -m braid.train.turns") -> int:
    return run_cli(TurnsConfig, calibrate_turns, argv, prog, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
