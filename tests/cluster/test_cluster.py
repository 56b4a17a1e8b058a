"""The cluster on a real local Ray, Serve's gRPC proxy and a real Redis, on CPU."""

import os
import time

import grpc
import pytest
import ray

from braid.cluster.config import ClusterConfig
from braid.cluster.local import free_port, start_local_cluster
from braid.engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
from braid.kv.export import fetch
from braid.methods.calibration import Calibration
from braid.methods.synthesis import Refresh, synthesize, synthesize_text
from braid.models.chat import WORKER_HEADER
from braid.protos import agent_pb2 as pb
from braid.protos import agent_pb2_grpc, kv_pb2, kv_pb2_grpc
from braid.runtime.directory import Directory
from braid.train.calibrate import write_untrained

GREEDY = pb.Sampling(max_tokens=6, ignore_eos=True)
METADATA = (("application", "braid"),)



@pytest.fixture(scope="module")
def cluster(checkpoint, tmp_path_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    metrics_port = free_port()
    config = ClusterConfig(checkpoint("llama"), grpc_port=free_port(), kv_transport="grpc", kv_schedule=(2, 3),
                           kv_wait_timeout_s=30)
    local = start_local_cluster(config, num_cpus=2, metrics_port=metrics_port,
                                temp_dir=str(tmp_path_factory.mktemp("ray")))
    channel = grpc.insecure_channel(local.address)
    grpc.channel_ready_future(channel).result(timeout=60)
    yield agent_pb2_grpc.AgentServiceStub(channel), config, local.redis_server, metrics_port, local
    channel.close()
    local.stop()


def run(stub, **kw):
    return list(stub.RunWorkflow(pb.WorkflowRequest(**kw), metadata=METADATA, timeout=120))


def in_process(path, task, prompts, text_mode):
    eng = Engine(EngineConfig(path))
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    prefix = eng.prefill([PrefillCall(task)])
    ctx = eng.prefill([PrefillCall(p, parents=prefix) for p in prompts])
    branches = eng.decode([DecodeCall(WORKER_HEADER, parents=[*prefix, c], sampling=greedy) for c in ctx])
    if text_mode:
        answer = synthesize_text(eng, branches, "Synthesizer:", prefix=prefix, sampling=greedy)
    else:
        # the served cache path: each branch's first and last token refreshed (refresh_tokens unset, no
        # calibration: a token at each end)
        answer = synthesize(eng, branches, "Synthesizer:", prefix=prefix, sampling=greedy, refresh=Refresh(1, 1))
    return list(eng.message(answer).token_ids[-6:])


@pytest.mark.parametrize("transport", [pb.TRANSPORT_GRPC, pb.TRANSPORT_COLLECTIVE, pb.TRANSPORT_TEXT],
                         ids=["grpc", "gloo", "text"])
def test_workflow_over_grpc_matches_in_process(cluster, transport):
    stub, config, *_ = cluster
    task, prompts = "User: add the partial results.", ["Part 3.", "Part 4 and 5.", "Part 6, 7 and 8 here."]
    events = run(stub, task=task, branch_prompts=prompts, synthesis_prompt="Synthesizer:", worker_sampling=GREEDY,
                 synthesis_sampling=GREEDY, transport=transport)
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "decision" and events[0].decision.transport == transport
    assert kinds.count("branch_token") == 18 and kinds.count("synthesis_token") == 6
    receipts = [e.kv_receipt for e in events if e.HasField("kv_receipt")]
    if transport != pb.TRANSPORT_TEXT:
        assert sorted(r.branch for r in receipts) == [0, 1, 2]
        assert len(events[-1].done.branch_message_ids) == 3  # imported, and usable as parents in the session
        info = stub.GetMessage(pb.GetMessageRequest(session_id=events[-1].done.session_id,
                                                    message_id=events[-1].done.branch_message_ids[0]),
                               metadata=METADATA)
        assert info.kv_bytes == next(r.bytes for r in receipts if r.branch == 0)
        assert all(r.crc32 == r.crc32_sent and r.bytes > 0 for r in receipts)  # bit-identical at the synthesizer
        assert events[-2].timings.kv_bytes == sum(r.bytes for r in receipts)
    else:
        assert receipts == []
    answer = [e.synthesis_token.token_id for e in events if e.HasField("synthesis_token")]
    assert answer == in_process(config.model_path, task, prompts, transport == pb.TRANSPORT_TEXT)
    assert events[-1].done.answer_message_id and events[-2].timings.ttft_ms > 0


def test_staircase_workflow_answers_from_the_workers_chunks_as_they_arrive(cluster):
    """Staircase over the cluster: the synthesizer reads each worker's KV chunks as they are pushed. With chunks
    larger than the replies it takes whole branches in one round, so it answers exactly as the waiting cache
    path does; with small chunks it answers before the workers have finished."""
    stub, config, *_ = cluster
    task, prompts = "User: add the partial results.", ["Part 3.", "Part 4 and 5.", "Part 6, 7 and 8 here."]
    whole = run(stub, task=task, branch_prompts=prompts, synthesis_prompt="Synthesizer:", worker_sampling=GREEDY,
                synthesis_sampling=GREEDY, transport=pb.TRANSPORT_GRPC,
                staircase=pb.StaircaseOptions(proposer_chunks=[1000], aggregator_chunks=[1000]))
    rounds = [e.round for e in whole if e.HasField("round")]
    assert len(rounds) == 1 and sorted(c.branch for c in rounds[0].chunks) == [0, 1, 2]
    answer = [e.synthesis_token.token_id for e in whole if e.HasField("synthesis_token")]
    assert answer == in_process(config.model_path, task, prompts, text_mode=False)
    assert len(whole[-1].done.branch_message_ids) == 3
    assert sorted(e.kv_receipt.branch for e in whole if e.HasField("kv_receipt")) == [0, 1, 2]

    long = pb.Sampling(max_tokens=40, ignore_eos=True)
    early = run(stub, task=task, branch_prompts=prompts, synthesis_prompt="Synthesizer:", worker_sampling=long,
                synthesis_sampling=GREEDY, staircase=pb.StaircaseOptions(aggregator_chunks=[2]))
    kinds = [e.WhichOneof("event") for e in early]
    assert kinds.count("synthesis_token") == 6 and kinds.count("branch_token") == 120
    assert kinds.index("synthesis_token") < len(kinds) - 1 - kinds[::-1].index("branch_token")  # answer began first
    first = next(e.round for e in early if e.HasField("round"))
    assert all(c.end < 40 for c in first.chunks)  # round 0 took in partial branches (kv_schedule 2, 3)
    timings = next(e.timings for e in early if e.HasField("timings"))
    assert timings.last_branch_to_first_token_ms < 0
    assert early[-1].done.answer_text and len(early[-1].done.branch_message_ids) == 3
    for request, code, needle in (
            (dict(transport=pb.TRANSPORT_TEXT, staircase=pb.StaircaseOptions()), grpc.StatusCode.INVALID_ARGUMENT,
             "needs a KV transport"),
            (dict(staircase=pb.StaircaseOptions(redundancy=3)), grpc.StatusCode.INVALID_ARGUMENT,
             "redundancy 3 leaves no branch")):
        with pytest.raises(grpc.RpcError) as err:
            run(stub, task=task, branch_prompts=prompts, synthesis_prompt="S:", **request)
        assert err.value.code() == code and needle in err.value.details(), err.value.details()


def test_run_graph_decodes_on_the_worker_replicas(cluster):
    """RunGraph's decoding nodes run on the Worker replica (their parents fetched from the session's synthesizer,
    their outputs shipped back) and answer as the graph does on one engine; a client that leaves mid-graph stops
    the worker's decoding."""
    from ray import serve

    from braid.methods.dag import run_dag
    from braid.methods.staircase import StaircaseSchedule
    from braid.runtime.convert import graph as to_graph

    stub, config, *_ = cluster
    nodes = [pb.GraphNode(name="sys", prompt="System: be brief.", role="a", private=True),
             pb.GraphNode(name="q", prompt="User: 2 and 3?")]
    nodes += [pb.GraphNode(name=f"w{i}", prompt=f"Agent {i}:", role="a" if i == 0 else "b", decode=True,
                           sampling=GREEDY, parents=[pb.GraphParent(node="sys")] * (i == 0) + [pb.GraphParent(node="q")])
              for i in range(2)]
    nodes.append(pb.GraphNode(name="judge", prompt="Judge:", role="b", decode=True, sampling=GREEDY,
                              parents=[pb.GraphParent(node="w0"), pb.GraphParent(node="w1")]))
    request = pb.GraphRequest(nodes=nodes)
    events = list(stub.RunGraph(request, metadata=METADATA, timeout=120))
    done = {e.node_done.node: e.node_done for e in events if e.HasField("node_done")}
    assert all(done[n].replica.startswith("worker-") for n in ("w0", "w1", "judge"))
    assert done["q"].replica == "" and list(done["judge"].reencoded) == ["w0:private"]
    local = list(run_dag(Engine(EngineConfig(config.model_path)), to_graph(request, 128, StaircaseSchedule())))
    assert [(e.node, e.text) for e in local if hasattr(e, "reencoded")] == [(n, d.text) for n, d in done.items()]
    stub.CloseSession(pb.CloseSessionRequest(session_id=events[-1].done.session_id), metadata=METADATA)
    # a client that leaves while the workers decode
    worker = serve.get_deployment_handle("Worker", app_name="braid")
    for n in nodes[2:4]:
        n.sampling.CopyFrom(pb.Sampling(max_tokens=2000, ignore_eos=True))
    call = stub.RunGraph(pb.GraphRequest(nodes=nodes), metadata=METADATA, timeout=120)
    with pytest.raises(grpc.RpcError) as err:
        for i, event in enumerate(call):
            if i == 5:
                assert worker.load.remote().result()["running"] >= 1
                call.cancel()
    assert err.value.code() == grpc.StatusCode.CANCELLED
    deadline = time.monotonic() + 5
    while worker.load.remote().result()["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert worker.load.remote().result() == {"waiting": 0, "running": 0, "reserved_bytes": 0}
    # a staircase judge on the synthesizer streams the debaters' chunks as the worker ships them
    nodes[-1].staircase = True
    for n in nodes[2:4]:
        n.sampling.CopyFrom(pb.Sampling(max_tokens=40, ignore_eos=True))
    events = list(stub.RunGraph(pb.GraphRequest(nodes=nodes, staircase=pb.StaircaseOptions(
        proposer_chunks=[4, 8], aggregator_chunks=[2, 4])), metadata=METADATA, timeout=120))
    done = {e.node_done.node: e.node_done for e in events if e.HasField("node_done")}
    rounds = [e.round for e in events if e.HasField("round")]
    assert done["w0"].replica.startswith("worker-") and done["judge"].replica == "" and done["judge"].text
    assert rounds and any(c.end < 40 for c in rounds[0].chunks)  # (its first round took part of the replies)
    stub.CloseSession(pb.CloseSessionRequest(session_id=events[-1].done.session_id), metadata=METADATA)


def test_session_calls_and_bad_requests_through_the_proxy(cluster):
    stub, *_ = cluster
    r = stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text="User: hi")]), metadata=METADATA)
    events = list(stub.Decode(pb.DecodeRequest(session_id=r.session_id, calls=[pb.DecodeCallSpec(
        header="A:", parents=r.message_ids, sampling=GREEDY)]), metadata=METADATA))
    assert len(events) == 6 and events[-1].message_id
    other = stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text="other")]), metadata=METADATA)
    bad = [
        (grpc.StatusCode.NOT_FOUND, lambda: list(stub.Decode(pb.DecodeRequest(session_id=r.session_id, calls=[
            pb.DecodeCallSpec(header="A:", parents=other.message_ids)]), metadata=METADATA))),
        (grpc.StatusCode.INVALID_ARGUMENT, lambda: run(stub, task="t", synthesis_prompt="s")),
        (grpc.StatusCode.INVALID_ARGUMENT, lambda: run(stub, task="t", branch_prompts=["a"], synthesis_prompt="s",
                                                       transport=pb.TRANSPORT_LOCAL)),
        (grpc.StatusCode.NOT_FOUND, lambda: run(stub, session_id="nope", task="t", branch_prompts=["a"],
                                                synthesis_prompt="s")),
        (grpc.StatusCode.OUT_OF_RANGE, lambda: stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(
            text="x", new_offset=10 ** 9)]), metadata=METADATA)),
    ]
    for i, (code, call) in enumerate(bad):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == code, (i, code, err.value.details())
        assert err.value.details()
    assert stub.Health(pb.HealthRequest(), metadata=METADATA).status == "SERVING"
    closed = stub.CloseSession(pb.CloseSessionRequest(session_id=r.session_id), metadata=METADATA)
    assert closed.freed_messages == 2


def test_replicas_internal_kv_ports_take_only_the_clusters_calls(cluster):
    """`braid serve`'s replicas share a cluster token: a replica's KVExport serves a session's message to a caller
    with the token (this process started the cluster, so it has it) and refuses anyone else."""
    stub, _, redis_server, *_ = cluster
    r = stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text="User: hi")]), metadata=METADATA)
    directory = Directory.connect(redis_server.url)
    rec = directory.lookup(r.session_id, r.message_ids[0])
    address = directory.replica_address(rec.replica)
    got = fetch(address, r.session_id, r.message_ids[0], rec.fingerprint)
    assert len(got.token_ids) == rec.tokens
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(kv_pb2_grpc.KVExportStub(channel).Fetch(kv_pb2.FetchRequest(
                session_id=r.session_id, message_id=r.message_ids[0]), timeout=30))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    stub.CloseSession(pb.CloseSessionRequest(session_id=r.session_id), metadata=METADATA)


def _kill_replicas(matches, restart: bool = True) -> int:
    """SIGKILL every Ray actor whose name `matches` (Serve replicas: Serve replaces them, or with `restart` False
    Ray does not restart them either); how many were killed."""
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if matches(a["name"])]
    for a in actors:
        ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=not restart)
    return len(actors)


def _next_workflow_completes(stub, within_s: float = 90) -> bool:
    """After a replica was killed: Serve replaces it, and a workflow completes (retried until then)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            events = run(stub, task="t", branch_prompts=["a", "b"], synthesis_prompt="s", worker_sampling=GREEDY,
                         synthesis_sampling=GREEDY)
            return events[-1].HasField("done")
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def test_worker_killed_mid_request_fails_cleanly_and_cluster_recovers(cluster):
    stub, *_ = cluster
    long = pb.Sampling(max_tokens=400, ignore_eos=True)
    stream = stub.RunWorkflow(pb.WorkflowRequest(task="t", branch_prompts=["a"], synthesis_prompt="s",
                                                 worker_sampling=long, synthesis_sampling=GREEDY),
                              metadata=METADATA, timeout=120)
    seen = 0
    with pytest.raises(grpc.RpcError) as err:
        for event in stream:
            if event.HasField("branch_token"):
                seen += 1
                if seen == 5:
                    _kill_replicas(lambda name: "Worker" in name)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "worker failed" in err.value.details()
    assert _next_workflow_completes(stub)



def test_a_lost_synthesizer_cuts_off_its_workflow_and_its_kv_sessions_come_back(cluster):
    """The Synthesizer replica is killed (SIGKILL) while the workers decode a KV workflow: the client is told that
    the synthesizer was lost (UNAVAILABLE: retry), not that a worker failed; Serve replaces it and a workflow runs.
    A session made before by a workflow over gRPC (its branches shipped from the Worker replica) comes back on the
    new replica: its answer, branches and prefix resolve, encoded again from their lineages, and a greedy Decode
    after the answer gives the tokens it gave before."""
    stub, *_ = cluster
    done = run(stub, task="User: add the partial results.", branch_prompts=["Part 3.", "Part 4 and 5."],
               synthesis_prompt="Synthesizer:", worker_sampling=GREEDY, synthesis_sampling=GREEDY,
               transport=pb.TRANSPORT_GRPC)[-1].done
    sid, ids = done.session_id, [done.answer_message_id, *done.branch_message_ids]
    assert len(ids) == 3

    def after_answer():
        return [e.token_id for e in stub.Decode(pb.DecodeRequest(session_id=sid, calls=[pb.DecodeCallSpec(
            header="Q:", parents=[done.answer_message_id], sampling=GREEDY)]), metadata=METADATA, timeout=60)]

    before = after_answer()
    infos = [stub.GetMessage(pb.GetMessageRequest(session_id=sid, message_id=m), metadata=METADATA) for m in ids]
    long = pb.Sampling(max_tokens=400, ignore_eos=True)
    stream = stub.RunWorkflow(pb.WorkflowRequest(task="t", branch_prompts=["a"], synthesis_prompt="s",
                                                 worker_sampling=long, synthesis_sampling=GREEDY,
                                                 transport=pb.TRANSPORT_GRPC), metadata=METADATA, timeout=120)
    seen = 0
    with pytest.raises(grpc.RpcError) as err:
        for event in stream:
            if event.HasField("branch_token"):
                seen += 1
                if seen == 5:
                    _kill_replicas(lambda name: name.startswith("SERVE_REPLICA::braid#Synthesizer#"))
    assert seen >= 5  # (the kill met the workflow under way)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "synthesizer" in err.value.details(), \
        err.value.details()
    assert "worker failed" not in err.value.details()
    assert _next_workflow_completes(stub)
    for m, info in zip(ids, infos):  # (the answer first: its branches come back with it)
        again = stub.GetMessage(pb.GetMessageRequest(session_id=sid, message_id=m), metadata=METADATA, timeout=60)
        assert (list(again.token_ids), again.offset) == (list(info.token_ids), info.offset)
    assert after_answer() == before


def test_losing_redis_does_not_lose_a_running_request(cluster):
    stub, _, redis_server, *_ = cluster
    stream = stub.RunWorkflow(pb.WorkflowRequest(task="t", branch_prompts=["a", "b"], synthesis_prompt="s",
                                                 worker_sampling=pb.Sampling(max_tokens=40, ignore_eos=True),
                                                 synthesis_sampling=GREEDY, transport=pb.TRANSPORT_GRPC),
                              metadata=METADATA, timeout=120)
    events, stopped_after = [], None
    try:
        for event in stream:
            events.append(event)
            if len(events) == 3:
                redis_server.stop()  # the control plane goes away mid-request
                stopped_after = 3
    finally:
        redis_server.start()
    assert stopped_after == 3 and any(e.HasField("branch_token") for e in events[stopped_after:])  # (mid-request)
    answer = "".join(e.synthesis_token.text for e in events if e.HasField("synthesis_token"))
    assert events[-1].HasField("done") and events[-1].done.answer_text == answer
    assert sum(e.HasField("synthesis_token") for e in events) == 6


def test_metrics_reach_the_prometheus_export(cluster):
    import urllib.request
    stub, _, _, metrics_port, _ = cluster
    run(stub, task="t", branch_prompts=["a"], synthesis_prompt="s", worker_sampling=GREEDY,
        synthesis_sampling=GREEDY, transport=pb.TRANSPORT_GRPC)
    wanted = ["ray_braid_time_to_first_token_seconds", "ray_braid_time_per_output_token_seconds",
              "ray_braid_kv_bytes_shipped_total", "ray_braid_kv_transfer_seconds", "ray_braid_synthesis_requests_total",
              "ray_braid_store_bytes", "ray_braid_scheduler_waiting", "ray_braid_scheduler_running",
              "ray_braid_work_kv_bytes", "ray_braid_prefix_cache_hits"]
    deadline, text = time.monotonic() + 60, ""
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        if all(w in text for w in wanted):
            break
        time.sleep(2)
    missing = [w for w in wanted if w not in text]
    assert not missing, missing
    shipped = [line for line in text.splitlines() if line.startswith("ray_braid_kv_bytes_shipped_total{")]
    assert any('transport="grpc"' in line and float(line.rsplit(" ", 1)[1]) > 0 for line in shipped)


def test_colocated_cluster_reuses_kv_in_place(cluster, tmp_path):
    """A second app on the same Serve: no Worker replicas, one engine does both jobs; it checks API keys."""
    from ray import serve

    from braid.api.auth import client_metadata
    from braid.cluster.app import build_app

    stub, config, _, _, local = cluster
    # its synthesizer loads a calibration (at its init: the identity, so answers match the uncalibrated path
    # bit for bit), recorded as verified up to 3 branches, which lets `auto` reuse the KV in place
    calibration = write_untrained(config.model_path, str(tmp_path / "calibration"))
    Calibration.load(calibration).record_verification({"mode": "calibrated+refresh", "max_branches": 3})
    keys = tmp_path / "keys"
    keys.write_text("ci:0123456789abcdef0123\n")
    colocated = ClusterConfig(config.model_path, colocate=True, grpc_port=config.grpc_port, calibration=calibration,
                              api_keys_file=str(keys))
    serve.run(build_app(colocated, local.redis_url), name="braid-colocated", route_prefix="/colocated")
    try:
        task, prompts = "User: add the partial results.", ["Part 3.", "Part 4 and 5.", "Part 6, 7 and 8 here."]
        request = pb.WorkflowRequest(task=task, branch_prompts=prompts, synthesis_prompt="Synthesizer:",
                                     worker_sampling=GREEDY, synthesis_sampling=GREEDY)
        app = (("application", "braid-colocated"),)
        for call in (lambda: stub.Health(pb.HealthRequest(), metadata=app),
                     lambda: list(stub.RunWorkflow(request, metadata=app, timeout=60))):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "needs a key" in err.value.details()
        events = list(stub.RunWorkflow(request, metadata=app + client_metadata("0123456789abcdef0123"), timeout=120))
        decision = next(e.decision for e in events if e.HasField("decision"))
        assert decision.transport == pb.TRANSPORT_LOCAL and not any(e.HasField("kv_receipt") for e in events)
        assert f"calibration {calibration}" in decision.reason
        answer = [e.synthesis_token.token_id for e in events if e.HasField("synthesis_token")]
        assert answer == in_process(config.model_path, task, prompts, text_mode=False)
    finally:
        serve.delete("braid-colocated")


def test_braid_serve_opens_the_api_only_when_told(cluster, tmp_path, monkeypatch, capsys):
    """`braid serve --open-api` as typed, its cluster a Serve app on this module's Ray (a Ray of its own would add
    a minute): no key is made, the banner says anyone who can reach the port is served, and a call without a key
    is. (`braid serve` without it, making its key and refusing calls without one, is run as a reader starts it in
    tests/docs/test_docs_commands.py.)"""
    import signal
    import threading

    import psutil
    from ray import serve

    import braid.cluster.local
    from braid.api.auth import ENV_CLIENT_KEY, ENV_KEYS, local_key_path
    from braid.cli import main as braid_main
    from braid.cluster.app import build_app
    from braid.cluster.local import LocalCluster

    _, config, _, _, local = cluster
    monkeypatch.setenv("HOME", str(tmp_path))  # (~/.braid: the key file)
    for name in (ENV_KEYS, ENV_CLIENT_KEY):
        monkeypatch.delenv(name, raising=False)
    port, app = config.grpc_port, (("application", "braid-serve"),)
    listening = {c.laddr.ip for c in psutil.net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert listening and listening <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening  # (what the banner says)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    class OnThisRay(LocalCluster):
        def stop(self):
            serve.delete("braid-serve")

    def serve_while(checks, *argv) -> tuple[str, dict]:
        """Runs `braid serve ARGV` until `checks(config it serves)` has run against it, then Ctrl-C."""
        seen = {}

        def check():
            try:
                checks(seen)
            except BaseException as e:  # noqa: BLE001 - raised again below
                seen["error"] = e
            finally:
                deadline = time.monotonic() + 60
                while signal.getsignal(signal.SIGINT) is handlers[signal.SIGINT] and time.monotonic() < deadline:
                    time.sleep(0.05)  # (until serve_cmd waits for it)
                os.kill(os.getpid(), signal.SIGINT)

        def start(served, **_):
            seen["config"] = served
            serve.run(build_app(served, local.redis_url), name="braid-serve", route_prefix="/serve")
            threading.Thread(target=check, daemon=True).start()
            return OnThisRay(served, local.redis_url, None)

        monkeypatch.setattr(braid.cluster.local, "start_local_cluster", start)
        try:
            assert braid_main(["serve", "--model", config.model_path, "--port", str(port), "--colocate", *argv]) == 0
        finally:
            for s, handler in handlers.items():
                signal.signal(s, handler)
        if "error" in seen:
            raise seen["error"]
        return capsys.readouterr().out, seen

    channel = grpc.insecure_channel(local.address)

    def health(metadata) -> pb.HealthResponse:
        return agent_pb2_grpc.AgentServiceStub(channel).Health(pb.HealthRequest(), metadata=app + metadata, timeout=30)

    def opened(seen):
        assert seen["config"].api_keys_file is None
        assert health(()).status == "SERVING"

    out, _ = serve_while(opened, "--open-api")
    channel.close()
    assert f"api key      none (--open-api): anyone who can reach port {port}" in out
    assert not os.path.exists(local_key_path(port))


def test_bad_workflow_input_through_the_proxy_gets_the_right_status_and_loses_nothing(cluster):
    """Each bad input is refused at the ingress, before any replica works on it, with a status a client
    would not retry and a message naming the field; the next workflow still answers."""
    stub, *_ = cluster
    nan = float("nan")

    def workflow(**kw):
        base = dict(task="t", branch_prompts=["a", "b"], synthesis_prompt="s", worker_sampling=GREEDY,
                    synthesis_sampling=GREEDY)
        return lambda: run(stub, **{**base, **kw})

    cases = [
        (grpc.StatusCode.INVALID_ARGUMENT, "branch_prompts[1] is empty", workflow(branch_prompts=["a", ""])),
        (grpc.StatusCode.OUT_OF_RANGE, "branch_prompts[0]", workflow(branch_prompts=["word " * 5000])),
        (grpc.StatusCode.OUT_OF_RANGE, "worker_sampling.max_tokens",
         workflow(worker_sampling=pb.Sampling(max_tokens=10 ** 9))),
        (grpc.StatusCode.OUT_OF_RANGE, "synthesis_sampling.max_tokens",
         workflow(synthesis_sampling=pb.Sampling(max_tokens=4_000_000))),
        (grpc.StatusCode.INVALID_ARGUMENT, "worker_sampling: temperature",
         workflow(worker_sampling=pb.Sampling(max_tokens=4, temperature=nan))),
        (grpc.StatusCode.INVALID_ARGUMENT, "sampling: temperature", lambda: list(stub.Decode(pb.DecodeRequest(
            calls=[pb.DecodeCallSpec(header="A:", sampling=pb.Sampling(temperature=nan))]), metadata=METADATA))),
        (grpc.StatusCode.INVALID_ARGUMENT, "sampling: temperature", lambda: list(stub.Generate(pb.GenerateRequest(
            prompt="hi", sampling=pb.Sampling(temperature=nan)), metadata=METADATA))),
        *[(grpc.StatusCode.INVALID_ARGUMENT, f"transport {t} is not a Transport value", workflow(transport=t))
          for t in (5, 99, -1)],
    ]
    for code, needle, call in cases:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == code and needle in err.value.details(), (needle, err.value.code(),
                                                                            err.value.details())
    got = []  # refused before the transport decision: nothing announced, nothing shipped
    with pytest.raises(grpc.RpcError):
        for event in stub.RunWorkflow(pb.WorkflowRequest(task="t", branch_prompts=["a"], synthesis_prompt="s",
                                                         worker_sampling=pb.Sampling(max_tokens=10 ** 9)),
                                      metadata=METADATA, timeout=60):
            got.append(event)
    assert got == []
    events = run(stub, task="t", branch_prompts=["a", "b"], synthesis_prompt="s", worker_sampling=GREEDY,
                 synthesis_sampling=GREEDY)
    assert events[-1].HasField("done") and sum(e.HasField("synthesis_token") for e in events) == 6
    assert events[-1].done.answer_text == "".join(e.synthesis_token.text for e in events
                                                  if e.HasField("synthesis_token"))  # the answer alone


def test_malformed_request_bytes_through_the_proxy(cluster):
    """Bytes that do not parse as a WorkflowRequest (a task that is not UTF-8). Serve's gRPC proxy parses the
    request before any Braid code runs and answers UNKNOWN, naming the parse error; Braid cannot change that
    code (README, limits). The cluster keeps serving."""
    stub, _, _, _, local = cluster
    with grpc.insecure_channel(local.address) as channel:
        raw = channel.unary_stream("/braid.v1.AgentService/RunWorkflow", request_serializer=lambda b: b,
                                   response_deserializer=pb.WorkflowEvent.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(raw(b"\x12\x02\xff\xfe", metadata=METADATA, timeout=30))  # field 2 (task), invalid UTF-8
    assert err.value.code() == grpc.StatusCode.UNKNOWN and "bad UTF-8" in err.value.details()
    assert stub.Health(pb.HealthRequest(), metadata=METADATA).status == "SERVING"


def test_session_calls_succeed_on_three_synthesizer_replicas(cluster):
    """Three synthesizer replicas: a session's calls are routed to the replica serving it (Serve's
    multiplexing), and one that lands elsewhere moves the messages it names; none fails for routing."""
    from ray import serve

    from braid.cluster.app import build_app

    stub, config, _, _, local = cluster
    three = ClusterConfig(config.model_path, colocate=True, synthesizer_replicas=3, grpc_port=config.grpc_port)
    serve.run(build_app(three, local.redis_url), name="braid-three", route_prefix="/three")
    app = (("application", "braid-three"),)
    eng = Engine(EngineConfig(config.model_path))
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    try:
        for s in range(6):
            r = stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text=f"User: session {s}")]), metadata=app)
            sid, parents = r.session_id, list(r.message_ids)
            local_parents = eng.prefill([PrefillCall(f"User: session {s}")])
            for turn in range(3):
                events = list(stub.Decode(pb.DecodeRequest(session_id=sid, calls=[pb.DecodeCallSpec(
                    header=f"A{turn}:", parents=parents, sampling=GREEDY)]), metadata=app, timeout=60))
                mine, = eng.decode([DecodeCall(f"A{turn}:", parents=local_parents, sampling=greedy)])
                assert [e.token_id for e in events] == list(eng.message(mine).token_ids[-6:])  # as one engine
                parents, local_parents = [events[-1].message_id], [mine]
                info = stub.GetMessage(pb.GetMessageRequest(session_id=sid, message_id=parents[0]), metadata=app)
                assert info.token_ids[-6:] == [e.token_id for e in events]
            done = list(stub.RunWorkflow(pb.WorkflowRequest(
                session_id=sid, task="User: add.", branch_prompts=["a", "b"], synthesis_prompt="S:",
                worker_sampling=GREEDY, synthesis_sampling=GREEDY, transport=pb.TRANSPORT_TEXT), metadata=app,
                timeout=120))[-1].done
            assert done.session_id == sid
            follow = list(stub.Decode(pb.DecodeRequest(session_id=sid, calls=[pb.DecodeCallSpec(
                header="more:", parents=[done.answer_message_id], sampling=GREEDY)]), metadata=app, timeout=60))
            assert len(follow) == 6
            assert stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=app).freed_messages >= 1
    finally:
        serve.delete("braid-three")



def _replica_ids(application: str) -> set[str]:
    """The ids of the application's Synthesizer replicas alive now."""
    return {a["name"].rsplit("#", 1)[1] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{application}#Synthesizer#")}


def _session_turns(stub, app, n):
    """A session of `n` turns (a prompt, then reply after reply); its ids in order."""
    r = stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text=f"User: session {n}")]), metadata=app)
    sid, ids = r.session_id, list(r.message_ids)
    for turn in range(n):
        events = list(stub.Decode(pb.DecodeRequest(session_id=sid, calls=[pb.DecodeCallSpec(
            header=f"A{turn}:", parents=ids[-1:], sampling=GREEDY)]), metadata=app, timeout=60))
        ids.append(events[-1].message_id)
    return sid, ids


def _probe(stub, app, sid, ids):
    """Every id of the session resolves (GetMessage), and a greedy Decode over the last gives its tokens."""
    for mid in ids:
        stub.GetMessage(pb.GetMessageRequest(session_id=sid, message_id=mid), metadata=app, timeout=60)
    return [e.token_id for e in stub.Decode(pb.DecodeRequest(session_id=sid, calls=[pb.DecodeCallSpec(
        header="Q:", parents=ids[-1:], sampling=GREEDY)]), metadata=app, timeout=60)]


def test_sessions_survive_a_killed_synthesizer_and_a_rolling_update(cluster):
    """Two synthesizer replicas hold sessions of several turns. The replica the directory names as a session's
    holder is killed (SIGKILL): afterwards every id of every session resolves and a greedy Decode gives the
    tokens it gave before, each lost message encoded again from its lineage (the recompute counter rose). Then a
    rolling update replaces both replicas (a config change through serve.run), each handing its messages over to
    a live one as it drains: the directory names a new replica as the holder of every message before any call
    needed them, no new replica encoded any again, and every session answers as before."""
    import urllib.request

    from ray import serve

    from braid.cluster.app import build_app

    stub, config, _, metrics_port, local = cluster
    two = ClusterConfig(config.model_path, colocate=True, synthesizer_replicas=2, grpc_port=config.grpc_port)
    serve.run(build_app(two, local.redis_url), name="braid-two", route_prefix="/two")
    app = (("application", "braid-two"),)
    directory = Directory.connect(local.redis_url)
    try:
        sessions = [_session_turns(stub, app, n) for n in (2, 3, 3, 4)]
        before = [_probe(stub, app, sid, ids) for sid, ids in sessions]
        # the victim: the replica holding a message no other replica has seen (a new session's first prompt, never
        # read since), so that its loss must be made good by encoding again, whatever copies the probes spread
        fresh = stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text="User: only here")]), metadata=app)
        victim = directory.lookup(fresh.session_id, fresh.message_ids[0]).replica
        assert _kill_replicas(lambda name: victim in name, restart=False) == 1
        assert [_probe(stub, app, sid, ids) for sid, ids in sessions] == before
        _probe(stub, app, fresh.session_id, list(fresh.message_ids))
        deadline, text, counts = time.monotonic() + 60, "", []
        while time.monotonic() < deadline:  # (a message the survivor held a copy of needs no encoding again)
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
            counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("ray_braid_recomputed_messages_total{")]
            if sum(counts) >= 1:
                break
            time.sleep(2)
        assert sum(counts) >= 1, text[-2000:]
        # a rolling update: a changed config replaces every replica, one at a time, each handing over as it drains
        # to a live one. (Once Serve has replaced the killed replica: with one replica left, an update stops it
        # before its successor starts, so there is no peer to hand over to)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
                len(_replica_ids("braid-two") - {victim}) == 2
                and _replica_ids("braid-two") - {victim} <= set(directory.replicas("braid-two/Synthesizer"))):
            time.sleep(0.5)
        old = _replica_ids("braid-two") - {victim}
        assert len(old) == 2, old
        changed = ClusterConfig(config.model_path, colocate=True, synthesizer_replicas=2,
                                grpc_port=config.grpc_port, default_max_tokens=64)
        serve.run(build_app(changed, local.redis_url), name="braid-two", route_prefix="/two")
        deadline = time.monotonic() + 60
        while _replica_ids("braid-two") & old and time.monotonic() < deadline:
            time.sleep(0.5)
        new = _replica_ids("braid-two")
        assert len(new) == 2 and not new & old, (old, new)
        everything = [*sessions, (fresh.session_id, list(fresh.message_ids))]
        holders = {directory.lookup(sid, m).replica for sid, ids in everything for m in ids}
        assert holders <= new, (holders, new)  # (handed over: before any call needed them)
        assert [_probe(stub, app, sid, ids) for sid, ids in sessions] == before
        handle, counts = serve.get_deployment_handle("Synthesizer", app_name="braid-two"), {}
        for _ in range(40):  # (each call reaches one replica: until both have answered)
            reply = handle.recovery.remote().result()
            counts[reply["replica"]] = reply
            if len(counts) == 2:
                break
        assert set(counts) == new and all(c.get("messages", 0) == 0 for c in counts.values()), counts
        assert sum(c.get("adopted", 0) for c in counts.values()) >= sum(len(ids) for _, ids in everything), counts
    finally:
        serve.delete("braid-two")


def test_fuzzed_requests_through_the_proxy(cluster):
    """The fuzz script's short version through Serve's gRPC proxy: no UNKNOWN/INTERNAL, no hang, and the
    cluster answers a fixed workflow as before."""
    from braid.loadtest.fuzz import fuzz

    _, _, _, _, local = cluster
    report = fuzz(local.address, 150, seed=3, deadline_s=60, metadata=METADATA, progress=False)
    assert report["passed"], (report["statuses"], report["failures"][:5])


def test_clients_that_leave_stop_the_work_every_way(cluster):
    """The chaos script's short version of client-leaves: a client that cancels mid-stream, or whose gRPC
    deadline passes, or whose deadline sent as metadata passes, leaves every replica idle within seconds."""
    from braid.loadtest.chaos import LEAVES, clients_leave

    _, _, _, _, local = cluster
    # (deadlines well inside the 2 x 1500 worker tokens, which take this model about 2 s alone)
    result = clients_leave(local.address, per_way=3, grace_s=5.0, deadlines=(0.8, 1.2))
    assert result["passed"] and list(result["ways"]) == list(LEAVES), result  # (each: >= 1 left mid-decode)


def test_a_worker_killed_under_load_hangs_nothing_and_the_cluster_recovers(cluster):
    """The chaos script's short version: the Worker replica is killed while workflows run (some under way at
    the kill: started, not yet ended); each completes or fails with UNAVAILABLE, those too, none hangs, and a
    new workflow completes without anyone restarting anything."""
    from braid.loadtest.chaos import kill_worker_under_load
    from braid.loadtest.workload import Workload

    _, _, _, _, local = cluster
    # (replies long enough that the kill meets them decoding: with 48 tokens a warm cluster had finished all six
    # before a kill 1 s in, and the test passed without the fault touching anything)
    result = kill_worker_under_load(local.address, workflows=6, concurrency=6, after_s=0.5, timeout=120,
                                    workload=Workload(branches=(2,), worker_max_tokens=400, answer_max_tokens=8,
                                                      transports=("text", "grpc")))
    assert result["passed"] and result["hung"] == 0, result
    assert set(result["outcomes"]) <= {"OK", "UNAVAILABLE"} and sum(result["outcomes"].values()) == 6
    assert result["in_flight_at_fault"] >= 1, result  # (the kill met work under way)
    assert set(result["in_flight_outcomes"]) <= {"OK", "UNAVAILABLE"}
    assert sum(result["in_flight_outcomes"].values()) == result["in_flight_at_fault"]


def test_a_worker_killed_under_graphs_hangs_nothing_and_graphs_run_again(cluster):
    """The same with RunGraph debates, whose waves decode on the Worker replica: the kill meets debates under way,
    each debate completes or fails with UNAVAILABLE, none hangs, and a new debate completes once Serve has
    replaced the replica."""
    from braid.loadtest.chaos import kill_worker_under_graphs

    _, _, _, _, local = cluster
    result = kill_worker_under_graphs(local.address, graphs=4, after_s=1.0, max_tokens=400)
    assert result["passed"] and result["hung"] == 0 and result["in_flight_at_fault"] >= 1, result
    assert set(result["outcomes"]) <= {"OK", "UNAVAILABLE"} and sum(result["outcomes"].values()) == 4
    assert set(result["in_flight_outcomes"]) <= {"OK", "UNAVAILABLE"}  # (the debates the kill met, each ended so)
    assert sum(result["in_flight_outcomes"].values()) == result["in_flight_at_fault"]


def test_a_client_that_leaves_stops_the_work_on_every_replica(cluster):
    """A cancelled RunWorkflow (the client went away, or its deadline passed) ends the workers' decoding on
    their replica within seconds, instead of running to max_tokens: a bare cancel (also once the answer
    streams, in a staircase), a gRPC deadline alone, and the deadline Braid's clients also send as metadata
    (client_metadata), which the ingress enforces. (Serve's own proxy handler misses a cancel that lands while
    it writes; cluster.grpc_proxy registers the service so that none is missed.)"""
    from ray import serve

    from braid.api.auth import client_metadata

    stub, *_ = cluster
    worker = serve.get_deployment_handle("Worker", app_name="braid")
    synthesizer = serve.get_deployment_handle("Synthesizer", app_name="braid")
    long = pb.Sampling(max_tokens=2000, ignore_eos=True)
    # staircase: left while the answer and workers decode; grpc-deadline: a gRPC deadline alone, no metadata
    for stop in ("cancel", "deadline", "grpc-deadline", "staircase"):
        call = stub.RunWorkflow(pb.WorkflowRequest(
            task="t", branch_prompts=["a", "b"], synthesis_prompt="s", transport=pb.TRANSPORT_GRPC,
            worker_sampling=long, synthesis_sampling=pb.Sampling(max_tokens=1000, ignore_eos=True)
            if stop == "staircase" else GREEDY,
            **({"staircase": pb.StaircaseOptions(aggregator_chunks=[4])} if stop == "staircase" else {})),
            metadata=METADATA + (client_metadata(None, 3.0) if stop == "deadline" else ()),
            timeout=3 if "deadline" in stop else 120)
        with pytest.raises(grpc.RpcError) as err:
            for i, event in enumerate(call):
                if stop != "staircase" and event.HasField("branch_token") and i == 5:
                    assert worker.load.remote().result()["running"] >= 1
                if stop == "cancel" and i == 5 or stop == "staircase" and event.HasField("synthesis_token"):
                    call.cancel()
        assert err.value.code() == (grpc.StatusCode.DEADLINE_EXCEEDED if "deadline" in stop else
                                    grpc.StatusCode.CANCELLED)
        deadline = time.monotonic() + 5  # (running to max_tokens would take far longer)
        while (worker.load.remote().result()["running"] or synthesizer.load.remote().result()["running"]) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        for role in (worker, synthesizer):
            assert role.load.remote().result() == {"waiting": 0, "running": 0, "reserved_bytes": 0}, (stop, role)


def test_a_synthesizer_killed_under_session_load_loses_no_session(cluster):
    """The chaos script's short version of kill-synthesizer: two colocated Synthesizer replicas hold three sessions;
    under session calls and workflows, the replica holding the most is SIGKILLed. The calls under way at the kill
    fail at most with UNAVAILABLE, none hangs, a new workflow completes, and afterwards every id of every session
    answers and its greedy Decode gives the tokens it gave before."""
    from ray import serve

    from braid.cluster.app import build_app
    from braid.loadtest.chaos import kill_synthesizer_under_load
    from braid.loadtest.workload import Workload

    _, config, _, _, local = cluster
    two = ClusterConfig(config.model_path, colocate=True, synthesizer_replicas=2, grpc_port=config.grpc_port)
    serve.run(build_app(two, local.redis_url), name="braid-kill", route_prefix="/kill")
    try:
        result = kill_synthesizer_under_load(local.address, local.redis_url, sessions=3, concurrency=2, after_s=1.0,
                                             settle_s=3.0, timeout=60, metadata=(("application", "braid-kill"),),
                                             workload=Workload(branches=(2,), worker_max_tokens=16,
                                                               answer_max_tokens=8))
    finally:
        serve.delete("braid-kill")
    assert result["passed"], (result["why_failed"], result["in_flight_by_kind"])
    assert result["in_flight_at_fault"] >= 1 and result["hung"] == 0 and result["sessions_lost"] == 0
    assert result["replicas_before"] == 2 and result["sessions_on_replaced"] >= 1


def test_free_ports_lie_below_the_range_the_kernel_hands_out():
    """free_port: a port free on every interface, below ip_local_port_range, so that no socket Ray opens while it
    starts is given it before its server binds it (a port from that range once was, failing a deploy)."""
    import socket

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    for _ in range(20):
        port = free_port()
        assert 10000 <= port < ephemeral
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))
