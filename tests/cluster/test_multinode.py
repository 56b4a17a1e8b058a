"""The Helm chart's serveConfigV2, sent with `serve deploy` to a local Ray cluster of three nodes (a head, and a
node per chart node group): the Worker and Synthesizer run on different nodes, a workflow runs through them with
its KV crossing nodes, and the answer is the single-node one (benchmarks/multinode.py, on a tiny model)."""

import importlib.util
import os

import pytest

from braid.protos import agent_pb2 as pb
from braid.runtime.directory import EmbeddedRedis

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.fixture(scope="module")
def multinode():
    spec = importlib.util.spec_from_file_location("multinode", os.path.join(ROOT, "benchmarks", "multinode.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chart_serve_config_deploys_across_nodes(checkpoint, multinode):
    greedy = pb.Sampling(max_tokens=6, ignore_eos=True)
    request = pb.WorkflowRequest(task="User: add the partial results.",
                                 branch_prompts=["Part 3.", "Part 4 and 5.", "Part 6, 7 and 8 here."],
                                 synthesis_prompt="Synthesizer:", worker_sampling=greedy, synthesis_sampling=greedy,
                                 transport=pb.TRANSPORT_GRPC)
    redis = EmbeddedRedis()
    try:
        result = multinode.run(checkpoint("llama"), redis.url, request, {"kv_schedule": [2, 3]})
    finally:
        redis.stop()
    where = result["placement"]
    assert where["Worker"] == ["workers"] and where["Synthesizer"] == ["synthesizers"]
    assert where["AgentIngress"] == ["head"] and result["decision"] == "TRANSPORT_GRPC"
    assert [r["branch"] for r in result["kv_receipts"]] == [0, 1, 2]
    assert all(r["bytes"] > 0 and r["digest_ok"] for r in result["kv_receipts"])
    assert len(result["answer_tokens"]) == 6 and result["answers_equal"]
