"""RunGraph with its waves decoded on the Worker replicas, against the same graphs on the synthesizer alone.

One local cluster (Ray, Serve's gRPC proxy, embedded Redis) serves two Serve applications of one model side by
side: `braid` decodes each graph's waves on the Worker replicas (cluster config `graph_on_workers`, the
default: parents fetched from the synthesizer, outputs shipped back over gRPC), `braid-here` decodes them on
the session's Synthesizer replica, each wave in one batch. Prompt Choreography's workflows (methods.dag.presets:
MADiter, MADpar, ToT; choreographed, every message read through its cached encoding) alternate between the two, through
the agent API as a client sends them. Per graph: E2E; TTFT per decoding node, from the arrival of its last
parent's node-done event (the graph's start for the first wave) to its first token, averaged over the graph's
decoding nodes; and which replicas decoded the nodes. Medians over --repeats after a warm-up. Writes JSON and a
plot. On one machine's shared cores this shows what moving the KV costs, not what separate devices gain.
"""

import argparse
import logging
import os
import statistics
import tempfile
import time

import grpc
import torch
from ray import serve
from tqdm import tqdm

from braid.cluster.app import build_app
from braid.cluster.config import ClusterConfig
from braid.cluster.local import free_port, start_local_cluster
from braid.engine import SamplingParams
from braid.engine.model import fingerprint_checkpoint
from braid.methods.dag.presets import mad_iter, mad_par, tot
from braid.models.checkpoints import add_model_arguments, benchmark_model
from braid.protos import agent_pb2 as pb
from braid.protos import agent_pb2_grpc
from braid.results import grouped_bars, write_json, written
from braid.runtime.convert import graph_request

APPS = {"workers": "braid", "synthesizer": "braid-here"}


def build(name: str, question: str, sampling: SamplingParams):
    if name == "mad-iter":
        return mad_iter(question, rounds=3, sampling=sampling)
    if name == "mad-par":
        return mad_par(question, agents=3, rounds=3, sampling=sampling)
    return tot(question, solutions=4, voters=2, sampling=sampling)


def run_once(stub, request, app: str) -> dict:
    parents = {n.name: [p.node for p in n.parents if p.node] for n in request.nodes}
    done_at: dict[str, float] = {}
    first: dict[str, float] = {}
    where: dict[str, str] = {}
    start = time.perf_counter()
    for event in stub.RunGraph(request, metadata=(("application", app),), timeout=600):
        now = time.perf_counter()
        kind = event.WhichOneof("event")
        if kind == "token":
            first.setdefault(event.token.node, now)
        elif kind == "node_done":
            done_at[event.node_done.node] = now
            where[event.node_done.node] = event.node_done.replica or "synthesizer"
        elif kind == "done":
            stub.CloseSession(pb.CloseSessionRequest(session_id=event.done.session_id),
                              metadata=(("application", app),))
    e2e = time.perf_counter() - start
    ttft = [first[n] - max([done_at[p] for p in parents[n]], default=start) for n in first]
    return {"e2e_s": e2e, "ttft_mean_ms": 1e3 * statistics.mean(ttft),
            "first_token_ms": 1e3 * (min(first.values()) - start), "nodes_by_replica": {r: sum(1 for n in first if where[n] == r) for r in sorted(set(where[n] for n in first))}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--workflows", default="mad-iter,mad-par,tot", help="comma-separated (default: all three)")
    p.add_argument("--workers", type=int, default=2, help="Worker replicas (default: 2)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per reply (default: 32)")
    p.add_argument("--question-words", type=int, default=48, help="words in the question (default: 48)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per mode, after a warm-up (default: 3)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the plot")
    args = p.parse_args(argv)
    names = args.workflows.split(",")
    bad = [n for n in names if n not in ("mad-iter", "mad-par", "tot")]
    if bad or args.max_tokens < 1 or args.repeats < 1 or args.workers < 1:
        p.error("workflows must be among mad-iter, mad-par, tot; --max-tokens, --repeats and --workers >= 1")
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # (loopback only; the tests run this way too)
    question = " ".join(f"fact{i % 17}" for i in range(args.question_words)) + "?"
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path, device = benchmark_model(args, tmp)
        weights = fingerprint_checkpoint(path)
        config = ClusterConfig(path, worker_replicas=args.workers, grpc_port=free_port(), kv_transport="grpc",
                               calibration="none")
        cluster = start_local_cluster(config, num_cpus=2, temp_dir=os.path.join(tmp, "ray"))
        try:
            here = ClusterConfig(path, worker_replicas=1, grpc_port=config.grpc_port, calibration="none",
                                 graph_on_workers=False)
            serve.run(build_app(here, cluster.redis_url), name=APPS["synthesizer"],
                      route_prefix=f"/{APPS['synthesizer']}")
            channel = grpc.insecure_channel(cluster.address)
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            with tqdm(total=len(names) * 2 * (args.repeats + 1), desc="graphs", unit="graph") as bar:
                for name in names:
                    request = graph_request(build(name, question, sampling))
                    runs = {mode: [] for mode in APPS}
                    for r in range(args.repeats + 1):  # alternating; the first pair warms up
                        for mode, app in APPS.items():
                            got = run_once(stub, request, app)
                            if r:
                                runs[mode].append(got)
                            bar.update()
                    med = {m: {k: statistics.median(x[k] for x in runs[m]) for k in ("e2e_s", "ttft_mean_ms",
                                                                                     "first_token_ms")}
                           for m in runs}
                    for m in runs:
                        med[m]["nodes_by_replica"] = runs[m][-1]["nodes_by_replica"]
                    rows.append({"workflow": name, **med,
                                 "e2e_ratio": med["workers"]["e2e_s"] / med["synthesizer"]["e2e_s"],
                                 "ttft_ratio": med["workers"]["ttft_mean_ms"] / med["synthesizer"]["ttft_mean_ms"]})
            channel.close()
        finally:
            cluster.stop()
    print(f"{'workflow':<9} {'E2E synth':>10} {'E2E workers':>12} {'ratio':>6} {'TTFT synth':>11} "
          f"{'TTFT workers':>13} {'ratio':>6}  nodes on the workers")
    for r in rows:
        print(f"{r['workflow']:<9} {r['synthesizer']['e2e_s']:>9.2f}s {r['workers']['e2e_s']:>11.2f}s "
              f"{r['e2e_ratio']:>5.2f}x {r['synthesizer']['ttft_mean_ms']:>9.1f}ms "
              f"{r['workers']['ttft_mean_ms']:>11.1f}ms {r['ttft_ratio']:>5.2f}x  {r['workers']['nodes_by_replica']}")
    stem = write_json(args.out, f"graph_workers_{device.split(':')[0]}", {
        "rows": rows, "config": vars(args), "device": device, "torch": torch.__version__},
        device=device, model=weights, calibration=None)
    model = "checkpoint" if args.checkpoint else args.shape
    grouped_bars(stem, f"RunGraph waves: where they decode ({device}, {model})", [r["workflow"] for r in rows],
                 [(label, {"on the synthesizer": [r["synthesizer"][key] for r in rows],
                           f"on {args.workers} Worker replica(s)": [r["workers"][key] for r in rows]})
                  for key, label in (("e2e_s", "E2E (s)"), ("ttft_mean_ms", "mean node TTFT (ms)"))])
    print(written(stem + ".json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
