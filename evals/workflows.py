"""Agent workflows' answers on the reference model: tree-of-thoughts voting as a RunGraph DAG, read three ways.

The reference tasks as ToT graphs (engine.dag): a system node, one solver per branch (its own notes, then a
worker reply it decodes), and a voter that reads every solution and answers the task's question (vote: pick
the most confident answer; chain: combine two lookups). The voter reads the solutions through their cached
encodings ("kv", choreographed), re-encoded in its own context ("text", the baseline), or as a staircase node
streaming their KV chunks while they decode ("staircase", default schedule, re-prefill), or through the model's
trained calibration ("calibrated": cache mapper, synthesizer LoRA and boundary refresh, the served cache
path's reading; the fine-tune on baseline traces, done by `braid calibrate`). Accuracy per mode, with a
paired bootstrap interval and McNemar's p against text, on task seeds that no training run used.

    python -m braid.evals.workflows --out benchmarks/results/eval_workflows_cpu.json
"""

import argparse
import logging
import os

from tqdm import tqdm

from braid.engine import Engine, EngineConfig, SamplingParams
from braid.engine.dag import DagRun, Edge, Graph, Node
from braid.evals.stats import accuracy_ci, mcnemar_p, paired_difference_ci
from braid.models import REFERENCE_MODEL
from braid.models.chat import WORKER_HEADER, turn
from braid.models.tasks import Task, sample
from braid.results import pyplot, write_json

MODES = ("text", "kv", "staircase", "calibrated")
SOLVER = SamplingParams(max_tokens=48)
VOTER = SamplingParams(max_tokens=64)


def tot_graph(task: Task, mode: str) -> Graph:
    """The task as a ToT DAG: solvers (notes, then a worker reply), then one voter reading every solution."""
    nodes = [Node("system", turn("system", task.system))]
    for j, branch in enumerate(task.branches):
        nodes.append(Node(f"notes{j}", turn("user", branch.context), role=f"solver{j}", parents=(Edge("system"),)))
        nodes.append(Node(f"solution{j}", WORKER_HEADER, role=f"solver{j}", sampling=SOLVER,
                          output="text" if mode == "text" else "kv",
                          parents=(Edge("system"), Edge(f"notes{j}"))))
    nodes.append(Node("voter", task.prompt(), role="voter", sampling=VOTER, staircase=mode == "staircase",
                      parents=(Edge("system"), *(Edge(f"solution{j}") for j in range(len(task.branches))))))
    return Graph(nodes, calibrated=mode == "calibrated")


def answer(engine: Engine, task: Task, mode: str) -> bool:
    dag = DagRun(engine, tot_graph(task, mode))
    for _ in dag:
        pass
    reply = engine.text(dag.outputs["voter"]).split("<|synthesizer|>", 1)[-1]
    dag.free(keep=())
    return task.correct(reply)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.environ.get("BRAID_MODEL", REFERENCE_MODEL))
    p.add_argument("--tasks", default="vote,chain", help="comma-separated task families (default: vote,chain)")
    p.add_argument("--branches", type=int, default=4, help="solvers per graph (default: 4)")
    p.add_argument("--samples", type=int, default=100, help="tasks per family (default: 100)")
    p.add_argument("--seed", type=int, default=6000, help="first task seed (default: 6000; held out)")
    p.add_argument("--out", default="benchmarks/results/eval_workflows_cpu.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    engine = Engine(EngineConfig(args.model))  # (with its calibration when it has one: "calibrated" reads through it)
    modes = MODES if engine.calibration is not None else MODES[:-1]
    if engine.calibration is None:
        print(f"{args.model} has no calibration: the calibrated mode is left out")
    rows = []
    for name in args.tasks.split(","):
        tasks = sample(name, args.samples, args.seed, args.branches)
        got = {mode: [] for mode in modes}
        for task in tqdm(tasks, desc=name, unit="task"):
            for mode in modes:
                got[mode].append(answer(engine, task, mode))
        for mode in modes:
            acc = accuracy_ci(got[mode])
            row = {"task": name, "mode": mode, "n": len(tasks), "accuracy": acc.value, "ci": [acc.low, acc.high]}
            if mode != "text":
                diff = paired_difference_ci(got[mode], got["text"])
                row |= {"minus_text": diff.value, "minus_text_ci": [diff.low, diff.high],
                        "mcnemar_p": mcnemar_p(got[mode], got["text"])}
            rows.append(row)
    print(f"{'task':<7} {'mode':<10} {'n':>4} {'accuracy [95% CI]':>24} {'minus text [95% CI]':>26} {'McNemar p':>10}")
    for r in rows:
        diff = (f"{100 * r['minus_text']:+.1f} [{100 * r['minus_text_ci'][0]:+.1f}, {100 * r['minus_text_ci'][1]:+.1f}]"
                if "minus_text" in r else "")
        print(f"{r['task']:<7} {r['mode']:<10} {r['n']:>4} {100 * r['accuracy']:>8.1f} [{100 * r['ci'][0]:5.1f}, "
              f"{100 * r['ci'][1]:5.1f}] {diff:>26} {r.get('mcnemar_p', float('nan')):>10.3g}")
    stem = write_json(os.path.dirname(args.out) or ".", os.path.splitext(os.path.basename(args.out))[0],
                      {"rows": rows, "config": vars(args)})
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.4))
        names = list(dict.fromkeys(r["task"] for r in rows))
        for k, mode in enumerate(modes):
            mine = [next(r for r in rows if r["task"] == n and r["mode"] == mode) for n in names]
            xs = [i + (k - 1.5) * 0.2 for i in range(len(names))]
            ax.bar(xs, [100 * r["accuracy"] for r in mine], 0.2, label=mode,
                   yerr=[[100 * (r["accuracy"] - r["ci"][0]) for r in mine],
                         [100 * (r["ci"][1] - r["accuracy"]) for r in mine]], capsize=3)
        ax.set_xticks(range(len(names)), names)
        ax.set(ylabel="voter accuracy (%)", title=f"ToT voting on the reference model ({args.branches} solvers)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=110)
    print(f"wrote {args.out} and its plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
