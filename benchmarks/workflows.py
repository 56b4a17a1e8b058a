"""Agent workflows as DAGs: choreographed (cached encodings) against the text re-prefill baseline, side by side.

Prompt Choreography's three workflows (methods.dag.presets: MADiter, MADpar, ToT), each run as one RunGraph DAG
on one engine, twice per repeat: every message read through its cached encoding ("kv"), and every message
re-encoded in each reader's context ("text", the baseline; the engine's prefix cache still reuses identical prompt
starts, as vLLM's would). The prefix cache is cleared before every run, so no run reuses another's work. TTFT is each
decoding node's time from its wave's start (reading its parents, encoding its prompt) to its first token,
averaged over the workflow's decoding nodes; E2E is the whole DAG. Replies are `--max-tokens` long
(ignore_eos: random weights). Writes JSON and a plot.

With `--turns`, also what the calibration's turn LoRA costs: the reference tasks' debates (MADiter and MADpar
over each solver's notes, methods.dag.presets.notes_graph, `--turn-solvers` solvers) on the same weights with a
calibration and a turn LoRA drawn at random (their cost does not depend on their values), choreographed
("kv"), calibrated with base-weight turns, and calibrated with the turn LoRA; TTFT averaged over the turns
(the solvers that read other replies), side by side in the same repeats.
"""

import argparse
import logging
import statistics
import tempfile
import time

import torch
from tqdm import tqdm

from braid.engine import Engine, EngineConfig, SamplingParams
from braid.methods.calibration import fingerprints, load_engine
from braid.methods.dag import run_dag
from braid.methods.dag.presets import mad_iter, mad_par, notes_graph, notes_turns, tot
from braid.models.checkpoints import add_model_arguments, benchmark_model
from braid.models.tasks import generate
from braid.results import pyplot, write_json, written

SEED_RATIOS = {"mad-iter": 2.0, "tot": 3.5, "mad-par": 6.2}  # Prompt Choreography's TTFT speedups (Llama-3.1-8B, GPU)


def build(name: str, question: str, sampling: SamplingParams, output: str):
    if name == "mad-iter":
        return mad_iter(question, rounds=3, sampling=sampling, output=output)
    if name == "mad-par":
        return mad_par(question, agents=3, rounds=3, sampling=sampling, output=output)
    return tot(question, solutions=8, voters=4, sampling=sampling, output=output)


def run_once(eng: Engine, graph, nodes: list[str] | None = None) -> dict:
    """One run from a cleared prefix cache; TTFT averaged over `nodes` (default: every decoding node)."""
    eng.clear_prefix_cache()
    start = time.perf_counter()
    dag = run_dag(eng, graph)
    for _ in dag:
        pass
    seconds = time.perf_counter() - start
    dag.free(keep=())
    ttft = [dag.ttft[n] for n in nodes] if nodes is not None else list(dag.ttft.values())
    return {"ttft_mean_ms": 1e3 * statistics.mean(ttft), "ttft_total_ms": 1e3 * sum(ttft), "e2e_s": seconds,
            "decoding_nodes": len(ttft)}


TURN_MODES = {"kv": {}, "calibrated, base turns": {"calibrated": True, "turn_lora": False},
              "calibrated, turn LoRA": {"calibrated": True}}


def turn_costs(eng: Engine, names: list[str], solvers: int, sampling: SamplingParams, repeats: int, bar) -> list:
    """The debates over notes in TURN_MODES, alternating within each repeat (the first warms up)."""
    rows = []
    for name in names:
        texts = generate("chain", 0, solvers).workflow_texts()
        graphs = {mode: notes_graph(name, *texts, solver=sampling, final=sampling, **kw)
                  for mode, kw in TURN_MODES.items()}
        turns = [n.name for n in notes_turns(graphs["kv"])]
        runs = {mode: [] for mode in graphs}
        for r in range(repeats + 1):
            for mode, graph in graphs.items():
                got = run_once(eng, graph, turns)
                if r:
                    runs[mode].append(got)
                bar.update()
        med = {m: {k: statistics.median(x[k] for x in runs[m]) for k in runs[m][0]} for m in runs}
        base, lora = med["calibrated, base turns"], med["calibrated, turn LoRA"]
        rows.append({"workflow": name, "solvers": solvers, "modes": med,
                     "turn_ttft_ratio": lora["ttft_mean_ms"] / base["ttft_mean_ms"],
                     "e2e_ratio": lora["e2e_s"] / base["e2e_s"]})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--workflows", default="mad-iter,tot,mad-par", help="comma-separated (default: all three)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per reply (default: 64)")
    p.add_argument("--question-words", type=int, default=48, help="words in the question (default: 48)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per mode, after a warm-up (default: 2)")
    p.add_argument("--turns", action="store_true", help="also time the calibration's turn LoRA in the reference "
                   "tasks' debates (a random calibration and turn LoRA on the same weights)")
    p.add_argument("--turn-solvers", type=int, default=4, help="solvers in those debates (default: 4)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the plot")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    names = args.workflows.split(",")
    bad = [n for n in names if n not in SEED_RATIOS]
    if bad or args.max_tokens < 1 or args.repeats < 1:
        p.error(f"workflows must be among {', '.join(SEED_RATIOS)}; --max-tokens and --repeats >= 1")
    question = " ".join(f"fact{i % 17}" for i in range(args.question_words)) + "?"
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    debates = [n for n in names if n != "tot"] if args.turns else []
    with tempfile.TemporaryDirectory() as tmp:
        path, device = benchmark_model(args, tmp)
        eng = load_engine(EngineConfig(path, device=device, calibration="none", store_budget_bytes=16 << 30))
        calibrated = None  # (the same weights with a calibration and turn LoRA: the --turns runs' engine)
        if debates:
            from braid.train.calibrate import write_untrained
            from braid.train.turns import write_untrained_turns

            calibration = write_untrained(path, f"{tmp}/calibration", scale=0.02)
            write_untrained_turns(path, calibration, scale=0.02)
            calibrated = load_engine(EngineConfig(path, device=device, calibration=calibration,
                                                  store_budget_bytes=16 << 30))
    rows, turn_rows = [], []
    runs_total = (len(names) * 2 + len(debates) * len(TURN_MODES)) * (args.repeats + 1)
    with tqdm(total=runs_total, desc="workflows", unit="run") as bar:
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
        turn_rows = turn_costs(calibrated, debates, args.turn_solvers, sampling, args.repeats, bar)
    print(f"{'workflow':<10} {'TTFT text':>10} {'TTFT kv':>9} {'ratio':>7} {'seed':>6} {'E2E text':>9} "
          f"{'E2E kv':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['workflow']:<10} {r['baseline']['ttft_mean_ms']:>8.1f}ms {r['choreographed']['ttft_mean_ms']:>7.1f}ms "
              f"{r['ttft_ratio']:>6.2f}x {r['seed_ttft_ratio']:>5.1f}x {r['baseline']['e2e_s']:>8.2f}s "
              f"{r['choreographed']['e2e_s']:>7.2f}s {r['e2e_ratio']:>5.2f}x")
    for r in turn_rows:
        print(f"{r['workflow']} over notes, {r['solvers']} solvers: turns' TTFT "
              + ", ".join(f"{m} {v['ttft_mean_ms']:.1f} ms" for m, v in r["modes"].items())
              + f" (turn LoRA / base turns {r['turn_ttft_ratio']:.2f}x); E2E "
              + ", ".join(f"{v['e2e_s']:.2f} s" for v in r["modes"].values()) + f" ({r['e2e_ratio']:.2f}x)")
    stem = write_json(args.out, f"workflows_{device.split(':')[0]}", {
        "rows": rows, "turn_lora": turn_rows, "config": vars(args), "device": device, "dtype": str(eng.lm.dtype),
        "torch": torch.__version__}, device=device, model=eng.fingerprint,
        calibration=fingerprints(calibrated)["calibration"] if calibrated is not None else None)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.4))
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["ttft_ratio"] for r in rows], 0.4, label="Braid (this run)")
        ax.bar([i + 0.2 for i in x], [r["seed_ttft_ratio"] for r in rows], 0.4, label="Prompt Choreography (8B, GPU)")
        ax.set_xticks(list(x), [r["workflow"] for r in rows])
        ax.set(ylabel="TTFT speedup over text re-prefill", title=f"choreographed workflows ({device})")
        ax.axhline(1, color="gray", lw=0.8)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=110)
    print(written(stem + ".json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
