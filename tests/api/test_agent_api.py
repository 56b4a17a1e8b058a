"""The agent API over a real gRPC server and a real Redis, on one local engine."""

import time
from dataclasses import replace

import grpc
import pytest
import torch

from braid.cluster.inprocess import start_in_process
from braid.engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
from braid.engine.engine import CACHED_PREFIX
from braid.engine.errors import UnknownMessageError
from braid.kv.connector import TransferError
from braid.kv.export import HolderGoneError, fetch
from braid.methods.synthesis import synthesize
from braid.models.chat import WORKER_HEADER
from braid.protos import agent_pb2 as pb
from braid.protos import agent_pb2_grpc
from braid.runtime.directory import Directory, EmbeddedRedis
from braid.runtime.sessions import ServiceConfig


@pytest.fixture(scope="module")
def api(checkpoint):
    redis_server = EmbeddedRedis()
    engine = Engine(EngineConfig(checkpoint("llama")))
    server = start_in_process(engine, Directory.connect(redis_server.url))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield agent_pb2_grpc.AgentServiceStub(channel), server.sessions
    channel.close()
    server.stop()
    redis_server.stop()


GREEDY = pb.Sampling(max_tokens=6, ignore_eos=True)


def code_of(call):
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        list(result) if hasattr(result, "__iter__") else result
    return err.value.code(), err.value.details()


def test_choreography_round_trip(api):
    stub, logic = api
    r = stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text="User: hello"),
                                              pb.PrefillCallSpec(text="0 1 2", new_offset=50)]))
    a, b = r.message_ids
    events = list(stub.Decode(pb.DecodeRequest(session_id=r.session_id, calls=[
        pb.DecodeCallSpec(header="Assistant:", parents=[a, b], offsets=[-1, 20], sampling=GREEDY)])))
    assert len(events) == 6 and events[-1].finish_reason == "length" and events[-1].message_id
    info = stub.GetMessage(pb.GetMessageRequest(session_id=r.session_id, message_id=events[-1].message_id))
    assert list(info.parents) == [a, b] and info.kv_bytes > 0
    assert list(info.token_ids[-6:]) == [e.token_id for e in events]
    # the same call in process gives the same tokens
    eng = logic.engine
    local, = eng.decode([DecodeCall("Assistant:", parents=[a, b], offsets=[None, 20],
                                    sampling=SamplingParams(max_tokens=6, ignore_eos=True))])
    assert eng.message(local).token_ids == tuple(info.token_ids)


def test_workflow_matches_in_process_pipeline(api):
    stub, logic = api
    req = pb.WorkflowRequest(task="User: add the partial results.", branch_prompts=["Part 3.", "Part 4 and 5."],
                             synthesis_prompt="Synthesizer:", worker_sampling=GREEDY, synthesis_sampling=GREEDY,
                             transport=pb.TRANSPORT_LOCAL)  # asked for: this engine has no calibration
    events = list(stub.RunWorkflow(req))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds.count("branch_token") == 12 and kinds.count("synthesis_token") == 6
    assert kinds[-2:] == ["timings", "done"] and events[kinds.index("decision")].decision.transport == pb.TRANSPORT_LOCAL
    answer = [e.synthesis_token.token_id for e in events if e.HasField("synthesis_token")]

    eng = logic.engine
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    prefix = eng.prefill([PrefillCall(req.task)])
    ctx = eng.prefill([PrefillCall(p, parents=prefix) for p in req.branch_prompts])
    branches = eng.decode([DecodeCall(WORKER_HEADER, parents=[*prefix, c], sampling=greedy) for c in ctx])
    local = synthesize(eng, branches, "Synthesizer:", prefix=prefix, sampling=greedy)
    assert answer == list(eng.message(local).token_ids[-6:])
    assert events[-1].done.answer_text == eng.tokenizer.decode(answer)  # the answer alone, without the prompt

    # unasked, an uncalibrated synthesizer gets the branches' text, and the reason says why
    text_events = list(stub.RunWorkflow(pb.WorkflowRequest(
        task=req.task, branch_prompts=req.branch_prompts, synthesis_prompt="Synthesizer:", worker_sampling=GREEDY,
        synthesis_sampling=GREEDY)))
    decision, = [e.decision for e in text_events if e.HasField("decision")]
    assert decision.transport == pb.TRANSPORT_TEXT and "no calibration is loaded" in decision.reason
    assert not any(e.HasField("kv_receipt") for e in text_events) and text_events[-1].HasField("done")


def test_bad_requests_get_clear_statuses_and_the_server_keeps_serving(api):
    stub, logic = api
    mine = stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text="mine")]))
    other = stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text="theirs")]))
    sid, theirs = mine.session_id, other.message_ids[0]
    limit = logic.engine.spec.max_positions
    cases = [
        (grpc.StatusCode.NOT_FOUND, "not in session", lambda: stub.Decode(pb.DecodeRequest(
            session_id=sid, calls=[pb.DecodeCallSpec(header="A:", parents=[theirs])]))),
        (grpc.StatusCode.NOT_FOUND, "unknown session", lambda: stub.Prefill(pb.PrefillRequest(
            session_id="no-such-session", calls=[pb.PrefillCallSpec(text="x")]))),
        (grpc.StatusCode.NOT_FOUND, "not in session", lambda: stub.GetMessage(pb.GetMessageRequest(
            session_id=sid, message_id=theirs))),
        (grpc.StatusCode.INVALID_ARGUMENT, "offset -5", lambda: stub.Decode(pb.DecodeRequest(session_id=sid, calls=[
            pb.DecodeCallSpec(header="A:", parents=mine.message_ids, offsets=[-5])]))),
        (grpc.StatusCode.INVALID_ARGUMENT, "header is empty", lambda: stub.Decode(pb.DecodeRequest(
            session_id=sid, calls=[pb.DecodeCallSpec(parents=mine.message_ids)]))),
        (grpc.StatusCode.INVALID_ARGUMENT, "top_p", lambda: stub.Generate(pb.GenerateRequest(
            prompt="hi", sampling=pb.Sampling(top_p=2.0)))),
        (grpc.StatusCode.INVALID_ARGUMENT, "branch_prompts", lambda: stub.RunWorkflow(pb.WorkflowRequest(
            task="t", synthesis_prompt="s"))),
        (grpc.StatusCode.INVALID_ARGUMENT, "placement", lambda: stub.RunWorkflow(pb.WorkflowRequest(
            task="t", branch_prompts=["a"], synthesis_prompt="s", placement="diagonal"))),
        # (this server is colocated: its workers hand whole messages over, so there are no chunks to read early)
        (grpc.StatusCode.FAILED_PRECONDITION, "this cluster is colocated", lambda: stub.RunWorkflow(
            pb.WorkflowRequest(task="t", branch_prompts=["a"], synthesis_prompt="s",
                               staircase=pb.StaircaseOptions()))),
        (grpc.StatusCode.OUT_OF_RANGE, str(limit), lambda: stub.Generate(pb.GenerateRequest(
            prompt="hi", sampling=pb.Sampling(max_tokens=limit)))),
    ]
    for code, needle, call in cases:
        got, details = code_of(call)
        assert got == code and needle in details, (code, needle, got, details)

    budget = logic.engine.store.budget_bytes
    logic.engine.store.budget_bytes = logic.engine.store.used_bytes  # full, and everything is evictable...
    with logic.engine.store.pinned(logic.engine.store.ids()):  # ...unless in use
        got, details = code_of(lambda: stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text="x")])))
    logic.engine.store.budget_bytes = budget
    assert got == grpc.StatusCode.RESOURCE_EXHAUSTED and "store full" in details

    # nothing was lost: the other session still works
    events = list(stub.Decode(pb.DecodeRequest(session_id=other.session_id, calls=[
        pb.DecodeCallSpec(header="A:", parents=[theirs], sampling=GREEDY)])))
    assert events[-1].message_id
    assert stub.Health(pb.HealthRequest()).status == "SERVING"


def test_sessions_list_and_close(api):
    stub, logic = api
    r = stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text="a"), pb.PrefillCallSpec(text="b")]))
    listed = {s.session_id: s for s in stub.ListSessions(pb.ListSessionsRequest()).sessions}
    assert listed[r.session_id].messages == 2
    assert stub.CloseSession(pb.CloseSessionRequest(session_id=r.session_id)).freed_messages == 2
    assert all(m not in logic.engine.store for m in r.message_ids)
    assert code_of(lambda: stub.CloseSession(pb.CloseSessionRequest(session_id=r.session_id)))[0] == \
        grpc.StatusCode.NOT_FOUND


@pytest.fixture
def two_replicas(checkpoint):
    """Two agent API servers, each on its own engine, sharing one Redis: two synthesizer replicas."""
    redis_server = EmbeddedRedis()
    servers = [start_in_process(Engine(EngineConfig(checkpoint("llama"))), Directory.connect(redis_server.url),
                                ServiceConfig(replica=name)) for name in ("A", "B")]
    for s in servers:
        s.sessions.start_upkeep()
    channels = [grpc.insecure_channel(f"127.0.0.1:{s.port}") for s in servers]
    yield [agent_pb2_grpc.AgentServiceStub(c) for c in channels], [s.sessions for s in servers]
    for c, s in zip(channels, servers):
        c.close()
        s.sessions.stop_upkeep()
        s.stop()
    redis_server.stop()


def decode(stub, sid, parents, header="A:"):
    return list(stub.Decode(pb.DecodeRequest(session_id=sid, calls=[
        pb.DecodeCallSpec(header=header, parents=parents, sampling=GREEDY)])))


def test_session_calls_work_on_any_replica_by_moving_messages(two_replicas):
    """A session's call that reaches the other replica moves the messages it names there, bit for bit, and
    answers as the holder would; closing the session on one replica frees the copies on the other."""
    (a, b), (logic_a, logic_b) = two_replicas
    r = a.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text="User: hello there"),
                                            pb.PrefillCallSpec(text="0 1 2", new_offset=40)]))
    sid, ids = r.session_id, list(r.message_ids)
    on_a = decode(a, sid, ids)
    assert all(m not in logic_b.engine.store for m in ids)
    on_b = decode(b, sid, ids)  # reaches B: both parents move from A
    assert [e.token_id for e in on_b] == [e.token_id for e in on_a]
    for m in ids:
        here, there = logic_a.engine.message(m), logic_b.engine.message(m)
        assert here.token_ids == there.token_ids and here.offset == there.offset
        assert torch.equal(here.kv.read(), there.kv.read())
        assert logic_b.directory.lookup(sid, m).replica == "B"  # later moves fetch from B
    # B's answer moves to A for the next call; GetMessage on A shows it as B stored it
    answer = on_b[-1].message_id
    info = a.GetMessage(pb.GetMessageRequest(session_id=sid, message_id=answer))
    assert list(info.parents) == ids and list(info.token_ids[-6:]) == [e.token_id for e in on_b]
    assert len(decode(a, sid, [answer], header="B:")) == 6
    # another session cannot fetch them, and a message whose holder has gone is NOT_FOUND with the reason
    other = b.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text="other")]))
    assert code_of(lambda: decode(b, other.session_id, [ids[0]]))[0] == grpc.StatusCode.NOT_FOUND
    with pytest.raises(UnknownMessageError):
        fetch(logic_a.exporter.address, other.session_id, ids[0], logic_a.engine.fingerprint)
    # a message whose holder has gone is encoded again from its lineage; one whose lineage lacks what shaped it
    # is DATA_LOSS (not worth a retry), never UNAVAILABLE
    lost = a.Prefill(pb.PrefillRequest(session_id=sid, calls=[pb.PrefillCallSpec(text="lost")])).message_ids[0]
    rec = logic_a.directory.lookup(sid, lost)
    rec.replica, rec.lineage = "gone", logic_a.directory.lineage(sid, lost)
    logic_a.directory.register(rec)
    assert len(decode(b, sid, [lost])) == 6 and logic_b.directory.lookup(sid, lost).replica == "B"
    shaped = a.Prefill(pb.PrefillRequest(session_id=sid, calls=[pb.PrefillCallSpec(text="mapped")])).message_ids[0]
    rec = logic_a.directory.lookup(sid, shaped)
    rec.replica = "gone"
    rec.lineage = replace(logic_a.directory.lineage(sid, shaped), unrecorded="a KV transform's copies of its parents")
    logic_a.directory.register(rec)
    got, details = code_of(lambda: decode(b, sid, [shaped]))
    assert got == grpc.StatusCode.DATA_LOSS and "a KV transform" in details and "gone" in details
    # closing on A frees A's messages at once and B's copies at B's next upkeep
    assert a.CloseSession(pb.CloseSessionRequest(session_id=sid)).freed_messages >= 3
    assert logic_b.upkeep() >= 3
    assert all(m not in logic_b.engine.store for m in [*ids, answer])
    assert all(m not in logic_a.engine.store for m in [*ids, answer])



def _turns(stub, sid=""):
    """A session of several turns: a system prompt and a question, a reply, a follow-up and its reply."""
    r = stub.Prefill(pb.PrefillRequest(session_id=sid, calls=[pb.PrefillCallSpec(text="System: be brief."),
                                                               pb.PrefillCallSpec(text="User: 2 and 3?")]))
    sid, ids = r.session_id, list(r.message_ids)
    ids.append(decode(stub, sid, ids, header="Assistant:")[-1].message_id)
    ids += stub.Prefill(pb.PrefillRequest(session_id=sid, calls=[
        pb.PrefillCallSpec(text="User: and 4?", parents=ids)])).message_ids
    ids.append(decode(stub, sid, ids, header="Assistant:")[-1].message_id)
    return sid, ids


@pytest.mark.parametrize("how", ["crashed", "drained"])
def test_a_session_survives_the_loss_of_its_replica(two_replicas, how):
    """Replica A holds a session of several turns and goes away: crashed (its port refuses connections while its
    address is still announced) or drained (it withdrew its address). On B every message id still resolves,
    each encoded again from its lineage, parents first, within batching noise of A's KV; a greedy Decode gives
    the tokens it gave on A; B holds them now, and its recovery counters say so."""
    (a, b), (logic_a, logic_b) = two_replicas
    sid, ids = _turns(a)
    before = [e.token_id for e in decode(a, sid, ids, header="Q:")]
    held = {m: logic_a.engine.message(m) for m in ids}
    assert all(logic_a.directory.lookup(sid, m).replica == "A" for m in ids)
    if how == "crashed":
        logic_a.exporter.stop()  # (what a killed process leaves: an address nothing answers at)
        assert logic_b.directory.replica_address("A") is not None
    else:
        logic_a.stop_upkeep()
        assert logic_b.directory.replica_address("A") is None
    for m in ids:  # every id resolves on B (the last turn first: its parents come with it)
        info = b.GetMessage(pb.GetMessageRequest(session_id=sid, message_id=ids[-1 - ids.index(m)]))
        assert info.message_id
    assert [e.token_id for e in decode(b, sid, ids, header="Q:")] == before
    for m, original in held.items():
        again = logic_b.engine.message(m)
        assert (again.token_ids, again.offset, again.parents, again.parent_offsets) == \
            (original.token_ids, original.offset, original.parents, original.parent_offsets)
        torch.testing.assert_close(again.kv.read(), original.kv.read(), atol=1e-5, rtol=1e-4)
        assert logic_b.directory.lookup(sid, m).replica == "B"
    assert logic_b.recovery["messages"] == len(ids) and logic_b.recovery["holder_losses"] == len(ids)
    assert logic_b.recovery["tokens"] == sum(len(m.token_ids) for m in held.values())



@pytest.mark.parametrize("calibrated", [True], ids=["calibrated"])  # (uncalibrated, over gRPC: tests/cluster)
def test_a_kv_path_session_survives_the_loss_of_its_replica(checkpoint, tmp_path, calibrated):
    """A RunWorkflow whose synthesizer read the workers' KV (handed over in its store; uncalibrated, or through a
    calibration's mapper and adapter: tests/cluster has it shipped over gRPC), then its replica A crashes. On B,
    the answer, its branches and its prefix resolve, encoded again from their lineages: the branches, each after
    the prompt the worker read before it, in one prefill; then the answer, its synthesis replayed (placement,
    refresh, the same calibration). Their KV matches A's within batching noise, and a greedy Decode after the
    (uncalibrated) answer gives the tokens it gave on A."""
    from test_calibration import make_calibration

    from braid.methods.calibration import load_engine

    ckpt = checkpoint("llama")
    cal = make_calibration(ckpt, tmp_path / "cal", random=True) if calibrated else "none"
    redis_server = EmbeddedRedis()
    servers = [start_in_process(load_engine(EngineConfig(ckpt, calibration=cal)), Directory.connect(redis_server.url),
                                ServiceConfig(replica=name)) for name in ("A", "B")]
    channels = [grpc.insecure_channel(f"127.0.0.1:{s.port}") for s in servers]
    (a, b), (logic_a, logic_b) = [agent_pb2_grpc.AgentServiceStub(c) for c in channels], [s.sessions for s in servers]
    try:
        events = list(a.RunWorkflow(pb.WorkflowRequest(
            task="User: add the partial results.", branch_prompts=["Part 3.", "Part 4 and 5.", "Six"],
            synthesis_prompt="Synthesizer:", worker_sampling=GREEDY, synthesis_sampling=GREEDY,
            transport=pb.TRANSPORT_LOCAL)))
        done = events[-1].done
        sid, answer, branches = done.session_id, done.answer_message_id, list(done.branch_message_ids)
        decision, = [e.decision for e in events if e.HasField("decision")]
        assert len(branches) == 3 and decision.transport == pb.TRANSPORT_LOCAL
        # (a calibrated answer is stored as its adapter's: no call reads it, so only its KV is compared)
        after = None if calibrated else [e.token_id for e in decode(a, sid, [answer], header="Q:")]
        prefix = [p for p in logic_a.engine.message(answer).parents if p not in branches][:1]
        lineage = logic_a.directory.lineage(sid, answer)
        assert lineage.synthesis is not None and list(lineage.synthesis.branches) == branches
        assert lineage.synthesis.calibration == (logic_a.engine.calibration.record.digest if calibrated else "")
        held = {m: logic_a.engine.message(m) for m in [*prefix, *branches, answer]}
        logic_a.exporter.stop()  # (a crash: its address still announced, nothing answers there)
        prefills = []
        encode = logic_b.engine.prefill
        logic_b.engine.prefill = lambda calls, transform=None: prefills.append(len(calls)) or encode(calls, transform)
        info = b.GetMessage(pb.GetMessageRequest(session_id=sid, message_id=answer))
        assert list(info.token_ids) == list(held[answer].token_ids)
        # the prefix; the three branches with their prompts (six calls, one prefill); the answer, replayed
        assert prefills[0] == 1 and prefills[1] == 6 and len(prefills) == 3, prefills
        for m, original in held.items():
            again = logic_b.engine.message(m)
            assert (again.token_ids, again.offset, again.fingerprint) == \
                (original.token_ids, original.offset, original.fingerprint)
            torch.testing.assert_close(again.kv.read(), original.kv.read(), atol=1e-5, rtol=1e-4)
            assert logic_b.directory.lookup(sid, m).replica == "B"
        if not calibrated:
            assert [e.token_id for e in decode(b, sid, [answer], header="Q:")] == after
        assert logic_b.recovery["messages"] == 5 and logic_b.recovery["holder_losses"] == 5
        # a replica that runs another calibration (or none) cannot give the answer again: DATA_LOSS says why
        if calibrated:
            rec = logic_b.directory.lookup(sid, answer)
            rec.replica, rec.lineage = "gone", replace(lineage, synthesis=replace(lineage.synthesis, calibration="x"))
            logic_b.directory.register(rec)
            logic_b.engine.free(answer)
            got, details = code_of(lambda: b.GetMessage(pb.GetMessageRequest(session_id=sid, message_id=answer)))
            assert got == grpc.StatusCode.DATA_LOSS and "through calibration x" in details, details
    finally:
        for c, s in zip(channels, servers):
            c.close()
            s.sessions.stop_upkeep()
            s.stop()
        redis_server.stop()


def test_a_draining_replica_hands_its_messages_over(two_replicas):
    """Replica A drains: before it goes, B takes over every message A holds (fetched from A over KVExport, bit for
    bit; B is their holder in the directory), so that after A has gone nothing is encoded again: B's recovery
    counts them as adopted, none recomputed, and a greedy Decode gives the tokens it gave on A. A message another
    replica holds is not A's to hand over; a budget of 0 hands nothing over."""
    (a, b), (logic_a, logic_b) = two_replicas
    sessions = [_turns(a), _turns(a)]
    workflow = list(a.RunWorkflow(pb.WorkflowRequest(
        task="User: add.", branch_prompts=["a", "b"], synthesis_prompt="S:", worker_sampling=GREEDY,
        synthesis_sampling=GREEDY, transport=pb.TRANSPORT_LOCAL)))[-1].done
    sessions.append((workflow.session_id, [*workflow.branch_message_ids, workflow.answer_message_id]))
    before = [[e.token_id for e in decode(a, sid, ids[-1:], header="Q:")] for sid, ids in sessions]
    elsewhere = b.Prefill(pb.PrefillRequest(session_id=sessions[0][0], calls=[pb.PrefillCallSpec(text="B's")]))
    held = {m: logic_a.engine.message(m) for _, ids in sessions for m in ids}
    assert logic_a.hand_over(0) == {"held": 0, "handed_over": 0, "left": 0}
    report = logic_a.hand_over()
    assert report["handed_over"] == report["held"] >= len(held) and report["left"] == 0, report
    logic_a.stop_upkeep()
    logic_a.exporter.stop()
    for sid, ids in sessions:
        for m in ids:
            assert logic_b.directory.lookup(sid, m).replica == "B"
            assert torch.equal(logic_b.engine.message(m).kv.read(), held[m].kv.read())
    assert logic_b.directory.lookup(sessions[0][0], elsewhere.message_ids[0]).replica == "B"
    assert [[e.token_id for e in decode(b, sid, ids[-1:], header="Q:")] for sid, ids in sessions] == before
    assert logic_b.recovery["messages"] == 0 and logic_b.recovery["adopted"] == report["held"]


def test_a_draining_replica_takes_over_its_copies_of_a_crashed_holders_messages_first(two_replicas):
    """A message moved from A to B (B its holder, A keeping a copy); then B crashes, its address still announced.
    When A drains, its copy becomes A's (B refuses connections) before the hand-over, so the directory never names
    the crashed replica; with no live peer left, it stays for a call to bring it back."""
    (a, b), (logic_a, logic_b) = two_replicas
    r = a.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text="User: moved")]))
    sid, mid = r.session_id, r.message_ids[0]
    decode(b, sid, [mid])  # (moves it to B, which becomes its holder)
    assert logic_a.directory.lookup(sid, mid).replica == "B" and mid in logic_a.engine.store
    logic_b.exporter.stop()  # (a crash: its address still announced, nothing answers there)
    report = logic_a.hand_over(budget_s=5)
    assert logic_a.directory.lookup(sid, mid).replica == "A"
    assert report["held"] >= 1 and report["handed_over"] == 0 and report["left"] == report["held"]


def test_a_long_chain_of_turns_comes_back_without_deep_recursion(two_replicas):
    """A session whose every message reads the one before (a long conversation), its holder gone: the chain is
    encoded again ancestors first, one message at a time, past Python's recursion limit in depth."""
    import sys

    (a, b), (logic_a, logic_b) = two_replicas
    r = a.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text="User: start")]))
    sid, last = r.session_id, r.message_ids[0]
    depth = sys.getrecursionlimit() // 3
    for i in range(depth):
        last = a.Prefill(pb.PrefillRequest(session_id=sid, calls=[pb.PrefillCallSpec(text=f" {i % 10}",
                                                                                     parents=[last])])).message_ids[0]
    want = [e.token_id for e in decode(a, sid, [last])]
    logic_a.stop_upkeep()
    assert [e.token_id for e in decode(b, sid, [last])] == want
    assert logic_b.recovery["messages"] == depth + 1


def test_only_one_replica_takes_a_lost_message_over(two_replicas):
    """The take-over is fenced: of two replicas that find a message's holder gone, one becomes its holder."""
    (a, _), (logic_a, logic_b) = two_replicas
    sid, ids = _turns(a)
    d = logic_a.directory
    assert d.take_over(sid, ids[0], "A", "B") and not d.take_over(sid, ids[0], "A", "C")
    assert d.lookup(sid, ids[0]).replica == "B"
    assert not d.take_over("no-such-session", ids[0], "A", "B")


def test_a_holder_that_refuses_connections_is_told_from_a_slow_one(two_replicas):
    """Refused connections mean the holder has gone (encode again); a deadline means it is slow (UNAVAILABLE)."""
    (a, _), (logic_a, _) = two_replicas
    sid, ids = _turns(a)
    address, fp = logic_a.exporter.address, logic_a.engine.fingerprint
    import socket
    with socket.socket() as s:  # a port nothing listens at
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(HolderGoneError):
        fetch(closed, sid, ids[0], fp, timeout=5)
    listening = socket.socket()  # accepts nothing: a holder that does not answer in time
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    try:
        with pytest.raises(TransferError) as slow:
            fetch(f"127.0.0.1:{listening.getsockname()[1]}", sid, ids[0], fp, timeout=1)
        assert not isinstance(slow.value, HolderGoneError), slow.value
    finally:
        listening.close()
    assert fetch(address, sid, ids[0], fp).token_ids  # (the live holder answers)


def graph_request(session_id="", **overrides):
    nodes = [pb.GraphNode(name="sys", prompt="System: be brief.", role="a", private=True),
             pb.GraphNode(name="q", prompt="User: 2 and 3?"),
             pb.GraphNode(name="w0", prompt="A:", role="a", decode=True, sampling=GREEDY,
                          parents=[pb.GraphParent(node="sys"), pb.GraphParent(node="q")]),
             pb.GraphNode(name="w1", prompt="B:", role="b", decode=True, sampling=GREEDY,
                          parents=[pb.GraphParent(node="q")]),
             pb.GraphNode(name="judge", prompt="Judge:", role="b", decode=True, sampling=GREEDY,
                          parents=[pb.GraphParent(node="w0"), pb.GraphParent(node="w1")])]
    for name, changes in overrides.items():
        node = next(n for n in nodes if n.name == name)
        for k, v in changes.items():
            if k == "parents":
                del node.parents[:]
                node.parents.extend(v)
            elif k == "sampling":
                node.sampling.CopyFrom(v)
            else:
                setattr(node, k, v)
    return pb.GraphRequest(session_id=session_id, nodes=nodes)


def test_run_graph_streams_every_node_and_keeps_outputs_in_the_session(api):
    stub, logic = api
    events = list(stub.RunGraph(graph_request()))
    done = {e.node_done.node: e.node_done for e in events if e.HasField("node_done")}
    assert list(done) == ["sys", "q", "w0", "w1", "judge"] and events[-1].HasField("done")
    sid = events[-1].done.session_id
    for name in ("w0", "w1", "judge"):
        toks = [e.token.token_id for e in events if e.HasField("token") and e.token.node == name]
        assert len(toks) == 6 and "".join(e.token.text for e in events if e.HasField("token")
                                          and e.token.node == name) == done[name].text
    assert list(done["judge"].reencoded) == ["w0:private"]  # w0 saw role a's private system prompt
    # the outputs are the session's: a later call reads the judge's answer
    info = stub.GetMessage(pb.GetMessageRequest(session_id=sid, message_id=done["judge"].message_id))
    assert list(info.token_ids[-6:]) == [e.token.token_id for e in events if e.HasField("token")
                                         and e.token.node == "judge"]
    again = list(stub.RunGraph(pb.GraphRequest(session_id=sid, nodes=[pb.GraphNode(
        name="next", prompt="More:", decode=True, sampling=GREEDY,
        parents=[pb.GraphParent(message_id=done["judge"].message_id)])])))
    assert again[-1].done.session_id == sid
    # role a's private system prompt, and w0 (encoded with it in view), did not outlive the graph
    assert done["sys"].message_id == "" and done["w0"].message_id == "" and done["w1"].message_id
    assert stub.CloseSession(pb.CloseSessionRequest(session_id=sid)).freed_messages == 4  # q, w1, judge, next
    assert all(m not in logic.engine.store for m in [*(d.message_id for d in done.values())])


def test_run_graph_staircase_streams_rounds_and_refuses_bad_options(api):
    """A staircase judge answers from w0 and w1 as they decode: round events name the chunks it took in, and its
    answer is a session message like any other node's output."""
    stub, logic = api
    long = pb.Sampling(max_tokens=24, ignore_eos=True)
    request = graph_request(judge={"staircase": True}, w0={"sampling": long}, w1={"sampling": long})
    request.staircase.CopyFrom(pb.StaircaseOptions(proposer_chunks=[4, 8], aggregator_chunks=[2, 4]))
    events = list(stub.RunGraph(request))
    kinds = [e.WhichOneof("event") for e in events]
    rounds = [e.round for e in events if e.HasField("round")]
    assert rounds and all(r.node == "judge" for r in rounds) and rounds[0].round == 0
    assert {c.parent for r in rounds for c in r.chunks} <= {"w0", "w1"}
    first_judge = next(i for i, e in enumerate(events) if e.HasField("token") and e.token.node == "judge")
    last_worker = max(i for i, e in enumerate(events) if e.HasField("token") and e.token.node != "judge")
    assert first_judge < last_worker and kinds[-1] == "done"
    done = {e.node_done.node: e.node_done for e in events if e.HasField("node_done")}
    assert list(done["judge"].reencoded) == ["w0:private", "w1:text"]  # w0 saw role a's private system prompt
    assert done["judge"].message_id and done["judge"].text
    sid = events[-1].done.session_id
    for options, needle in ((pb.StaircaseOptions(variant="sideways"), "'sideways' is not one of reprefill, append"),
                            (pb.StaircaseOptions(proposer_chunks=[1] * 9), "at most 8 sizes"),
                            (pb.StaircaseOptions(redundancy=2), "redundancy 2 leaves no branch")):
        bad = graph_request(sid, judge={"staircase": True})
        bad.staircase.CopyFrom(options)
        got, details = code_of(lambda: list(stub.RunGraph(bad)))
        assert got == grpc.StatusCode.INVALID_ARGUMENT and needle in details, (needle, details)
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_bad_graphs_are_refused_before_anything_runs_and_leave_nothing(api):
    stub, logic = api
    other = stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text="another session's")]))
    sessions = len(logic.directory.list_sessions())
    before = set(logic.engine.store.ids())
    cases = [
        (grpc.StatusCode.INVALID_ARGUMENT, "cycle", graph_request(q={"parents": [pb.GraphParent(node="judge")]})),
        (grpc.StatusCode.INVALID_ARGUMENT, "is not a node of this graph",
         graph_request(w1={"parents": [pb.GraphParent(node="nope")]})),
        (grpc.StatusCode.INVALID_ARGUMENT, "private to role 'a'",
         graph_request(w1={"parents": [pb.GraphParent(node="sys")]})),
        (grpc.StatusCode.INVALID_ARGUMENT, "nodes[4].sampling", graph_request(judge={"sampling": pb.Sampling(
            temperature=float("nan"))})),
        (grpc.StatusCode.NOT_FOUND, "not in session", graph_request(w1={"parents": [
            pb.GraphParent(message_id=other.message_ids[0])]})),
        # fails in its last wave (a position past the context): what the earlier waves made goes too
        (grpc.StatusCode.INVALID_ARGUMENT, "out of range", graph_request(judge={"parents": [
            pb.GraphParent(node="w0"), pb.GraphParent(node="w1", offset=10 ** 7)]})),
    ]
    for code, needle, request in cases:
        got, details = code_of(lambda: stub.RunGraph(request))
        assert got == code and needle in details, (needle, got, details)
    assert len(logic.directory.list_sessions()) == sessions  # (the new sessions were closed again)
    made = set(logic.engine.store.ids()) - before
    assert all(m.startswith(CACHED_PREFIX) for m in made), made  # only the prefix cache's hidden twins


@pytest.mark.parametrize("rpc", ["Decode", "RunWorkflow", "RunGraph", "RunGraph-staircase", "deadline"])
def test_a_client_that_leaves_stops_its_work_and_leaves_no_session(api, rpc):
    stub, logic = api
    long = pb.Sampling(max_tokens=3000, ignore_eos=True)
    sessions = len(logic.directory.list_sessions())
    calls = {
        "Decode": lambda **kw: stub.Decode(pb.DecodeRequest(calls=[pb.DecodeCallSpec(header="A:", sampling=long)]),
                                           **kw),
        "RunWorkflow": lambda **kw: stub.RunWorkflow(pb.WorkflowRequest(
            task="t", branch_prompts=["a", "b"], synthesis_prompt="s", worker_sampling=long,
            transport=pb.TRANSPORT_LOCAL), **kw),
        "RunGraph": lambda **kw: stub.RunGraph(pb.GraphRequest(nodes=[
            pb.GraphNode(name="q", prompt="User: go"),
            *[pb.GraphNode(name=f"w{i}", prompt="A:", decode=True, sampling=long, parents=[pb.GraphParent(node="q")])
              for i in range(2)]]), **kw),
        "RunGraph-staircase": lambda **kw: stub.RunGraph(pb.GraphRequest(nodes=[
            pb.GraphNode(name="q", prompt="User: go"),
            *[pb.GraphNode(name=f"w{i}", prompt="A:", decode=True, sampling=long, parents=[pb.GraphParent(node="q")])
              for i in range(2)],
            pb.GraphNode(name="agg", prompt="J:", decode=True, sampling=long, staircase=True,
                         parents=[pb.GraphParent(node="w0"), pb.GraphParent(node="w1")])],
            staircase=pb.StaircaseOptions(proposer_chunks=[2], aggregator_chunks=[2])), **kw),
    }
    call = calls["Decode" if rpc == "deadline" else rpc](timeout=1.5 if rpc == "deadline" else 60)
    with pytest.raises(grpc.RpcError) as err:
        for i, event in enumerate(call):
            # (the staircase case leaves once its aggregator is answering too: every stage is running)
            if i == 5 if rpc != "RunGraph-staircase" else event.token.node == "agg":
                assert logic.engine.scheduler.load["running"] >= 1
                if rpc != "deadline":
                    call.cancel()
    assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
    # 3000 tokens take about 3.5 s here; stopped, the call leaves within a step or two. Allow 1 s, so a call
    # left running to max_tokens fails this
    deadline = time.monotonic() + 1.0
    while logic.engine.scheduler.load["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert logic.engine.scheduler.load == {"waiting": 0, "running": 0, "reserved_bytes": 0}
    deadline = time.monotonic() + 5  # (the handler thread closes the session it opened as it unwinds)
    while len(logic.directory.list_sessions()) > sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(logic.directory.list_sessions()) == sessions


def test_rpcs_beyond_the_servers_slots_wait_for_one_and_stop_ends_its_loop(checkpoint):
    """grpc_threads bounds the RPCs served at once: with one slot, a call made while a stream runs waits (one
    until its deadline passes) and is served once the stream has gone. stop() ends the server's event loop
    thread, and a second stop() does nothing."""
    import threading

    def loops():
        return {t for t in threading.enumerate() if t.name == "braid-grpc"}

    before = loops()
    redis_server = EmbeddedRedis()
    server = start_in_process(Engine(EngineConfig(checkpoint("llama"))), Directory.connect(redis_server.url),
                              grpc_threads=1)
    mine = loops() - before
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            stream = stub.Decode(pb.DecodeRequest(calls=[pb.DecodeCallSpec(
                header="A:", sampling=pb.Sampling(max_tokens=3000, ignore_eos=True))]))
            next(stream)  # (it holds the slot)
            with pytest.raises(grpc.RpcError) as err:
                stub.Health(pb.HealthRequest(), timeout=0.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            waiting = stub.Health.future(pb.HealthRequest(), timeout=30)
            time.sleep(0.5)
            assert not waiting.done()  # (queued behind the stream, not refused)
            stream.cancel()
            assert waiting.result().model_fingerprint == server.sessions.engine.fingerprint
    finally:
        server.stop()
        redis_server.stop()
    assert len(mine) == 1 and not any(t.is_alive() for t in mine)
    server.server.stop()  # (again: nothing left to stop)
