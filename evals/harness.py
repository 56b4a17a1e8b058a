"""Quality evaluation: every task through the engine in every synthesis mode, side by side.

For each task the workers run once, in parallel, on the shared system prompt and
their own contexts (MultiQA's branches are its questions, prefilled instead). The
same branch messages then go to each mode: text re-prefill, or the cached KV with
no re-encoding or re-encoded per placement, optionally through SynthesisHooks (a
trained calibration's cache mapper and LoRA adapter, and its ablations). The staircase
modes run the workers again and answer while they decode (Staircase Streaming). Answers are
scored by exact match; results are paired across modes.
"""

import contextlib
import importlib
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from tqdm import tqdm

from braid.engine import Engine, PrefillCall, SamplingParams
from braid.engine.engine import TokenEvent
from braid.evals.stats import accuracy_ci, mcnemar_p, paired_difference_ci, paired_lower_bound, samples_needed
from braid.methods.calibration import Attached, mode_name
from braid.methods.fanout import fan_out
from braid.methods.staircase import BranchFeed, StaircaseResult, StaircaseSchedule, Variant, staircase
from braid.methods.synthesis import TEXT as TEXT_MODE
from braid.methods.synthesis import Placement, Refresh, SynthesisHooks, SynthesisMode, synthesis_stream
from braid.models.chat import END, ChatRenderer, TemplateError, task_renderer, turn
from braid.models.tasks import DEFAULT_LENGTH, MAX_BRANCHES, TASKS, WITHOUT_WORKERS, Task, sample
from braid.models.traces import SPLIT_RULE, TraceWorkflow


@dataclass(frozen=True)
class Mode:
    """A named synthesis mode, as the tables show it. With a staircase variant, the answer starts from the
    workers' first chunks (Staircase Streaming) and reads the branches as `synthesis` says; where a task has no workers
    (its branches are given whole), there is nothing to stream and it is plain synthesis."""

    name: str
    synthesis: SynthesisMode = TEXT_MODE
    staircase: Variant | None = None
    schedule: StaircaseSchedule = StaircaseSchedule()


TEXT = Mode("text")
REFRESH = Refresh(head=1, tail=1)  # the default boundary refresh: the uncalibrated `+refresh` modes use it
BASE_MODES = (TEXT, *(Mode(f"cache:{p.value}", SynthesisMode(p))
                      for p in (Placement.NONE, Placement.BRANCH_POINT, Placement.SEQUENTIAL)),
              Mode("cache:sequential+refresh", SynthesisMode(Placement.SEQUENTIAL, refresh=REFRESH)),
              # branches encoded apart kept at the branch point, decoded replies end to end (and refreshed)
              Mode("cache:mixed", SynthesisMode(Placement.MIXED)),
              Mode("cache:mixed+refresh", SynthesisMode(Placement.MIXED, refresh=REFRESH)))


STAIRCASE_MODES = tuple(Mode(f"staircase-{v.value}:{t}", m, v) for v in Variant
                        for t, m in (("text", TEXT_MODE), ("kv", SynthesisMode(Placement.SEQUENTIAL)),
                                     ("kv+refresh", SynthesisMode(Placement.SEQUENTIAL, refresh=REFRESH))))


def hooked_modes(name: str, hooks: SynthesisHooks) -> list[Mode]:
    """The cached modes again, through a mapper/adapter: `cache:<placement>+<name>`."""
    return [Mode(f"{m.name}+{name}", replace(m.synthesis, hooks=hooks)) for m in BASE_MODES if not m.synthesis.text]


def calibrated_modes(attached: Attached) -> list[Mode]:
    """A trained calibration (Parallel-Synthesis's full method: re-encoding to the placement it was trained for, mapper
    and LoRA) and its ablations, each leaving one part out with the rest on: `calibrated`,
    `calibrated-no-reencode` (branches where they were decoded), `calibrated-no-mapper`, `calibrated-no-lora`;
    and `calibrated:<placement>` for each other re-encoding placement; `calibrated+refresh` adds the boundary
    refresh it was trained with (mode_name: `calibrated+refresh<head>-<tail>` other than a token at each end; a
    token at each end when it was trained without one), and `calibrated+refresh` as well when that differs;
    `staircase-reprefill:calibrated+refresh` and `staircase-append:calibrated+refresh` stream the first."""
    full, placement = attached.hooks, attached.record.placement
    elsewhere = [p for p in (Placement.BRANCH_POINT, Placement.SEQUENTIAL, Placement.MIXED) if p is not placement]
    refresh = attached.record.refresh or REFRESH  # (the one it was trained with, else the default)
    # (and the default as well, which a deployment may serve it with: refresh_tokens 1)
    others = [Mode(mode_name(REFRESH), SynthesisMode(placement, full, REFRESH))] if refresh != REFRESH else []
    return [Mode("calibrated", SynthesisMode(placement, full)),
            Mode(mode_name(refresh), SynthesisMode(placement, full, refresh)), *others,
            # the staircase as a cluster serves it with this calibration
            Mode(f"staircase-reprefill:{mode_name(refresh)}", SynthesisMode(placement, full, refresh),
                 Variant.REPREFILL),
            Mode(f"staircase-append:{mode_name(refresh)}", SynthesisMode(Placement.SEQUENTIAL, full, refresh),
                 Variant.APPEND),
            *(Mode(f"calibrated:{other.value}", SynthesisMode(other, full)) for other in elsewhere),
            Mode("calibrated-no-reencode", SynthesisMode(Placement.NONE, full)),
            Mode("calibrated-no-mapper", SynthesisMode(placement, attached.without(mapper=True))),
            Mode("calibrated-no-lora", SynthesisMode(placement, attached.without(lora=True)))]


def engine_modes(engine: Engine) -> list[Mode]:
    """Every mode this engine can run: text, the untrained cached modes and, with a calibration, its modes."""
    return [*BASE_MODES, *STAIRCASE_MODES,
            *(calibrated_modes(engine.calibration) if engine.calibration is not None else [])]


def load_hooks(spec: str, engine: Engine) -> tuple[str, SynthesisHooks]:
    """'name=package.module:factory', where factory(engine) returns SynthesisHooks."""
    name, sep, target = spec.partition("=")
    module, colon, attr = target.partition(":")
    if not (sep and colon and name and module and attr):
        raise ValueError(f"hooks {spec!r} must look like name=package.module:factory")
    hooks = getattr(importlib.import_module(module), attr)(engine)
    if not isinstance(hooks, SynthesisHooks):
        raise ValueError(f"{target} returned {type(hooks).__name__}, not SynthesisHooks")
    return name, hooks


@dataclass
class EvalConfig:
    tasks: tuple[str, ...] = TASKS
    branches: tuple[int, ...] = (2, 3, 4, 5, 6, 7, 8)
    samples: int = 100  # tasks per (task, branch count)
    seed: int = 0
    length: tuple[int, int] = DEFAULT_LENGTH
    worker_max_tokens: int = 48
    answer_max_tokens: int = 160  # MultiQA at 12 branches answers in about 120 tokens

    def __post_init__(self):
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown or not self.tasks:
            raise ValueError(f"tasks must be among {', '.join(TASKS)}; got {', '.join(self.tasks) or 'none'}")
        if not self.branches or any(not 2 <= m <= MAX_BRANCHES for m in self.branches):
            raise ValueError(f"branch counts must be in 2..{MAX_BRANCHES}, got {self.branches}")
        if self.samples < 1 or self.worker_max_tokens < 1 or self.answer_max_tokens < 1:
            raise ValueError("samples, worker_max_tokens and answer_max_tokens must be >= 1")


@dataclass
class TaskResult:
    task: str
    seed: int
    branches: int
    expected: str
    workers_correct: bool  # every worker wrote its reference reply
    worker_outputs: list[str] = field(default_factory=list)
    answers: dict[str, str] = field(default_factory=dict)
    correct: dict[str, bool] = field(default_factory=dict)
    ttft: dict[str, float] = field(default_factory=dict)  # seconds, synthesizer call to first answer token
    branch_tokens: list[int] = field(default_factory=list)  # each branch message's length, as the synthesizer got it
    reference_correct: bool | None = None  # a trace's: text's answer is its reference answer (None: it has none)


def _drain(stream) -> list[str]:
    texts: dict[int, list[str]] = {}
    for event in stream:
        texts.setdefault(event.call, []).append(event.text)
    return ["".join(texts.get(c, [])) for c in range(len(texts))]


def run_task(engine: Engine, task: Task, modes: Sequence[Mode], config: EvalConfig,
             renderer: ChatRenderer | None = None) -> TaskResult:
    """One synthetic task in every mode, laid out as the model is served (`renderer`: models.chat.task_renderer;
    None, the reference role tokens). In a model's own layout, replies and answers are compared as plain text (its
    special tokens, such as its end of turn, left out)."""
    made: list[str] = []
    plain = _plain_text(engine) if renderer is not None else (lambda text: text)
    try:
        system, contexts, opens, prompt = (task.workflow_texts(renderer) if task.has_workers
                                           else (turn("system", task.system), [], "", task.prompt()))
        if task.has_workers:
            workers = fan_out(engine, system, contexts, opens, SamplingParams(max_tokens=config.worker_max_tokens))
            try:
                outputs = _drain(workers)
            finally:
                made += [*workers.prefix, *workers.contexts, *(workers.ids or ())]
            prefix, branches = workers.prefix, workers.ids
            outputs = [plain(o).removesuffix(END).strip() for o in outputs]
            workers_correct = all(o == b.output for o, b in zip(outputs, task.branches))
        else:
            prefix = engine.prefill([PrefillCall(system)])
            made += prefix
            branches = engine.prefill([PrefillCall(b.message(), parents=prefix) for b in task.branches])
            made += branches
            outputs, workers_correct = [], True
        result = TaskResult(task.name, task.seed, len(task.branches), task.answer, workers_correct, outputs,
                            branch_tokens=[engine.message(b).num_tokens for b in branches])
        answer = SamplingParams(max_tokens=config.answer_max_tokens)
        for mode in modes:
            if mode.staircase is not None and task.has_workers:
                text, ttft = _staircase(engine, (system, contexts, opens, prompt), mode, prefix, config, answer, made)
            else:
                stream = synthesis_stream(engine, branches, prompt, prefix=prefix, mode=mode.synthesis,
                                          sampling=answer)
                text, ttft = _drain(stream)[0], stream.timings["first_token"]
                made += stream.ids
            result.answers[mode.name] = text
            result.correct[mode.name] = task.correct(plain(text))
            result.ttft[mode.name] = ttft
        return result
    finally:
        for message_id in reversed(made):
            engine.free(message_id)


def run_trace(engine: Engine, workflow: TraceWorkflow, modes: Sequence[Mode], config: EvalConfig) -> TaskResult:
    """A recorded workflow in every mode, on the same worker branches (decoded greedily here, as served). A mode is
    right where its answer is the text pipeline's (the one the served path must match: text is right by
    definition); where the trace has a reference answer, `reference_correct` says whether text's matched it, so
    that agreeing with a wrong text answer is seen for what it is. Answers are compared as plain text (special
    tokens, such as the end of turn, left out)."""
    made: list[str] = []
    try:
        workers = fan_out(engine, workflow.task, list(workflow.prompts), workflow.header,
                          SamplingParams(max_tokens=config.worker_max_tokens))
        try:
            outputs = _drain(workers)
        finally:
            made += [*workers.prefix, *workers.contexts, *(workers.ids or ())]
        result = TaskResult("traces", 0, workflow.branches, workflow.reference or "", True, outputs,
                            branch_tokens=[engine.message(b).num_tokens for b in workers.ids])
        answer = SamplingParams(max_tokens=config.answer_max_tokens)
        plain = _plain_text(engine)
        for mode in sorted(modes, key=lambda m: m.name != TEXT.name):  # (text first: the others are held to it)
            stream = synthesis_stream(engine, workers.ids, workflow.synthesis, prefix=workers.prefix,
                                      mode=mode.synthesis, sampling=answer)
            result.answers[mode.name], result.ttft[mode.name] = _drain(stream)[0], stream.timings["first_token"]
            made += stream.ids
            result.correct[mode.name] = plain(result.answers[mode.name]) == plain(result.answers[TEXT.name])
        if workflow.reference is not None:
            result.reference_correct = plain(result.answers[TEXT.name]) == plain(workflow.reference)
        return result
    finally:
        for message_id in reversed(made):
            engine.free(message_id)


def _plain_text(engine: Engine):
    """text -> the text without the model's special tokens (an answer ends with its end-of-turn token), stripped."""
    specials = sorted(getattr(engine.lm.tokenizer, "all_special_tokens", ()), key=len, reverse=True)

    def plain(text: str) -> str:
        for token in specials:
            text = text.replace(token, "")
        return text.strip()
    return plain


def _staircase(engine: Engine, texts: tuple[str, list[str], str, str], mode: Mode, prefix, config: EvalConfig,
               answer: SamplingParams, made: list[str]) -> tuple[str, float]:
    """The workers again (greedy: the same replies), the answer streamed from their chunks as they decode; its
    TTFT runs from the workers' start, since the answer starts before they end. `texts`: the task's
    (Task.workflow_texts)."""
    start = time.perf_counter()
    system, contexts, opens, prompt = texts
    workers = fan_out(engine, system, contexts, opens, SamplingParams(max_tokens=config.worker_max_tokens))
    feed, result, texts, first = BranchFeed([workers]), StaircaseResult(), [], None
    try:
        run = staircase(engine, feed, prompt, prefix, mode.schedule, mode.staircase, mode.synthesis, answer,
                        result=result)
        with contextlib.closing(run):
            for event in run:
                if isinstance(event, TokenEvent):
                    first = first or time.perf_counter()
                    texts.append(event.text)
    finally:
        feed.join()
        made += result.message_ids[-1:]  # (the earlier rounds' messages are freed as it goes)
        workers.free()
    return "".join(texts), (first or time.perf_counter()) - start


def evaluate(engine: Engine, config: EvalConfig, modes: Sequence[Mode], progress: bool = True) -> list[TaskResult]:
    """The synthetic tasks in every mode (run_task), laid out as the engine's model is served; a ValueError where they
    cannot be (a template that cannot render a workflow, or tasks laid out only in the reference role tokens)."""
    model = engine.config.model_path
    try:
        renderer = task_renderer(engine.lm.tokenizer, model)
    except TemplateError as e:
        raise ValueError(f"the synthetic tasks cannot be laid out as {model} is served ({e}); evaluate your own "
                         "workflows with --traces FILE") from None
    reference_only = [t for t in config.tasks if t in WITHOUT_WORKERS]
    if renderer is not None and reference_only:
        raise ValueError(f"{', '.join(reference_only)}: laid out only in the reference model's role tokens, which "
                         f"{model}'s chat template does not use; evaluate worker tasks "
                         f"({', '.join(t for t in TASKS if t not in WITHOUT_WORKERS)}) or your own workflows "
                         "(--traces FILE)")
    jobs = [(name, m) for name in config.tasks for m in config.branches]
    results = []
    with tqdm(total=len(jobs) * config.samples, desc="evaluating", unit="task", disable=not progress) as bar:
        for name, m in jobs:
            for task in sample(name, config.samples, config.seed, m, config.length):
                results.append(run_task(engine, task, modes, config, renderer))
                bar.update()
    return results


def evaluate_traces(engine: Engine, workflows: Sequence[TraceWorkflow], config: EvalConfig, modes: Sequence[Mode],
                    progress: bool = True) -> list[TaskResult]:
    """Every recorded workflow in every mode (run_trace); summarize groups them by branch count."""
    if TEXT.name not in {m.name for m in modes}:
        raise ValueError("evaluating traces holds every mode to the text pipeline's answer: include the text mode")
    return [run_trace(engine, w, modes, config) for w in tqdm(workflows, desc="traces", unit="workflow",
                                                               disable=not progress)]


def summarize(results: Sequence[TaskResult], modes: Sequence[Mode]) -> list[dict]:
    """One row per (task, branch count, mode): accuracy with 95% CI, paired difference to text, McNemar p, TTFT."""
    groups: dict[tuple[str, int], list[TaskResult]] = {}
    for r in results:
        groups.setdefault((r.task, r.branches), []).append(r)
    rows = []
    for (task, m), group in groups.items():
        base = [r.correct[TEXT.name] for r in group] if TEXT.name in group[0].correct else None
        for mode in modes:
            correct = [r.correct[mode.name] for r in group]
            acc = accuracy_ci(correct)
            row = {"task": task, "branches": m, "mode": mode.name, "n": len(group), "accuracy": acc.value,
                   "ci95": [acc.low, acc.high], "workers_correct": sum(r.workers_correct for r in group) / len(group),
                   "ttft_ms_median": 1e3 * statistics.median(r.ttft[mode.name] for r in group)}
            if base is not None and mode.name != TEXT.name:
                diff = paired_difference_ci(correct, base)
                row.update(vs_text=diff.value, vs_text_ci95=[diff.low, diff.high], mcnemar_p=mcnemar_p(correct, base))
            rows.append(row)
    return rows


VERIFY_LEVEL = 0.95  # the one-sided confidence of verify's bounds
ENVELOPE_RULE = ("branch counts pooled, from the fewest, into bands of at least needed_per_band paired samples per "
                 "task (a remainder too small for a band of its own joins the band below it); a band passes when on "
                 "every task the one-sided {level:.0%} lower bound on the paired difference (mode minus text: minus "
                 "the exact Clopper-Pearson upper bound on the rate of pairs where the mode is wrong and text right) "
                 "is at least -tolerance; max_branches is the largest count of the last band in the unbroken run of "
                 "passing bands from the fewest branches")


def branch_bands(samples: dict[int, int], needed: int) -> list[tuple[int, ...]]:
    """Branch counts pooled into bands: `samples` maps each count to the paired samples at it (on the task with the
    fewest); counts are taken from the fewest up, and a band closes once it holds `needed` samples. A remainder short
    of `needed` joins the band below it; with no band below (fewer than `needed` samples in all), it is a band of
    its own, which no outcome can pass. The bands depend on the sample counts only, never on the answers."""
    bands, current, held = [], [], 0
    for m in sorted(samples):
        current.append(m)
        held += samples[m]
        if held >= needed:
            bands.append(tuple(current))
            current, held = [], 0
    if current:
        if bands:
            bands[-1] = (*bands[-1], *current)
        else:
            bands.append(tuple(current))
    return bands


def verify(results: Sequence[TaskResult], mode: str = "calibrated", tolerance: float = 0.02,
           level: float = VERIFY_LEVEL) -> dict:
    """Up to which branch count `mode` answers as well as text re-prefill, by a paired confidence bound over
    pooled samples (ENVELOPE_RULE): branch counts are pooled into bands of at least `needed_per_band` samples per
    task (branch_bands; stats.samples_needed: the fewest at which answers that all agree could pass), and a band
    passes when on every task its one-sided `level` lower bound on mode's accuracy minus text's, paired over the
    same tasks (stats.paired_lower_bound), is at least -`tolerance`. `max_branches` is the largest count of the
    last band in the unbroken run of passing bands from the fewest branches (0: none). `auto` transport ships KV
    only up to there (api/decision.py). Each band reports, per task and at its worst over tasks: n, the pairs the
    mode won and lost against text, the paired mean difference and its lower bound. `passed` (per count: its
    band's) and `gaps` (per task and count: the point estimate, mode's accuracy minus text's) are kept for the
    tables that show a verification."""
    by_cell: dict[tuple[str, int], list[TaskResult]] = {}
    for r in results:
        by_cell.setdefault((r.task, r.branches), []).append(r)
    counts = sorted({m for _, m in by_cell})
    tasks = sorted({t for t, _ in by_cell})
    missing = [f"{t}/{m}" for t in tasks for m in counts if (t, m) not in by_cell]
    missing += sorted({f"{r.task}/{r.branches}/{name}" for r in results for name in (TEXT.name, mode)
                       if name not in r.correct})
    if not results or missing:
        raise ValueError(f"verifying {mode!r} needs it and text on every task and branch count; missing "
                         f"{', '.join(missing[:6]) or 'every result'}")
    needed = samples_needed(tolerance, level)
    bands = []
    for band in branch_bands({m: min(len(by_cell[(t, m)]) for t in tasks) for m in counts}, needed):
        per_task = {}
        for t in tasks:
            group = [r for m in band for r in by_cell[(t, m)]]
            a, b = [r.correct[mode] for r in group], [r.correct[TEXT.name] for r in group]
            wins, losses = sum(x and not y for x, y in zip(a, b)), sum(y and not x for x, y in zip(a, b))
            lower = paired_lower_bound(a, b, level)
            per_task[t] = {"n": len(group), "wins": wins, "losses": losses,
                           "mean_difference": round((wins - losses) / len(group), 6), "lower_bound": round(lower, 6),
                           "passed": lower >= -tolerance}
        bands.append({"branches": list(band), "n": min(v["n"] for v in per_task.values()),
                      "mean_difference": min(v["mean_difference"] for v in per_task.values()),
                      "lower_bound": min(v["lower_bound"] for v in per_task.values()),
                      "verifiable": min(v["n"] for v in per_task.values()) >= needed,
                      "passed": all(v["passed"] for v in per_task.values()), "tasks": per_task})
    max_branches = 0
    for band in bands:
        if not band["passed"]:
            break
        max_branches = band["branches"][-1]

    def accuracy(group: list[TaskResult], name: str) -> float:
        return sum(r.correct[name] for r in group) / len(group)

    return {"mode": mode, "tolerance": tolerance, "level": level, "rule": ENVELOPE_RULE.format(level=level),
            "needed_per_band": needed, "max_branches": max_branches, "tasks": tasks,
            "samples": min(len(g) for g in by_cell.values()), "bands": bands,
            "passed": {str(m): next(b["passed"] for b in bands if m in b["branches"]) for m in counts},
            "gaps": {f"{t}/{m}": round(accuracy(by_cell[(t, m)], mode) - accuracy(by_cell[(t, m)], TEXT.name), 4)
                     for t in tasks for m in counts}}


def format_bands(verification: dict) -> str:
    """verify's bands as a table, each with what it found, and where too few samples could not decide it."""
    needed, tolerance = verification["needed_per_band"], verification["tolerance"]
    lines = [f"{verification['mode']} minus text by branch-count band, in accuracy points, paired (the task with "
             "the lowest bound shown):",
             f"  a band passes where on every task the one-sided {verification['level']:.0%} exact lower bound is at "
             f"least -{100 * tolerance:g}; it needs at least {needed} samples per task to pass at all",
             f"  {'branches':<9} {'n':>5} {'won':>4} {'lost':>4} {'mean diff':>10} {'lower bound':>12}  result"]
    for band in verification["bands"]:
        counts = band["branches"]
        span = f"{counts[0]}-{counts[-1]}" if len(counts) > 1 else str(counts[0])
        task, worst = min(band["tasks"].items(), key=lambda kv: kv[1]["lower_bound"])  # (the task that decides it)
        on = f" (on {task})" if len(band["tasks"]) > 1 else ""
        if not band["verifiable"]:
            result = f"not verifiable: too few samples ({band['n']}; need {needed})"
        else:
            result = ("passed" if band["passed"] else "failed") + on
        lines.append(f"  {span:<9} {worst['n']:>5} {worst['wins']:>4} {worst['losses']:>4} "
                     f"{100 * worst['mean_difference']:>+10.2f} {100 * worst['lower_bound']:>+12.2f}  {result}")
    return "\n".join(lines)


def format_table(rows: Sequence[dict]) -> str:
    lines = [f"{'task':<8} {'m':>2} {'mode':<28} {'n':>4} {'accuracy [95% CI]':>22} {'vs text [95% CI]':>24} "
             f"{'McNemar p':>10} {'TTFT ms':>8}"]
    for r in rows:
        acc = f"{100 * r['accuracy']:5.1f} [{100 * r['ci95'][0]:5.1f},{100 * r['ci95'][1]:5.1f}]"
        diff = (f"{100 * r['vs_text']:+6.1f} [{100 * r['vs_text_ci95'][0]:+6.1f},{100 * r['vs_text_ci95'][1]:+6.1f}]"
                if "vs_text" in r else "")
        p = f"{r['mcnemar_p']:.3g}" if "mcnemar_p" in r else ""
        lines.append(f"{r['task']:<8} {r['branches']:>2} {r['mode']:<28} {r['n']:>4} {acc:>22} {diff:>24} {p:>10} "
                     f"{r['ttft_ms_median']:8.1f}")
    return "\n".join(lines)


def traces_config(config: EvalConfig, files: Sequence[str], held_out_every: int,
                  workflows: Sequence[TraceWorkflow]) -> dict:
    """What an evaluation of recorded workflows ran (report's `config`): the trace files, the held-out rule, how
    many workflows and which branch counts, and the token caps; not the synthetic tasks' settings, which it does
    not use."""
    return {"traces": list(files),
            "held_out": ({"every": held_out_every, "rule": SPLIT_RULE} if held_out_every
                         else "none: every trace in the files"),
            "workflows": len(workflows), "branches": sorted({w.branches for w in workflows}),
            "worker_max_tokens": config.worker_max_tokens, "answer_max_tokens": config.answer_max_tokens}


def report(config: EvalConfig | dict, model: str, fingerprint: str, modes: Sequence[Mode],
           results: Sequence[TaskResult]) -> dict:
    """The evaluation as JSON: `config` is what ran (an EvalConfig for the synthetic tasks; traces_config's dict
    for recorded workflows)."""
    return {"model": model, "fingerprint": fingerprint,
            "config": config if isinstance(config, dict) else asdict(config), "modes": [m.name for m in modes],
            "summary": summarize(results, modes), "results": [asdict(r) for r in results]}


def plot_accuracy(rows: Sequence[dict], path: str) -> None:
    """Accuracy against branch count, one panel per task, one line per mode, 95% CIs as bars."""
    from braid.results import pyplot

    plt = pyplot()
    if plt is None:
        return
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.6), squeeze=False, sharey=True)
    for ax, task in zip(axes[0], tasks):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            sel = sorted((r for r in rows if r["task"] == task and r["mode"] == mode), key=lambda r: r["branches"])
            acc = [100 * r["accuracy"] for r in sel]
            err = [[a - 100 * r["ci95"][0] for a, r in zip(acc, sel)],
                   [100 * r["ci95"][1] - a for a, r in zip(acc, sel)]]
            ax.errorbar([r["branches"] for r in sel], acc, yerr=err, marker="o", capsize=3, label=mode)
        ax.set(title=task, xlabel="branches", ylim=(-3, 103))
    axes[0][0].set_ylabel("exact-match accuracy, % (95% CI)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
