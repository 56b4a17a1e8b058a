"""KVComm's quality on its reference task: every agent prompt dense and through the anchors, paired.

Agents with fixed roles read the same user text under their own prefixes (models.tasks.SharedTextTask).
Requests come one after another, as in serving, so each config's anchor pool grows online from the
requests it fell back on. Each config starts from an empty pool; the dense answers are shared by all.
Reports accuracy with a paired bootstrap interval against dense, the reuse rate and the pool's memory,
for a sweep of gamma and capacity (KVComm, Table 3).

    python -m braid.evals.kvcomm_quality --out benchmarks/results/eval_kvcomm_cpu.json
"""

import argparse
import json
import logging
import time
from dataclasses import asdict

import torch
from tqdm import tqdm

from braid.engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
from braid.evals.stats import accuracy_ci, mcnemar_p, paired_difference_ci
from braid.methods.kvcomm import AgentPrompt, KVComm, KVCommConfig
from braid.models.chat import turn
from braid.models.tasks import DEFAULT_LENGTH, MULTIQA_SYSTEM, SharedTextTask, shared_text_task
from braid.results import write_json_to

log = logging.getLogger(__name__)
SAMPLING = SamplingParams(max_tokens=64)


def reply(engine: Engine, message_id: str) -> str:
    return engine.text(message_id).split("<|synthesizer|>", 1)[-1]


BASES = ("first-agent", "system")  # what a text's base KV is read behind: as an agent graph serves it, or the
# system prompt alone (the neutral base the earlier results used)


def prompts(task: SharedTextTask, base: str = BASES[0]) -> list[AgentPrompt]:
    behind = task.prefix(0) if base == "first-agent" else turn("system", MULTIQA_SYSTEM)
    return [AgentPrompt(f"agent{j}", task.prefix(j), [("user", task.shared)], [task.reply_header()], SAMPLING,
                        base_prefix=behind) for j in range(len(task.roles))]


def dense(engine: Engine, tasks: list[SharedTextTask]) -> list[bool]:
    """Every agent's answer from a dense prefill of its whole prompt (the role prefix from the prefix cache)."""
    out = []
    for task in tqdm(tasks, desc="dense", unit="request"):
        for j, p in enumerate(prompts(task)):
            pre = engine.prefill([PrefillCall(p.prefix)])
            ctx = engine.prefill([PrefillCall(task.shared, parents=pre)])
            ids = engine.decode([DecodeCall(task.reply_header(), parents=pre + ctx, sampling=SAMPLING)])
            out.append(task.correct(j, reply(engine, ids[0])))
            for mid in [*pre, *ctx, *ids]:
                engine.free(mid)
    return out


class RandomRecompute(KVComm):
    """The `recompute` ablation: the same number of tokens re-encoded, drawn at random instead of by doubt."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.rng = torch.Generator().manual_seed(0)

    def _recomputed(self, doubt):
        return super()._recomputed(torch.rand(doubt.shape, generator=self.rng))


def kvcomm(engine: Engine, tasks: list[SharedTextTask], config: KVCommConfig, random_recompute: bool = False,
           base: str = BASES[0]) -> dict:
    comm = (RandomRecompute if random_recompute else KVComm)(engine, config)
    correct, reused, seconds = [], [], []
    for task in tqdm(tasks, desc=f"kvcomm gamma={config.gamma} V={config.capacity}", unit="request"):
        for j, p in enumerate(prompts(task, base)):
            prep, stream = comm.decode_stream(p, scope="eval")
            for _ in stream:
                pass
            correct.append(task.correct(j, reply(engine, stream.ids[0])))
            reused.append(prep.reused)
            seconds.append(prep.seconds)
            for mid in [*prep.owned, *stream.ids]:
                engine.free(mid)
    return {"correct": correct, "reused": reused, "pool_bytes": comm.nbytes, "prepare_seconds": seconds}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m braid.evals.kvcomm_quality", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/braid-reference")
    ap.add_argument("--requests", type=int, default=60, help="requests per config (each: one prompt per agent)")
    ap.add_argument("--agents", type=int, default=5)
    ap.add_argument("--questions", type=int, default=3, help="user questions in the shared text")
    ap.add_argument("--words", default="{},{}".format(*DEFAULT_LENGTH),
                    help="least and most aside words per user question (longer texts: recompute picks windows "
                         "once a text passes 64 tokens)")
    ap.add_argument("--seed", type=int, default=7000, help="first task seed (the model never saw these tasks)")
    ap.add_argument("--gammas", default="0,0.1,0.3,0.4,0.5,0.7,0.9")
    ap.add_argument("--capacities", default="0,5,10,20,40")
    ap.add_argument("--temperature", type=float, default=KVCommConfig.temperature)
    ap.add_argument("--refresh", default=str(KVCommConfig.refresh),
                    help="comma-separated tokens re-encoded at each end of a reused text (each a config; 0: none)")
    ap.add_argument("--recompute", default=str(KVCommConfig.recompute),
                    help="comma-separated fractions of a reused text's tokens re-encoded, the least certain first "
                         "(each a config; 0: none)")
    ap.add_argument("--random-recompute", action="store_true",
                    help="ablation: re-encode as many tokens as --recompute says, drawn at random, not by doubt")
    ap.add_argument("--base", choices=BASES, default=BASES[0],
                    help="what each text's base KV is read behind: the first agent's prefix (as an agent graph serves "
                         "it; default) or the system prompt alone")
    ap.add_argument("--out", default="benchmarks/results/eval_kvcomm_cpu.json")
    args = ap.parse_args(argv)
    try:
        words = tuple(int(w) for w in args.words.split(","))
        if len(words) != 2 or not 0 <= words[0] <= words[1]:
            raise ValueError
    except ValueError:
        ap.error(f"--words takes the least and most words as 'A,B' with 0 <= A <= B, got {args.words!r}")
    logging.basicConfig(level=logging.INFO)
    engine = Engine(EngineConfig(args.model))
    tasks = [shared_text_task(args.seed + i, args.agents, args.questions, words) for i in range(args.requests)]
    base = dense(engine, tasks)
    recomputes = [float(x) for x in args.recompute.split(",")]
    configs = [KVCommConfig(g, 20, args.temperature, r, c) for r in map(int, args.refresh.split(","))
               for c in recomputes for g in map(float, args.gammas.split(","))]
    configs += [KVCommConfig(KVCommConfig.gamma, v, args.temperature, r, c)
                for r in map(int, args.refresh.split(",")) for c in recomputes
                for v in map(int, args.capacities.split(",")) if v != 20]
    rows = []
    for config in configs:
        start = time.perf_counter()
        r = kvcomm(engine, tasks, config, args.random_recompute, args.base)
        acc, diff = accuracy_ci(r["correct"]), paired_difference_ci(r["correct"], base)
        rows.append({**asdict(config), "base": args.base,
                     "recompute_by": "random" if args.random_recompute else "doubt",
                     "accuracy": asdict(acc), "minus_dense": asdict(diff),
                     "mcnemar_p": mcnemar_p(r["correct"], base), "reuse_rate": sum(r["reused"]) / len(r["reused"]),
                     "accuracy_when_reused": (sum(c for c, u in zip(r["correct"], r["reused"]) if u)
                                              / max(1, sum(r["reused"]))),
                     "pool_bytes": r["pool_bytes"], "seconds": time.perf_counter() - start})
        log.info("%s", rows[-1])
    out = {"model": args.model, "fingerprint": engine.fingerprint, "requests": args.requests, "base": args.base,
           "agents": args.agents, "questions": args.questions, "words": list(words),
           "shared_tokens": [len(engine.tokenize(t.shared)) for t in tasks],
           "seeds": [args.seed, args.seed + args.requests - 1],
           "dense_accuracy": asdict(accuracy_ci(base)), "configs": rows}
    write_json_to(args.out, out, device=str(engine.lm.device), model=engine.fingerprint, calibration=None)
    plot(out, args.out.removesuffix(".json") + ".png")
    print(json.dumps({"dense": out["dense_accuracy"]["value"],
                      "configs": [(r["gamma"], r["capacity"], r["refresh"], r["recompute"],
                                   round(r["accuracy"]["value"], 3),
                                   round(r["reuse_rate"], 3)) for r in rows]}))


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, fixed, label in ((axes[0], "gamma", ("capacity", 20), "gamma (V=20)"),
                                  (axes[1], "capacity", ("gamma", KVCommConfig.gamma),
                                   f"capacity V (gamma={KVCommConfig.gamma})")):
        rows = sorted((r for r in out["configs"] if r[fixed[0]] == fixed[1] and not r.get("refresh")),
                      key=lambda r: r[key])
        x = [r[key] for r in rows]
        ax.plot(x, [100 * r["accuracy"]["value"] for r in rows], "o-", label="KVComm accuracy")
        ax.fill_between(x, [100 * r["accuracy"]["low"] for r in rows], [100 * r["accuracy"]["high"] for r in rows],
                        alpha=0.2)
        ax.plot(x, [100 * r["reuse_rate"] for r in rows], "s--", label="reuse rate")
        ax.axhline(100 * out["dense_accuracy"]["value"], color="gray", ls=":", label="dense accuracy")
        ax.set_xlabel(label)
        ax.set_ylabel("%")
        ax.legend(fontsize=8)
    fig.suptitle(f"KVComm on the shared-text task ({out['agents']} agents, {out['requests']} requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
