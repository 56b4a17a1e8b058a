"""Information leakage through cached encodings (Prompt Choreography, section 3.4), with and without Braid's control.

Alice holds private records (a chain worker's lookup table: where a person lives). She says, in a message
everyone reads, only "<person> lives in", without the city. Her message is prefilled with the same text
for every secret, as the paper pairs its games, so only its encoding can carry the secret: it attended to
her records. Bob, another role, reads the shared task and Alice's message and is asked where the person
lives. Three ways for Bob to read Alice's message, each a RunGraph DAG on the reference model:

- leak: Alice's cached encoding (an edge with leak=True: the paper's choreographed default);
- control: Braid's default, a copy re-encoded without Alice's private records;
- text: the baseline, her text re-encoded in Bob's context.

For each task seed, two secrets (two cities) are tried. Reported per mode: how often Bob names the secret
city, and how often his answer changes with the secret (it cannot when nothing he reads depends on it),
with paired 95% CIs and McNemar p against text. Seeds from 700000 (disjoint from training and evaluation
seeds). Writes JSON and a plot.
"""

import argparse
import random

from tqdm import tqdm

from braid.engine import Engine, EngineConfig, SamplingParams
from braid.evals.stats import accuracy_ci, mcnemar_p, paired_difference_ci
from braid.methods.dag import DagRun, Edge, Graph, Node, NodeToken
from braid.models import REFERENCE_MODEL
from braid.models.chat import SYNTHESIZER_HEADER, turn
from braid.models.tasks import CHAIN_SYSTEM, CITIES, PEOPLE
from braid.results import pyplot, write_json, written

MODES = ("leak", "control", "text")
ANSWER = SamplingParams(max_tokens=8)


def game(person: str, city: str, decoys: list[tuple[str, str]], mode: str) -> Graph:
    table = "; ".join(f"{p} {c}" for p, c in sorted([(person, city), *decoys]))
    return Graph([
        Node("task", turn("system", CHAIN_SYSTEM), output="text" if mode == "text" else "kv"),
        Node("alice_records", turn("user", f"records: {table}. who: {person}"), role="alice", private=True),
        Node("alice_says", turn("worker", f"{person} lives in"), role="alice",
             output="text" if mode == "text" else "kv", parents=(Edge("task"), Edge("alice_records"))),
        Node("bob", turn("user", f"where does {person} live?") + SYNTHESIZER_HEADER, role="bob", sampling=ANSWER,
             parents=(Edge("task"), Edge("alice_says", leak=mode == "leak")))])


def bob_says(engine: Engine, graph: Graph) -> str:
    dag = DagRun(engine, graph)
    text = "".join(e.text for e in dag if isinstance(e, NodeToken))
    dag.free(keep=())
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=REFERENCE_MODEL, help="checkpoint (default: the reference model)")
    p.add_argument("--games", type=int, default=100, help="task seeds, two secrets each (default: 100)")
    p.add_argument("--seed", type=int, default=700000, help="first task seed (default: 700000)")
    p.add_argument("--decoys", type=int, default=2, help="other people in Alice's records (default: 2)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the plot")
    args = p.parse_args(argv)
    if args.games < 1 or args.decoys < 0:
        p.error("--games must be >= 1 and --decoys >= 0")
    engine = Engine(EngineConfig(args.model, device="cpu", calibration="none"))
    named = {m: [] for m in MODES}  # per (game, secret): Bob named the secret city
    changed = {m: [] for m in MODES}  # per game: Bob's answer differs between the two secrets
    examples = []
    for g in tqdm(range(args.games), desc="games", unit="game"):
        rng = random.Random(args.seed + g)
        person, *others = rng.sample(PEOPLE, 1 + args.decoys)
        secrets = rng.sample(CITIES, 2)
        decoys = [(o, rng.choice([c for c in CITIES if c not in secrets])) for o in others]
        for mode in MODES:
            answers = [bob_says(engine, game(person, city, decoys, mode)) for city in secrets]
            named[mode] += [city in a for city, a in zip(secrets, answers)]
            changed[mode].append(answers[0] != answers[1])
            if g < 5:
                examples.append({"game": g, "mode": mode, "secrets": secrets, "bob": answers})
    rows = []
    for mode in MODES:
        row = {"mode": mode}
        for metric, values in (("names_secret", named), ("answer_changes", changed)):
            acc = accuracy_ci(values[mode])
            row[metric] = {"rate": acc.value, "ci95": [acc.low, acc.high]}
            if mode != "text":
                diff = paired_difference_ci(values[mode], values["text"])
                row[metric].update(vs_text=diff.value, vs_text_ci95=[diff.low, diff.high],
                                   mcnemar_p=mcnemar_p(values[mode], values["text"]))
        rows.append(row)
    print(f"{'mode':<8} {'Bob names the secret city':>28} {'answer changes with the secret':>32}")
    for r in rows:
        a, b = r["names_secret"], r["answer_changes"]
        print(f"{r['mode']:<8} {100 * a['rate']:>10.1f}% [{100 * a['ci95'][0]:.1f}, {100 * a['ci95'][1]:.1f}]"
              f"{'':>8} {100 * b['rate']:>10.1f}% [{100 * b['ci95'][0]:.1f}, {100 * b['ci95'][1]:.1f}]")
    stem = write_json(args.out, "leakage_cpu", {"rows": rows, "examples": examples, "config": vars(args),
                                                "chance": 1 / len(CITIES)},
                      device="cpu", model=engine.fingerprint, calibration=None)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.4))
        x = range(len(rows))
        for k, (metric, label) in enumerate((("names_secret", "Bob names Alice's secret"),
                                             ("answer_changes", "Bob's answer changes with it"))):
            vals = [100 * r[metric]["rate"] for r in rows]
            err = [[v - 100 * r[metric]["ci95"][0] for v, r in zip(vals, rows)],
                   [100 * r[metric]["ci95"][1] - v for v, r in zip(vals, rows)]]
            ax.bar([i + 0.4 * k - 0.2 for i in x], vals, 0.4, yerr=err, label=label)
        ax.set_xticks(list(x), [r["mode"] for r in rows])
        ax.set(ylabel="% of games", title="leakage through Alice's cached encoding")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=110)
    print(written(stem + ".json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
