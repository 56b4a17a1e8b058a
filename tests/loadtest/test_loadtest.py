"""The load generator and the soak run, against real in-process agent API servers."""

import json

import grpc
import pytest

from braid.api.grpc_server import STREAMING
from braid.cluster.inprocess import start_in_process
from braid.engine import Engine, EngineConfig
from braid.loadtest.chaos import (
    SessionCall,
    _hit,
    _rebuild_timing,
    fault_verdict,
    redis_restart_under_load,
    session_losses,
)
from braid.loadtest.chaos import main as chaos_main
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
    """The soak script's short version: a 4 MiB store (about the working set of the workflows running at once)
    keeps evicting the prefix cache and finished sessions' messages all along, and 1 MiB of work KV (256 tokens of
    this model) under 8 workflows at once keeps preempting calls (at 4 at once it preempted 0 to 4 times in 8 s:
    too near 0 to test); nothing fails."""
    result = soak(REFERENCE_MODEL, 8.0, 8, 4 << 20, Workload(worker_max_tokens=8, answer_max_tokens=8),
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
        before = len(server.sessions.directory.list_sessions())
        stub = agent_pb2_grpc.AgentServiceStub(grpc.insecure_channel(address))
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text="x", parents=["nope"])]))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert len(server.sessions.directory.list_sessions()) == before
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


def test_session_faults_tell_lost_sessions_from_data_loss_their_records_explain():
    """kill-synthesizer and rolling-update's verdict, without a cluster: a session is whole when every id answers
    and its Decode gives the tokens it gave before; a DATA_LOSS on an id whose record names what it cannot be
    encoded again without (a calibrated answer) is listed apart, with why; any other failure, a DATA_LOSS the
    record does not explain, or other tokens lose the session. A run that met no call in flight tested nothing."""
    before = {"whole": [1, 2], "calibrated": [3, 4], "differs": [5, 6], "unexplained": [7, 8]}
    after = {"whole": {"tokens": [1, 2], "failed": {}},
             "calibrated": {"tokens": None, "failed": {"a": "DATA_LOSS: message 'a' is lost",
                                                       "Decode": "DATA_LOSS: x"}},
             "differs": {"tokens": [5, 9], "failed": {}},
             "unexplained": {"tokens": None, "failed": {"b": "DATA_LOSS: message 'b' is lost",
                                                        "Decode": "NOT_FOUND: y"}}}
    gaps = {("calibrated", "a"): "a KV transform (calibration)", ("unexplained", "b"): ""}
    losses = session_losses(before, after, gaps)
    assert losses["sessions_lost"] == 2 and set(losses["lost"]) == {"differs", "unexplained"}
    assert losses["lost"]["unexplained"] == ["b: DATA_LOSS: message 'b' is lost", "Decode: NOT_FOUND: y"]
    assert losses["sessions_data_loss"] == 1 and losses["data_loss"] == [
        {"session": "calibrated", "message": "a", "why": "a KV transform (calibration)",
         "status": "DATA_LOSS: message 'a' is lost"}]

    # what the fault met: session calls and workflows alike (started before it, not ended by then)
    calls = [SessionCall("Decode", "s", 0.0, 2.0), SessionCall("GetMessage", "s", 0.5, 1.5, "UNAVAILABLE: gone"),
             SessionCall("Decode", "s", 0.9), SessionCall("Decode", "s", 0.0, 0.8),
             SessionCall("Decode", "s", 1.2, 1.5)]
    assert _hit(calls + [RequestRecord(start=0.1, first_token=0.5, end=3.0)], 1.0) == {
        "in_flight_at_fault": 4, "in_flight_outcomes": {"OK": 2, "UNAVAILABLE": 1, "INCOMPLETE": 1}}
    timing = _rebuild_timing(calls, {"s"}, 1.0)  # (the first call after the fault against the same call before)
    assert timing["first_call_after"] == {"kind": "Decode", "seconds": pytest.approx(0.3),
                                          "same_call_before_s": pytest.approx(0.8)}

    ok = {"in_flight_at_fault": 3, "hung": 0, "calls_failed": {"UNAVAILABLE": 2}, "decodes_differing": 0,
          "sessions": 4, "sessions_lost": 0, "lost": {}, "recovered_s": 2.5}
    assert fault_verdict(ok) == []
    assert fault_verdict({**ok, "in_flight_at_fault": 0}) == ["tested nothing: no call was in flight at the fault"]
    why = fault_verdict({**ok, **losses, "calls_failed": {"UNAVAILABLE": 1, "INTERNAL": 1}, "recovered_s": None})
    assert why[0] == "calls failed with {'INTERNAL': 1}" and why[1].startswith("2 of 4 sessions lost")
    assert why[2] == "no new workflow completed"
    drained = {**ok, "recompute": {"held_messages": 40, "messages": 5.0, "share_of_held": 0.125}}
    assert fault_verdict(drained) == [] and fault_verdict(drained, max_share_encoded=0.2) == []
    assert fault_verdict(drained, max_share_encoded=0.1) == [
        "12% of the 40 messages the replaced replicas held were encoded again (at most 10%: they hand them over as "
        "they drain)"]
    with pytest.raises(SystemExit):  # (sessions go with the session faults only)
        chaos_main(["kill-worker", "--sessions", "3"])
