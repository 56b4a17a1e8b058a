"""Staircase nodes in agent workflows against waiting for whole replies, side by side in one run.

MoA (layers of proposers, then an aggregator) and MADpar (debate rounds) from methods.dag.presets, run as one
RunGraph DAG on one engine: each reader waits for the whole replies it reads ("wait"), or is a staircase
node that starts from their first chunks (as in Staircase Streaming), in the re-prefill or the append variant;
the later layers and rounds are nested staircases. Both transports: cached KV chunks ("kv") and text chunks ("text").
Measured from the graph's start: the time to the final stage's first token (MoA: the aggregator; MADpar: the
last round's agents, averaged), the final stage's own decode rate, and the whole DAG's end-to-end time. The
prefix cache is cleared before every run; runs alternate, after a warm-up of each. Replies are `--max-tokens`
long (ignore_eos: random weights, so this measures time only; quality is `braid eval`'s staircase modes).
Writes JSON and a plot.
"""

import argparse
import logging
import statistics
import tempfile
import time

import torch
from tqdm import tqdm

from braid.engine import Engine, EngineConfig, SamplingParams
from braid.methods.dag import NodeToken, run_dag
from braid.methods.dag.presets import mad_par, moa
from braid.methods.staircase import Variant
from braid.models.checkpoints import add_model_arguments, benchmark_model
from braid.results import pyplot, write_json, written

MODES = ("wait", "reprefill", "append")


def build(name: str, question: str, sampling: SamplingParams, output: str, mode: str):
    stair = None if mode == "wait" else Variant(mode)
    if name == "moa":
        return moa(question, proposers=3, layers=2, sampling=sampling, output=output, staircase=stair), ["aggregator"]
    return mad_par(question, agents=3, rounds=3, sampling=sampling, output=output, staircase=stair), \
        [f"round3:agent{i}" for i in range(3)]


def run_once(eng: Engine, graph, final: list[str]) -> dict:
    eng.clear_prefix_cache()
    first, last, count = {}, {}, {}
    start = time.perf_counter()
    dag = run_dag(eng, graph)
    for ev in dag:
        if isinstance(ev, NodeToken) and ev.node in final:
            now = time.perf_counter() - start
            first.setdefault(ev.node, now)
            last[ev.node] = now
            count[ev.node] = count.get(ev.node, 0) + 1
    seconds = time.perf_counter() - start
    dag.free(keep=())
    rate = statistics.mean((count[n] - 1) / max(last[n] - first[n], 1e-9) for n in final)
    return {"final_ttft_ms": 1e3 * statistics.mean(first.values()), "final_tokens_per_s": rate, "e2e_s": seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--workflows", default="moa,mad-par", help="comma-separated (default: moa,mad-par)")
    p.add_argument("--transports", default="kv,text", help="comma-separated (default: kv,text)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per reply (default: 64)")
    p.add_argument("--question-words", type=int, default=48, help="words in the question (default: 48)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per mode, after a warm-up (default: 2)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the plot")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    names, transports = args.workflows.split(","), args.transports.split(",")
    if set(names) - {"moa", "mad-par"} or set(transports) - {"kv", "text"} or args.max_tokens < 2 \
            or args.repeats < 1:
        p.error("workflows: moa, mad-par; transports: kv, text; --max-tokens >= 2 and --repeats >= 1")
    question = " ".join(f"fact{i % 17}" for i in range(args.question_words)) + "?"
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        path, device = benchmark_model(args, tmp)
        eng = Engine(EngineConfig(path, device=device, calibration="none", store_budget_bytes=16 << 30))
    rows = []
    with tqdm(total=len(names) * len(transports) * len(MODES) * (args.repeats + 1), desc="staircase dags",
              unit="run") as bar:
        for name in names:
            for output in transports:
                runs = {m: [] for m in MODES}
                for r in range(args.repeats + 1):  # alternating, so drift hits every mode; the first round warms up
                    for mode in MODES:
                        got = run_once(eng, *build(name, question, sampling, output, mode))
                        if r:
                            runs[mode].append(got)
                        bar.update()
                med = {m: {k: statistics.median(x[k] for x in runs[m]) for k in runs[m][0]} for m in MODES}
                for mode in MODES[1:]:
                    rows.append({"workflow": name, "transport": output, "variant": mode, "staircase": med[mode],
                                 "wait": med["wait"],
                                 "ttft_reduction": 1 - med[mode]["final_ttft_ms"] / med["wait"]["final_ttft_ms"],
                                 "e2e_ratio": med["wait"]["e2e_s"] / med[mode]["e2e_s"]})
    print(f"{'workflow':<8} {'kv/text':<7} {'variant':<10} {'TTFT wait':>10} {'TTFT stair':>11} {'lower':>7} "
          f"{'tok/s wait':>10} {'tok/s stair':>11} {'E2E wait':>9} {'E2E stair':>10}")
    for r in rows:
        w, s = r["wait"], r["staircase"]
        print(f"{r['workflow']:<8} {r['transport']:<7} {r['variant']:<10} {w['final_ttft_ms']:>8.0f}ms "
              f"{s['final_ttft_ms']:>9.0f}ms {100 * r['ttft_reduction']:>6.1f}% {w['final_tokens_per_s']:>10.1f} "
              f"{s['final_tokens_per_s']:>11.1f} {w['e2e_s']:>8.2f}s {s['e2e_s']:>9.2f}s")
    stem = write_json(args.out, f"dag_staircase_{device.split(':')[0]}", {
        "rows": rows, "config": vars(args), "device": device, "dtype": str(eng.lm.dtype),
        "torch": torch.__version__}, device=device, model=eng.fingerprint, calibration=None)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 3.4))
        labels = [f"{r['workflow']}\n{r['transport']} {r['variant']}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["wait"]["final_ttft_ms"] for r in rows], 0.4, label="wait for whole replies")
        ax.bar([i + 0.2 for i in x], [r["staircase"]["final_ttft_ms"] for r in rows], 0.4, label="staircase")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set(ylabel="final stage's TTFT (ms)", title=f"staircase nodes in agent workflows ({device})")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=110)
    print(written(stem + ".json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
