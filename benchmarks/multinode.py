"""Braid across Ray nodes, deployed as Kubernetes would deploy it, on one machine:

1. the Helm chart is rendered (helm-python-sdk) for a local model and Redis;
2. a Ray cluster of three nodes starts (a head, and one node per chart node group, each offering the custom
   resource the chart's rayStartParams give that group);
3. the chart's serveConfigV2 goes to it with `serve deploy`;
4. a parallel-synthesis workflow runs through the agent API with KV over gRPC, so each branch's KV crosses from
   the workers' node to the synthesizer's node;
5. the same workflow runs on one process with one engine (the KV reused in place), and the answers are compared.

Prints which node ran what, the KV bytes that crossed and both answers; writes JSON and a plot.
"""

import argparse
import os
import secrets
import sys
import tempfile

import grpc
import yaml

from braid.api.auth import client_metadata
from braid.cluster.inprocess import start_in_process
from braid.cluster.local import free_port
from braid.cluster.multinode import NodeGroup, placement, serve_deploy, start_multinode
from braid.engine import EngineConfig
from braid.loadtest.workload import task_request
from braid.methods.calibration import fingerprints_at, load_engine
from braid.models import REFERENCE_MODEL
from braid.models.tasks import generate
from braid.protos import agent_pb2 as pb
from braid.protos import agent_pb2_grpc
from braid.results import pyplot, write_json, written
from braid.runtime.directory import Directory, EmbeddedRedis

CHART = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "helm", "braid")



def render_chart(values: dict) -> tuple[dict, dict]:
    """(the serve deploy config, the RayService) the chart renders for `values`."""
    import helm_python as helm

    docs = helm.Chart.load(CHART).render(values, name="braid", namespace="serving")
    rayservice = yaml.safe_load(docs["braid/templates/rayservice.yaml"])
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"]), rayservice


def workflow(address: str, request: pb.WorkflowRequest, key: str | None = None) -> list[pb.WorkflowEvent]:
    with grpc.insecure_channel(address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        return list(stub.RunWorkflow(request, metadata=(("application", "braid"), *client_metadata(key)), timeout=600))


def _local_keys(serve_config: dict, path: str) -> str:
    """A key in a file at `path`, named wherever the rendered config names its API key file: the chart mounts its
    key Secret there, and local nodes share this machine's files instead. Returns the key."""
    key = secrets.token_urlsafe(32)
    with open(path, "w") as f:
        f.write(f"multinode:{key}\n")

    def point(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "api_keys_file":
                    node[k] = path
                else:
                    point(v)
        elif isinstance(node, list):
            for v in node:
                point(v)

    point(serve_config)
    return key


def answer(events) -> list[int]:
    return [e.synthesis_token.token_id for e in events if e.HasField("synthesis_token")]


def run(model_path: str, redis_url: str, request: pb.WorkflowRequest, config: dict | None = None) -> dict:
    """Deploy the chart's config across three local nodes, run `request` (KV over gRPC) and the same request on
    one engine; returns what ran where, the KV receipts and both answers."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local nodes on one machine (the chart keeps it on)
    grpc_port = free_port()
    serve_config, rayservice = render_chart({
        "model": {"path": os.path.abspath(model_path)}, "grpcPort": grpc_port, "rayAuth": "disabled",
        "redis": {"mode": "external", "external": {"url": redis_url}},
        "config": {"kv_transport": "grpc", **(config or {})}})
    # One machine: its nodes share its ports, so one proxy (the head's) and a free HTTP port. All else as rendered.
    serve_config.update(proxy_location="HeadOnly", http_options={"host": "0.0.0.0", "port": free_port()})
    groups = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    nodes = [NodeGroup(g["groupName"], 0, yaml.safe_load(yaml.safe_load(g["rayStartParams"]["resources"])))
             for g in groups]
    with tempfile.TemporaryDirectory() as tmp:
        key = _local_keys(serve_config, os.path.join(tmp, "api-keys"))
        path = os.path.join(tmp, "serve.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(serve_config, f)
        multi = start_multinode(NodeGroup("head", 2), nodes, free_port())
        try:
            serve_deploy(path, multi.dashboard_url)
            events = workflow(f"{multi.ip}:{grpc_port}", request, key)
            where = placement(multi)
        finally:
            multi.shutdown()
    receipts = [{"branch": r.branch, "bytes": r.bytes, "transfer_ms": r.transfer_ms,
                 "digest_ok": r.crc32 == r.crc32_sent, "transport": pb.Transport.Name(r.transport)}
                for e in events if e.HasField("kv_receipt") for r in [e.kv_receipt]]
    multi_answer = answer(events)
    multi_text = events[-1].done.answer_text if events and events[-1].HasField("done") else ""

    engine = load_engine(EngineConfig(model_path))
    single = start_in_process(engine, Directory.connect(redis_url))
    try:
        local = pb.WorkflowRequest()
        local.CopyFrom(request)
        local.transport = pb.TRANSPORT_LOCAL
        single_events = workflow(f"127.0.0.1:{single.port}", local)
    finally:
        single.stop()
    return {"placement": where, "nodes": sorted(set(multi.nodes.values())),
            "decision": pb.Transport.Name(events[0].decision.transport), "kv_receipts": sorted(
                receipts, key=lambda r: r["branch"]), "kv_bytes_crossed": sum(r["bytes"] for r in receipts),
            "answer_tokens": multi_answer, "answer_text": multi_text,
            "single_node_answer_tokens": answer(single_events),
            "single_node_answer_text": single_events[-1].done.answer_text,
            "answers_equal": multi_answer == answer(single_events)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=REFERENCE_MODEL, help="checkpoint (default: the reference model)")
    p.add_argument("--task", default="chain", help="reference task (default: chain)")
    p.add_argument("--branches", type=int, default=4, help="parallel branches (default: 4)")
    p.add_argument("--seed", type=int, default=5000, help="task seed (default: 5000)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and the plot")
    args = p.parse_args(argv)
    task = generate(args.task, args.seed, args.branches, (2, 6))
    request = task_request(task, pb.Sampling(max_tokens=48), pb.Sampling(max_tokens=160), pb.TRANSPORT_GRPC)
    redis = EmbeddedRedis()
    try:
        result = run(args.model, redis.url, request)
    finally:
        redis.stop()
    result.update(task=args.task, seed=args.seed, branches=args.branches, expected=task.answer)
    print("where each deployment's replicas ran (node groups):")
    for name, groups in result["placement"].items():
        print(f"  {name:<14} {', '.join(groups)}")
    print(f"transport: {result['decision']}")
    for r in result["kv_receipts"]:
        print(f"  branch {r['branch']}: {r['bytes']} KV bytes, workers' node -> synthesizers' node over "
              f"{r['transport']} in {r['transfer_ms']:.1f} ms, digest {'ok' if r['digest_ok'] else 'MISMATCH'}")
    print(f"KV bytes that crossed nodes: {result['kv_bytes_crossed']}")
    print(f"answer, 3 nodes:  {result['answer_text'].strip()!r}\nanswer, 1 engine: "
          f"{result['single_node_answer_text'].strip()!r}\nequal token for token: {result['answers_equal']} "
          f"(expected answer {task.answer!r})")
    stem = write_json(args.out, "multinode_cpu", result, device="cpu", **fingerprints_at(EngineConfig(args.model)))
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        rs = result["kv_receipts"]
        ax.bar([f"branch {r['branch']}" for r in rs], [r["bytes"] / 1024 for r in rs])
        for i, r in enumerate(rs):
            ax.annotate(f"{r['transfer_ms']:.0f} ms", (i, r["bytes"] / 1024), ha="center", va="bottom")
        ax.set_ylabel("KiB of KV crossing nodes")
        ax.set_title(f"workers' node -> synthesizers' node ({args.task}, {args.branches} branches)")
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=120)
        print(written(stem + ".json"))
    return 0 if result["answers_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
