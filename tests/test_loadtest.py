"""The load generator and the soak run, against real in-process agent API servers."""

import json

import grpc
import pytest

from braid.api.grpc_server import STREAMING
from braid.cluster.inprocess import start_in_process
from braid.engine import Engine, EngineConfig
from braid.loadtest.chaos import redis_restart_under_load
from braid.loadtest.fuzz import fuzz
from braid.loadtest.fuzz import main as fuzz_main
from braid.loadtest.metrics import RequestRecord, parse_slos, summarize
from braid.loadtest.run import main as loadtest_main
from braid.loadtest.soak import soak, verdict
from braid.loadtest.workload import Workload
from braid.models import REFERENCE_MODEL
from braid.protos import agent_pb2 as pb
from braid.protos import agent_pb2_grpc
from braid.runtime.directory import Directory, EmbeddedRedis


def test_metrics_follow_vllm_definitions():
    r = RequestRecord(start=0.0, first_token=0.1, token_times=[0.1, 0.15, 0.3], branch_tokens=5, end=0.3)
    s = summarize([r, RequestRecord(start=0.0, error="UNAVAILABLE: x")], duration_s=1.0, slos=parse_slos(["ttft:200"]))
    assert s["completed"] == 1 and s["failed"] == 1 and s["errors"] == ["UNAVAILABLE: x"]
    assert s["mean_ttft_ms"] == pytest.approx(100) and s["mean_tpot_ms"] == pytest.approx(100)  # (0.3 - 0.1) / 2
    assert s["median_itl_ms"] == pytest.approx(100) and s["p99_e2el_ms"] == pytest.approx(300)
    assert s["output_throughput"] == 3 and s["generated_token_throughput"] == 8 and s["request_goodput"] == 1
    with pytest.raises(ValueError, match="ttft, tpot or e2el"):
        parse_slos(["itl:5"])


def test_loadtest_drives_a_server_and_writes_its_report(tmp_path, capsys):
    redis = EmbeddedRedis()
    engine = Engine(EngineConfig(REFERENCE_MODEL, device="cpu"))
    server = start_in_process(engine, Directory.connect(redis.url))
    try:
        out = tmp_path / "load.json"
        assert loadtest_main(["--address", f"127.0.0.1:{server.port}", "--num-prompts", "6", "--max-concurrency",
                              "3", "--transports", "text,local", "--worker-max-tokens", "8", "--answer-max-tokens",
                              "8", "--goodput", "ttft:60000", "--json", str(out)]) == 0
        report = json.loads(out.read_text())
        s = report["summary"]
        assert s["completed"] == 6 and s["failed"] == 0 and s["request_goodput"] > 0 and s["p99_tpot_ms"] > 0
        assert {r["transport"] for r in report["requests"]} == {"text", "local"}
        assert (tmp_path / "load.png").exists() and "TTFT" in capsys.readouterr().out
        # bad options: one clear line, exit 2, nothing sent
        assert loadtest_main(["--address", f"127.0.0.1:{server.port}", "--goodput", "ttft:fast"]) == 2
        assert engine.scheduler.load == {"waiting": 0, "running": 0, "reserved_bytes": 0}
    finally:
        server.stop()
        redis.stop()


def test_short_soak_stays_within_its_memory_bounds():
    """The soak script's short version: a 4 MiB store (the working set of 4 workflows, and little more) keeps
    evicting the prefix cache and finished sessions' messages all along, and 1 MiB of work KV (256 tokens of
    this model) keeps preempting calls; nothing fails."""
    result = soak(REFERENCE_MODEL, 8.0, 4, 4 << 20, Workload(worker_max_tokens=8, answer_max_tokens=8),
                  kv_budget_bytes=1 << 20)
    ok, line = verdict(result, max_growth_mib=128)
    assert ok, line
    assert result["evictions"] > 0 and result["preemptions"] > 0 and len(result["samples"]) >= 5


def test_fuzzed_requests_get_meant_statuses_and_lose_nothing(checkpoint, tmp_path):
    """The fuzz script's short version: hostile values on every RPC; no UNKNOWN/INTERNAL, no hang, the server
    keeps serving and a fixed workflow answers as before. A failed first call leaves no session behind."""
    redis = EmbeddedRedis()
    server = start_in_process(Engine(EngineConfig(checkpoint("llama"))), Directory.connect(redis.url))
    address = f"127.0.0.1:{server.port}"
    try:
        report = fuzz(address, 300, seed=1, deadline_s=60, progress=False)
        assert report["unknown_or_internal"] == 0 and report["hangs"] == 0, report["failures"]
        assert report["healthy_after"] and report["same_answer"] and report["passed"]
        assert report["statuses"]["OK"] > 30 and report["statuses"]["INVALID_ARGUMENT"] > 30  # both paths ran
        assert set(report["by_method"]) == set(STREAMING) | {"Prefill", "GetMessage", "ListSessions",
                                                             "CloseSession", "Health"}
        before = len(server.logic.directory.list_sessions())
        stub = agent_pb2_grpc.AgentServiceStub(grpc.insecure_channel(address))
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text="x", parents=["nope"])]))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert len(server.logic.directory.list_sessions()) == before
        assert fuzz_main(["--address", address, "--requests", "20", "--out", str(tmp_path)]) == 0
        assert json.loads((tmp_path / "fuzz_cpu.json").read_text())["passed"]
    finally:
        server.stop()
        redis.stop()
    with pytest.raises(ValueError, match="not on loopback"):
        fuzz("10.0.0.1:9000", 1)


def test_a_redis_restart_under_load_loses_no_workflow(checkpoint):
    """The chaos script's short version: Redis stops (losing what it held) and starts again while workflows
    run (some were under way when it stopped: started, not yet ended); each completes, those too (commands wait,
    retrying, for Redis to come back), and a new one works at once."""
    redis = EmbeddedRedis()
    server = start_in_process(Engine(EngineConfig(checkpoint("llama"))), Directory.connect(redis.url))
    try:
        result = redis_restart_under_load(f"127.0.0.1:{server.port}", redis, workflows=12, concurrency=4,
                                          after_s=0.2, down_s=1.0, timeout=120,  # (long enough to be under way)
                                          workload=Workload(worker_max_tokens=32, answer_max_tokens=8))
    finally:
        server.stop()
        redis.stop()
    assert result["passed"] and result["outcomes"] == {"OK": 12}, result
    hit = result["in_flight_at_fault"]
    assert hit >= 1 and result["in_flight_outcomes"] == {"OK": hit}, result


def test_fuzzed_requests_across_two_api_keys_reach_nothing_of_the_other(checkpoint):
    from braid.api.auth import ApiKeys

    keys = ["tenant-a-key-0123456789", "tenant-b-key-0123456789"]
    redis = EmbeddedRedis()
    server = start_in_process(Engine(EngineConfig(checkpoint("llama"))), Directory.connect(redis.url),
                              keys=ApiKeys.parse([f"a:{keys[0]}", f"b:{keys[1]}"], "test"))
    try:
        report = fuzz(f"127.0.0.1:{server.port}", 200, seed=2, deadline_s=60, progress=False, keys=keys)
    finally:
        server.stop()
        redis.stop()
    assert report["cross_key_references"] > 0 and report["cross_session_accepted"] == 0, report["statuses"]
    assert report["passed"] and "UNAUTHENTICATED" not in report["statuses"]
