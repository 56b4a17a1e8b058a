"""Agent workflows' answers on the reference model: ToT voting, iterative and parallel debate as RunGraph DAGs.

The reference tasks as Prompt Choreography's three workflow shapes (methods.dag), every worker reply a lookup in
its own notes and the final node the task's synthesis (vote: pick the most confident answer; chain: combine two
lookups):
- ToT: one solver per branch (its own notes, then a worker reply it decodes), then a voter that reads every
  solution and answers the task's question;
- MADiter: the solvers speak in turn, each after every earlier turn (then its own notes and reply), and a
  moderator reads every turn and answers;
- MADpar: two rounds of parallel agents (the second round's agents read every first-round answer, then
  their own notes, and answer again), and an aggregator reads the last round and answers.
The final node reads the replies through their cached encodings ("kv", choreographed), re-encoded in its own
context ("text", the baseline), as a staircase node streaming their KV chunks while they decode
("staircase", default schedule, re-prefill; ToT and MADpar, whose final node reads replies that decode
together; MADpar's second round reads the first whole, since its own notes come last), or through the
model's trained calibration ("calibrated": cache mapper, synthesizer LoRA and boundary refresh, the served
cache path's reading; the fine-tune on baseline traces, done by `braid calibrate`). In MADiter and MADpar
the earlier readers (later turns, the second round) read the same way as the final node (text in the
baseline, cached encodings otherwise); "calibrated+turns" also runs those turns with the calibration's turn
LoRA (the debaters fine-tuned, `braid calibrate-turns`), where "calibrated" runs them with base weights: Prompt
Choreography's before and after fine-tuning. Accuracy per mode, with
a paired bootstrap interval and McNemar's p against text, on task seeds that no training run used, and the
share of worker turns that said their own lookup (where a debate loses it: in its turns or its final reading).

    python -m braid.evals.workflows --workflows tot,mad-iter,mad-par
"""

import argparse
import json
import logging
import os
from typing import NamedTuple

from tqdm import tqdm

from braid.engine import Engine, EngineConfig
from braid.evals.stats import accuracy_ci, mcnemar_p, paired_difference_ci
from braid.methods.calibration import fingerprints, load_engine
from braid.methods.dag import DagRun, Graph
from braid.methods.dag.presets import NOTES_STREAMING, NOTES_WORKFLOWS, notes_graph, solver
from braid.models import REFERENCE_MODEL
from braid.models.chat import WORKER_HEADER
from braid.models.tasks import Task, sample, strip_reply
from braid.results import pyplot, write_json_to, written

MODES = ("text", "kv", "staircase", "calibrated", "calibrated+turns")
WORKFLOWS = NOTES_WORKFLOWS


def graph(task: Task, mode: str, workflow: str) -> Graph:
    """The task as `workflow` (methods.dag.presets.notes_graph), read as `mode` reads it."""
    return notes_graph(workflow, *task.workflow_texts(), output="text" if mode == "text" else "kv",
                       staircase=mode == "staircase", calibrated=mode.startswith("calibrated"),
                       turn_lora=mode == "calibrated+turns")


def runs(engine: Engine, mode: str, workflow: str) -> bool:
    """Whether a mode applies: the calibrated ones need a calibration (and "calibrated+turns" its turn LoRA, and
    turns: ToT has none), a staircase needs readers that decode together."""
    attached = engine.calibration
    if mode == "calibrated+turns":
        return attached is not None and attached.turns is not None and workflow != "tot"
    return (mode != "calibrated" or attached is not None) and (mode != "staircase" or workflow in NOTES_STREAMING)


class Answer(NamedTuple):
    right: bool  # the final answer is right
    said: int  # how many of the worker turns said their own lookup
    of: int  # of how many
    reply: str  # the final node's reply


def answer(engine: Engine, task: Task, mode: str, workflow: str = "tot") -> Answer:
    """One graph's final answer, and how many of its worker turns said their own lookup."""
    g = graph(task, mode, workflow)
    dag = DagRun(engine, g)
    for _ in dag:
        pass
    reply = engine.text(dag.outputs["final"]).split("<|synthesizer|>", 1)[-1]
    solvers = [(n.name, task.branches[solver(n)]) for n in g.nodes if n.sampling is not None and solver(n) is not None]
    turns = [(name, branch) for name, branch in solvers if branch.output is not None]  # (MultiQA has none)
    right = sum(strip_reply(engine.text(dag.outputs[name]).split(WORKER_HEADER, 1)[-1]) == branch.output
                for name, branch in turns)
    dag.free(keep=())
    return Answer(task.correct(reply), right, len(turns), reply)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.environ.get("BRAID_MODEL", REFERENCE_MODEL))
    p.add_argument("--workflows", default="tot", help=f"comma-separated, of {', '.join(WORKFLOWS)} (default: tot)")
    p.add_argument("--tasks", default="vote,chain", help="comma-separated task families (default: vote,chain)")
    p.add_argument("--branches", type=int, default=4, help="solvers per graph (default: 4)")
    p.add_argument("--samples", type=int, default=100, help="tasks per family (default: 100)")
    p.add_argument("--seed", type=int, default=6000, help="first task seed (default: 6000; held out)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES)
                   + " (default: all; those the model cannot run are left out)")
    p.add_argument("--out", default="benchmarks/results/eval_workflows_cpu.json")
    p.add_argument("--sample", default="", help="also write every answer here, with the model's fingerprint (a "
                   "recorded sample that tests replay)")
    args = p.parse_args(argv)
    workflows = args.workflows.split(",")
    wanted = args.modes.split(",")
    if "text" not in wanted or any(m not in MODES for m in wanted):
        p.error(f"--modes must name text (the baseline the others are paired with) and only {', '.join(MODES)}; "
                f"got {args.modes!r}")
    unknown = [w for w in workflows if w not in WORKFLOWS]
    if unknown:
        p.error(f"unknown workflow {unknown[0]!r}: choose from {', '.join(WORKFLOWS)}")
    logging.basicConfig(level=logging.WARNING)
    engine = load_engine(EngineConfig(args.model))  # (with its calibration, if any: "calibrated" reads through it)
    if engine.calibration is None:
        print(f"{args.model} has no calibration: the calibrated mode is left out")
    rows, recorded = [], []
    for workflow in workflows:
        modes = [m for m in wanted if runs(engine, m, workflow)]
        for name in args.tasks.split(","):
            tasks = sample(name, args.samples, args.seed, args.branches)
            got, turns = {mode: [] for mode in modes}, {mode: [0, 0] for mode in modes}
            for seed, task in enumerate(tqdm(tasks, desc=f"{workflow} {name}", unit="task"), args.seed):
                for mode in modes:
                    got_one = answer(engine, task, mode, workflow)
                    got[mode].append(got_one.right)
                    turns[mode] = [turns[mode][0] + got_one.said, turns[mode][1] + got_one.of]
                    recorded.append({"workflow": workflow, "task": name, "seed": seed, "branches": args.branches,
                                   "mode": mode, "answer": list(got_one)})
            for mode in modes:
                acc = accuracy_ci(got[mode])
                row = {"workflow": workflow, "task": name, "mode": mode, "n": len(tasks), "accuracy": acc.value,
                       "ci": [acc.low, acc.high],
                       "turns_right": turns[mode][0] / turns[mode][1] if turns[mode][1] else None}
                if mode != "text":
                    diff = paired_difference_ci(got[mode], got["text"])
                    row |= {"minus_text": diff.value, "minus_text_ci": [diff.low, diff.high],
                            "mcnemar_p": mcnemar_p(got[mode], got["text"])}
                rows.append(row)
    print(f"{'workflow':<9} {'task':<7} {'mode':<16} {'n':>4} {'accuracy [95% CI]':>24} {'minus text [95% CI]':>26} "
          f"{'McNemar p':>10} {'turns right':>11}")
    for r in rows:
        diff = (f"{100 * r['minus_text']:+.1f} [{100 * r['minus_text_ci'][0]:+.1f}, {100 * r['minus_text_ci'][1]:+.1f}]"
                if "minus_text" in r else "")
        turns = "-" if r["turns_right"] is None else f"{100 * r['turns_right']:.1f}%"
        print(f"{r['workflow']:<9} {r['task']:<7} {r['mode']:<16} {r['n']:>4} {100 * r['accuracy']:>8.1f} "
              f"[{100 * r['ci'][0]:5.1f}, {100 * r['ci'][1]:5.1f}] {diff:>26} "
              f"{r.get('mcnemar_p', float('nan')):>10.3g} {turns:>11}")
    stem = write_json_to(args.out, {"rows": rows, "config": vars(args)}, device=str(engine.lm.device),
                         **fingerprints(engine))
    plt = pyplot()
    if plt is not None:
        groups = list(dict.fromkeys((r["workflow"], r["task"]) for r in rows))
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 3.4))
        for k, mode in enumerate(MODES):
            mine = [(i, r) for i, g in enumerate(groups) for r in rows if (r["workflow"], r["task"]) == g
                    and r["mode"] == mode]
            if not mine:
                continue
            ax.bar([i + (k - 2) * 0.16 for i, _ in mine], [100 * r["accuracy"] for _, r in mine], 0.16, label=mode,
                   yerr=[[100 * (r["accuracy"] - r["ci"][0]) for _, r in mine],
                         [100 * (r["ci"][1] - r["accuracy"]) for _, r in mine]], capsize=3)
        ax.set_xticks(range(len(groups)), [f"{w}\n{t}" for w, t in groups])
        ax.set(ylabel="final answer accuracy (%)",
               title=f"Workflows on the reference model ({args.branches} solvers)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=110)
    if args.sample:
        with open(args.sample, "w") as f:
            json.dump({"fingerprint": engine.fingerprint, "config": vars(args), "rows": recorded}, f, indent=1)
    print(written(stem + ".json") + (f", and {args.sample}" if args.sample else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
