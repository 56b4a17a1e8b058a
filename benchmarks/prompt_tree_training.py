"""The reference trainer run both ways, prompt graphs and flat rows, from the same seed: loss curves and wall time.

Both runs draw the same tasks and traces at every step (a step's batch depends on
the seed and the step only) and train the same objective; `--packing graph` encodes
a task's shared system prompt once. With exact packed gradients the two loss curves
agree up to floating-point noise (summation order), which grows with the steps as
any two runs' do. Writes JSON and a plot of both curves.
"""

import argparse
import logging
import os
import tempfile

from braid.results import pyplot, write_json, written
from braid.train.train import TrainConfig, train


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--worker-traces", type=int, default=2, help="worker turns per task (up to 12: more sharing)")
    p.add_argument("--tasks-per-step", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the plot")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for packing in ("graph", "flat"):
            cfg = TrainConfig(out=os.path.join(tmp, packing), seed=args.seed, steps=args.steps,
                              tasks_per_step=args.tasks_per_step, worker_traces=args.worker_traces,
                              num_layers=args.num_layers, eval_every=args.steps, packing=packing)
            record = train(cfg)
            runs[packing] = {k: record[k] for k in ("loss", "train_seconds", "step_seconds", "tokens_seen",
                                                    "flat_tokens_seen", "held_out_accuracy", "device")}
    graph, flat = runs["graph"], runs["flat"]
    gaps = [abs(a - b) for a, b in zip(graph["loss"], flat["loss"])]
    result = {"steps": args.steps, "worker_traces": args.worker_traces, "tasks_per_step": args.tasks_per_step,
              "num_layers": args.num_layers, "seed": args.seed,
              "cached_token_ratio": round(graph["flat_tokens_seen"] / graph["tokens_seen"], 3),
              "step_time_ratio": round(flat["step_seconds"] / graph["step_seconds"], 3),
              "first_step_loss_gap": gaps[0], "max_loss_gap_first_10": max(gaps[:10]),
              "mean_loss_gap_last_50": sum(gaps[-50:]) / len(gaps[-50:]), "runs": runs}
    device = "cuda" if runs["graph"]["device"].startswith("cuda") else "cpu"
    # (each run trains its own model from a seed: no checkpoint was measured)
    stem = write_json(args.out, f"prompt_tree_training_{device}", result, device=device, model=None, calibration=None)
    plot(result, stem + ".png")
    print(f"cached-token ratio {result['cached_token_ratio']}, step time flat/graph {result['step_time_ratio']}x, "
          f"loss gap at step 1 {gaps[0]:.1e}, mean over the last 50 steps {result['mean_loss_gap_last_50']:.1e}")
    print(written(stem + ".json"))
    return result


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, a = plt.subplots(figsize=(7, 4))
    for packing, style in (("flat", "-"), ("graph", "--")):
        run = result["runs"][packing]
        a.plot(range(1, len(run["loss"]) + 1), run["loss"], style,
               label=f"{packing}: {run['step_seconds']:.0f} s of steps, {run['tokens_seen'] / 1e6:.2f}M tokens")
    a.set(yscale="log", xlabel="step", ylabel="training loss",
          title=f"reference trainer, both ways (cached-token ratio {result['cached_token_ratio']}, "
                f"flat/graph step time {result['step_time_ratio']}x)")
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
