"""Bring your own workflows, shown on the reference model: serve and record, calibrate from the traces alone, verify.

The path a user with their own model and workflows takes (docs/calibration.md, "Bring your own model"), end to end
on the reference model, where answers can be scored:

1. `record`: a server with recording on (the in-process server: the same RunWorkflow code path as a cluster, real
   gRPC and Redis) serves workflows sent as chat messages, with the text transport, so that each trace holds the
   answer text gives. The workflows are the reference model's own skills (chain, vote, trail) in a shape no
   calibration here has trained on: every branch's work 7 to 12 steps long (calibrations here train at most 8),
   2 to 12 branches, from a seed range no calibration or evaluation draws from. The traces calibration holds out
   with `--held-out-traces N` (models.traces.split: about one in N of each kind, branch count and task, by a hash
   of each workflow) are the only ones given reference answers (a user's labelled evaluation set); the rest are
   trained on without labels: the target is the model's own text answer (self-distillation). The split does not
   read the references, so adding them leaves it as it was.
2. `calibrate`: `braid calibrate --traces ... --sources none` (the command, in its own process): a fresh mapper
   and LoRA from the traces alone.
3. `verify`: `braid eval --traces ... --verify --verification held-out-traces` on the held-out traces: text, the
   calibrated cache path, and the same cache path uncalibrated (with and without the boundary refresh), every mode
   held to text's answer; the envelope from the paired lower bound per branch-count band (evals.harness.verify),
   recorded beside the calibration.
4. `report`: agreement with text over all held-out traces and per family, paired 95% intervals (bootstrap), text's
   own accuracy against the references beside it, and the envelope's bands; JSON in benchmarks/results.

    python benchmarks/trace_quality.py --work /tmp/traces-demo --workflows 1200 --steps 800

Each stage keeps its output under --work and is skipped when that is there (the calibration resumes), so a run cut
short goes on where it stopped.
"""

import argparse
import json
import logging
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from braid.evals.harness import format_bands
from braid.evals.stats import accuracy_ci, paired_difference_ci
from braid.models import REFERENCE_MODEL
from braid.models.tasks import generate
from braid.models.traces import SPLIT_RULE
from braid.results import write_json

log = logging.getLogger(__name__)
FAMILIES = ("chain", "vote", "trail")
SEEDS = 9_000_000  # first task seed: no calibration (CALIBRATION_SEEDS and up) or evaluation here draws from here
LENGTH = (7, 12)


def workflows(n: int, seed: int) -> list[tuple[str, object]]:
    """n (family, task) pairs, families in turn, 2-12 branches, each branch's work 7-12 steps."""
    rng = random.Random(f"trace-quality:{seed}")
    return [(FAMILIES[i % len(FAMILIES)], generate(FAMILIES[i % len(FAMILIES)], seed + i, rng.randint(2, 12), LENGTH))
            for i in range(n)]


def _key(task_messages, branches, synthesis) -> str:
    return json.dumps([[m["content"] for m in task_messages], [[m["content"] for m in b] for b in branches],
                       [m["content"] for m in synthesis]])


def record(work: str, n: int, seed: int, held_out: int, concurrency: int) -> str:
    """Serve n workflows with recording on; write work/traces.jsonl (references on the lines calibration and
    verification hold out with --held-out-traces `held_out` only) and work/families.json (each line's family).
    Returns the traces' path."""
    import grpc

    from braid.cluster.inprocess import start_in_process
    from braid.engine import EngineConfig
    from braid.methods.calibration import load_engine
    from braid.models.chat import WORKER_HEADER
    from braid.models.traces import load_trace_workflows, split
    from braid.protos import agent_pb2 as pb
    from braid.protos import agent_pb2_grpc
    from braid.runtime.directory import Directory, EmbeddedRedis

    out = os.path.join(work, "traces.jsonl")
    if os.path.exists(out):
        log.info("%s is there: not recorded again", out)
        return out
    tasks = workflows(n, seed)
    redis = EmbeddedRedis()
    engine = load_engine(EngineConfig(REFERENCE_MODEL, device="cpu", calibration="none"))
    server = start_in_process(engine, Directory.connect(redis.url), record_dir=os.path.join(work, "recorded"))
    reference, family = {}, {}
    chat = lambda role, content: [pb.ChatMessage(role=role, content=content)]  # noqa: E731
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)

            def serve(item) -> None:
                name, task = item
                request = pb.WorkflowRequest(
                    task_messages=chat("system", task.system),
                    branch_messages=[pb.Conversation(messages=chat("user", b.context)) for b in task.branches],
                    synthesis_messages=chat("user", task.question), transport=pb.TRANSPORT_TEXT,
                    worker_sampling=pb.Sampling(max_tokens=48), synthesis_sampling=pb.Sampling(max_tokens=160))
                list(stub.RunWorkflow(request, timeout=600))
                key = _key([{"content": task.system}], [[{"content": b.context}] for b in task.branches],
                           [{"content": task.question}])
                reference[key], family[key] = task.answer, name

            with ThreadPoolExecutor(concurrency) as pool:
                list(tqdm(pool.map(serve, tasks), total=len(tasks), desc="serving", unit="workflow"))
        server.recorder.close()
        path = server.recorder.path
    finally:
        server.stop()
        redis.stop()
    lines = [json.loads(x) for x in open(path) if x.strip()]
    if len(lines) != n:
        raise RuntimeError(f"{n} workflows served, {len(lines)} recorded (see braid_traces_dropped_total)")
    # only the lines calibration holds out carry a reference (models.traces.split, as braid calibrate and braid eval
    # read the file: by the workflows' contents, which a reference does not change); the rest are trained on as a
    # user's unlabelled traffic
    with open(out + ".tmp", "w") as f:
        f.writelines(json.dumps({**line, "reference": None}) + "\n" for line in lines)
    read = load_trace_workflows([out + ".tmp"], engine.lm.tokenizer, engine.fingerprint, WORKER_HEADER,
                                REFERENCE_MODEL)
    if len(read) != len(lines):
        raise RuntimeError(f"{len(lines)} lines recorded, {len(read)} workflows read back")
    held = {id(w) for w in split(read, held_out)[1]}
    families = []
    with open(out + ".tmp", "w") as f:
        for line, workflow in zip(lines, read):
            key = _key(line["task_messages"], [b["messages"] for b in line["branches"]],
                       line["synthesis"]["messages"])
            families.append(family[key])
            line["reference"] = reference[key] if id(workflow) in held else None
            f.write(json.dumps(line) + "\n")
    json.dump(families, open(os.path.join(work, "families.json"), "w"))
    os.replace(out + ".tmp", out)
    return out


def braid(args: list[str]) -> None:
    """The `braid` command, as a user runs it (its own process)."""
    if subprocess.run([sys.executable, "-m", "braid", *args]).returncode:
        raise RuntimeError(f"braid {' '.join(args)} failed")


def calibrate(work: str, traces: str, held_out: int, steps: int, tasks_per_step: int, refresh: int) -> str:
    out = os.path.join(work, "calibration")
    args = ["calibrate", "--model", REFERENCE_MODEL, "--out", out, "--traces", traces, "--sources", "none",
            "--held-out-traces", str(held_out), "--placements", "mixed", "--steps", str(steps),
            "--tasks-per-step", str(tasks_per_step), "--eval-every", str(max(1, steps // 4)),
            "--refresh", str(refresh), "--device", "cpu"]
    braid(args)
    return out


VERIFICATION = "held-out-traces"  # the name the verification is recorded under, beside the calibration


def verify(work: str, traces: str, calibration: str, held_out: int, mode: str) -> str:
    out = os.path.join(work, "eval.json")
    if os.path.exists(out):
        return out
    args = ["eval", "--model", REFERENCE_MODEL, "--calibration", calibration, "--traces", traces,
            "--held-out-traces", str(held_out), "--modes", f"text,cache:mixed,cache:mixed+refresh,{mode}",
            "--verify", "--verify-mode", mode, "--verification", VERIFICATION, "--json", out, "--device", "cpu"]
    braid(args)  # (its JSON is written whole or not at all: braid.results)
    return out


def summarize(evaluation: dict, families: list[str], referenced: list[bool], mode: str) -> dict:
    """Agreement with text per mode, over all held-out traces and per family, with paired 95% intervals, and
    text's accuracy against the references. `referenced`: which lines of the trace file carry a reference (the
    held-out ones, which braid eval ran in file order)."""
    results = evaluation["results"]
    held = [f for f, r in zip(families, referenced) if r]
    if len(held) != len(results) or any(r["reference_correct"] is None for r in results):
        raise ValueError(f"{len(results)} evaluated traces, {len(held)} held out with references: not the same "
                         "split")
    modes = [m for m in evaluation["modes"] if m != "text"]

    def rows(group: list[dict]) -> dict:
        text = [r["correct"]["text"] for r in group]
        ref = accuracy_ci([r["reference_correct"] for r in group])
        out = {"n": len(group), "text_reference_accuracy": ref.value, "text_reference_ci95": [ref.low, ref.high]}
        for m in modes:
            agree = [r["correct"][m] for r in group]
            d = paired_difference_ci(agree, text)
            out[m] = {"agreement": sum(agree) / len(agree), "minus_text": d.value, "minus_text_ci95": [d.low, d.high]}
        return out

    summary = {"all": rows(results)}
    for name in FAMILIES:
        group = [r for r, f in zip(results, held) if f == name]
        if group:
            summary[name] = rows(group)
    return {"calibrated_mode": mode, "uncalibrated_modes": ["cache:mixed", "cache:mixed+refresh"],
            "summary": summary}


def plot(result: dict, path: str) -> None:
    """Agreement with text per family and mode, with the paired intervals."""
    from braid.results import pyplot

    plt = pyplot()
    if plt is None:
        return
    modes = [result["calibrated_mode"], *result["uncalibrated_modes"]]
    groups = [g for g in ("all", *FAMILIES) if g in result["summary"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(modes)
    for k, m in enumerate(modes):
        rows = [result["summary"][g][m] for g in groups]
        xs = [i + (k - (len(modes) - 1) / 2) * width for i in range(len(groups))]
        low = [r["agreement"] - (1 + r["minus_text_ci95"][0]) for r in rows]
        high = [(1 + r["minus_text_ci95"][1]) - r["agreement"] for r in rows]
        ax.bar(xs, [r["agreement"] for r in rows], width, yerr=[low, high], capsize=3,
               label=m if k else f"{m} (calibrated from traces)")
    ax.set_xticks(range(len(groups)), [f"{g}\n(n = {result['summary'][g]['n']})" for g in groups])
    ax.set_ylabel("answers agreeing with text")
    ax.set_ylim(0, 1.05)
    ax.set_title("held-out traces: the KV path against text re-prefill")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/braid-trace-quality", help="where each stage keeps its output")
    p.add_argument("--workflows", type=int, default=1200, help="workflows served and recorded (default: 1200)")
    p.add_argument("--seed", type=int, default=SEEDS, help=f"first task seed (default: {SEEDS})")
    p.add_argument("--held-out", type=int, default=3,
                   help="about one trace in N of each kind is held out: braid calibrate and eval "
                        "--held-out-traces N (default: 3)")
    p.add_argument("--concurrency", type=int, default=4, help="workflows in flight while recording (default: 4)")
    p.add_argument("--steps", type=int, default=800, help="calibration steps (default: 800)")
    p.add_argument("--tasks-per-step", type=int, default=8, help="traces per calibration step (default: 8)")
    p.add_argument("--refresh", type=int, default=1, help="boundary refresh the calibration reads (default: 1)")
    p.add_argument("--out", default="benchmarks/results", help="results folder (default: benchmarks/results)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    os.makedirs(args.work, exist_ok=True)
    traces = record(args.work, args.workflows, args.seed, args.held_out, args.concurrency)
    calibration = calibrate(args.work, traces, args.held_out, args.steps, args.tasks_per_step, args.refresh)
    from braid.methods.calibration import Calibration, mode_name
    from braid.methods.synthesis import refresh_of

    mode = mode_name(refresh_of(args.refresh))
    evaluation = json.load(open(verify(args.work, traces, calibration, args.held_out, mode)))
    families = json.load(open(os.path.join(args.work, "families.json")))
    referenced = [json.loads(x)["reference"] is not None for x in open(traces) if x.strip()]
    cal = Calibration.load(calibration)
    verification = evaluation["verification"]  # (what braid eval recorded beside the calibration, as VERIFICATION)
    result = {"config": {**vars(args), "families": list(FAMILIES), "length": list(LENGTH)},
              "held_out": "%d of %d lines of the trace file, none trained on (about one in %d of each kind, branch "
                          "count and task, by a hash of each workflow: %s); task seeds %d-%d, a range no other "
                          "calibration or evaluation here draws from" % (
                              sum(referenced), len(referenced), args.held_out, SPLIT_RULE, args.seed,
                              args.seed + args.workflows - 1),
              "calibration_record": {k: cal.record.get(k) for k in ("steps", "train_seconds", "traces",
                                                                    "held_out_accuracy")},
              "verification": verification, "verification_name": VERIFICATION,
              **summarize(evaluation, families, referenced, mode)}
    from braid.engine import EngineConfig
    from braid.methods.calibration import fingerprints_at

    path = write_json(args.out, "eval_trace_quality_cpu", result, device="cpu",
                      **fingerprints_at(EngineConfig(REFERENCE_MODEL, calibration=calibration)))
    plot(result, path + ".png")
    s = result["summary"]["all"]
    print(f"{s['n']} held-out traces; text right against the references {s['text_reference_accuracy']:.1%}")
    for m in [mode, "cache:mixed", "cache:mixed+refresh"]:
        print(f"  {m}: agrees with text {s[m]['agreement']:.1%}, minus text {100 * s[m]['minus_text']:+.1f} points "
              f"(95% CI {100 * s[m]['minus_text_ci95'][0]:+.1f} to {100 * s[m]['minus_text_ci95'][1]:+.1f})")
    print(format_bands(verification))
    print(f"{mode} verified up to {verification['max_branches']} branches")
    print(f"wrote {path}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
