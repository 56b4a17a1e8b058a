"""Agent workflows as DAGs: choreographed (cached encodings) against the text re-prefill baseline, side by side.

The seed's three workflows (engine.presets: MADiter, MADpar, ToT), each run as one RunGraph DAG on one engine,
twice per repeat: every message read through its cached encoding ("kv"), and every message re-encoded in each
reader's context ("text", the baseline; the engine's prefix cache still reuses identical prompt starts, as
vLLM's would). The prefix cache is cleared before every run, so no run reuses another's work. TTFT is each
decoding node's time from its wave's start (reading its parents, encoding its prompt) to its first token,
averaged over the workflow's decoding nodes; E2E is the whole DAG. Replies are `--max-tokens` long
(ignore_eos: random weights). Writes JSON and a plot.
"""

import argparse
import logging
import statistics
import tempfile
import time

import torch
from tqdm import tqdm

from braid.engine import Engine, EngineConfig, SamplingParams
from braid.engine.dag import run_dag
from braid.engine.presets import mad_iter, mad_par, tot
from braid.models.checkpoints import add_model_arguments, benchmark_model
from braid.results import pyplot, write_json

SEED_RATIOS = {"mad-iter": 2.0, "tot": 3.5, "mad-par": 6.2}  # the seed's TTFT speedups (Llama-3.1-8B, GPU)


def build(name: str, question: str, sampling: SamplingParams, output: str):
    if name == "mad-iter":
        return mad_iter(question, rounds=3, sampling=sampling, output=output)
    if name == "mad-par":
        return mad_par(question, agents=3, rounds=3, sampling=sampling, output=output)
    return tot(question, solutions=8, voters=4, sampling=sampling, output=output)


def run_once(eng: Engine, graph) -> dict:
    eng.clear_prefix_cache()
    start = time.perf_counter()
    dag = run_dag(eng, graph)
    for _ in dag:
        pass
    seconds = time.perf_counter() - start
    dag.free(keep=())
    return {"ttft_mean_ms": 1e3 * statistics.mean(dag.ttft.values()), "ttft_total_ms": 1e3 * sum(dag.ttft.values()),
            "e2e_s": seconds, "decoding_nodes": len(dag.ttft)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--workflows", default="mad-iter,tot,mad-par", help="comma-separated (default: all three)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per reply (default: 64)")
    p.add_argument("--question-words", type=int, default=48, help="words in the question (default: 48)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per mode, after a warm-up (default: 2)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the plot")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    names = args.workflows.split(",")
    bad = [n for n in names if n not in SEED_RATIOS]
    if bad or args.max_tokens < 1 or args.repeats < 1:
        p.error(f"workflows must be among {', '.join(SEED_RATIOS)}; --max-tokens and --repeats >= 1")
    question = " ".join(f"fact{i % 17}" for i in range(args.question_words)) + "?"
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        path, device = benchmark_model(args, tmp)
        eng = Engine(EngineConfig(path, device=device, calibration="none", store_budget_bytes=16 << 30))
    rows = []
    with tqdm(total=len(names) * 2 * (args.repeats + 1), desc="workflows", unit="run") as bar:
        for name in names:
            runs = {"kv": [], "text": []}
            for r in range(args.repeats + 1):  # alternating, so drift hits both; the first pair warms up
                for output in ("kv", "text"):
                    got = run_once(eng, build(name, question, sampling, output))
                    if r:
                        runs[output].append(got)
                    bar.update()
            med = {o: {k: statistics.median(x[k] for x in runs[o]) for k in runs[o][0]} for o in runs}
            rows.append({"workflow": name, "choreographed": med["kv"], "baseline": med["text"],
                         "ttft_ratio": med["text"]["ttft_mean_ms"] / med["kv"]["ttft_mean_ms"],
                         "e2e_ratio": med["text"]["e2e_s"] / med["kv"]["e2e_s"], "seed_ttft_ratio": SEED_RATIOS[name]})
    print(f"{'workflow':<10} {'TTFT text':>10} {'TTFT kv':>9} {'ratio':>7} {'seed':>6} {'E2E text':>9} "
          f"{'E2E kv':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['workflow']:<10} {r['baseline']['ttft_mean_ms']:>8.1f}ms {r['choreographed']['ttft_mean_ms']:>7.1f}ms "
              f"{r['ttft_ratio']:>6.2f}x {r['seed_ttft_ratio']:>5.1f}x {r['baseline']['e2e_s']:>8.2f}s "
              f"{r['choreographed']['e2e_s']:>7.2f}s {r['e2e_ratio']:>5.2f}x")
    stem = write_json(args.out, f"workflows_{device.split(':')[0]}", {
        "rows": rows, "config": vars(args), "device": device, "dtype": str(eng.lm.dtype),
        "torch": torch.__version__})
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.4))
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["ttft_ratio"] for r in rows], 0.4, label="Braid (this run)")
        ax.bar([i + 0.2 for i in x], [r["seed_ttft_ratio"] for r in rows], 0.4, label="seed 000 (8B, GPU)")
        ax.set_xticks(list(x), [r["workflow"] for r in rows])
        ax.set(ylabel="TTFT speedup over text re-prefill", title=f"choreographed workflows ({device})")
        ax.axhline(1, color="gray", lw=0.8)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=110)
    print(f"wrote {stem}.json and its plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
