"""RunGraph's waves on worker engines (synthesizer.waves): the same graph, decoded on two workers that fetch their
parents from the holder over KVExport and ship their outputs back over the gRPC KV transport, answers as it does
on the holder alone; a failed or abandoned worker call keeps nothing anywhere. Real Redis, real gRPC; only
Serve's response stream is played in-process (InThreadCall)."""

import itertools
import threading

import pytest
import torch

from braid.api.sessions import SessionAPI
from braid.engine import Engine, EngineConfig
from braid.engine.errors import UnknownMessageError
from braid.kv.connector import TransferError, Transport
from braid.kv.export import fetch
from braid.kv.receiver import KVReceiver
from braid.protos import agent_pb2 as pb
from braid.runtime.directory import Directory, EmbeddedRedis
from braid.runtime.sessions import ServiceConfig, Sessions
from braid.synthesizer.waves import WaveWorkers, WorkerWaves
from braid.workers import runner
from braid.workers.runner import BranchRunner, WorkerConfig

GREEDY = pb.Sampling(max_tokens=6, ignore_eos=True)


class InThreadCall:
    """A Serve response stream, played in this process: the worker's generator runs on the reading thread;
    `cancel()`, from any thread, ends it at its next item."""

    def __init__(self, items, fail_after: int | None = None):
        self.items, self.fail_after = items, fail_after
        self.cancelled, self.closed = threading.Event(), threading.Event()

    def __iter__(self):
        try:
            for n, item in enumerate(self.items):
                if self.cancelled.is_set():
                    raise RuntimeError("cancelled")
                if self.fail_after is not None and n == self.fail_after:
                    raise ConnectionError("the worker's replica died")
                yield item
        finally:
            self.items.close()  # (the worker's call has ended, and freed what it made)
            self.closed.set()

    def cancel(self):
        self.cancelled.set()


@pytest.fixture(scope="module")
def cluster(checkpoint):
    redis_server = EmbeddedRedis()
    config = EngineConfig(checkpoint("llama"))
    holder = Engine(config)
    logic = Sessions(holder, Directory.connect(redis_server.url), ServiceConfig(replica="H"))
    exports = logic.start_upkeep()
    receiver = KVReceiver(holder.fingerprint)
    workers = [BranchRunner(Engine(config), WorkerConfig(), f"worker-{i}") for i in range(2)]
    turn = itertools.count()
    calls: list[InThreadCall] = []
    plan = {"fail_after": None}

    def call(req):  # (round-robin, so that both workers take part in every wave of two calls or more)
        c = InThreadCall(workers[next(turn) % 2].run_nodes(req), plan["fail_after"])
        calls.append(c)
        return c

    def on_workers(enabled: bool):
        logic.waves = (lambda sid: WorkerWaves(holder, receiver, exports, WaveWorkers(call, 2), sid, logic.lend)
                       ) if enabled else None

    yield logic, workers, on_workers, calls, plan
    logic.stop_upkeep()
    receiver.stop()
    redis_server.stop()


def graph(session_id=""):
    """Role a's private system prompt, a shared question, two rounds of three debaters (the second reading every
    first-round reply), one of them read as text, and a judge."""
    nodes = [pb.GraphNode(name="sys", prompt="System: be brief.", role="a", private=True),
             pb.GraphNode(name="q", prompt="User: 2 and 3?")]
    for r in range(2):
        for i in range(3):
            parents = [pb.GraphParent(node="sys")] if i == 0 else []
            parents += [pb.GraphParent(node="q")] + [pb.GraphParent(node=f"r0d{j}") for j in range(3) if r]
            nodes.append(pb.GraphNode(name=f"r{r}d{i}", prompt=f"Agent {i}:", role="a" if i == 0 else f"b{i}",
                                      decode=True, sampling=GREEDY, parents=parents,
                                      output="text" if (r, i) == (0, 2) else "kv"))
    nodes.append(pb.GraphNode(name="judge", prompt="Judge:", role="b1", decode=True, sampling=GREEDY,
                              parents=[pb.GraphParent(node=f"r1d{j}") for j in range(3)]))
    return pb.GraphRequest(session_id=session_id, nodes=nodes)


def run(logic, request):
    events = list(SessionAPI(logic).RunGraph(request))
    done = {e.node_done.node: e.node_done for e in events if e.HasField("node_done")}
    tokens = {}
    for e in events:
        if e.HasField("token"):
            tokens.setdefault(e.token.node, []).append(e.token.token_id)
    return events[-1].done.session_id, done, tokens


def new_messages(engine: Engine, before: set[str], copies=()) -> list:
    """Messages stored since `before`, other than the prefix cache's own entries and `copies`."""
    return [engine.message(m) for m in engine.store.ids() if m not in before and m not in set(copies)
            and engine.message(m).content_key is None]


def test_waves_on_workers_answer_as_the_holder_does(cluster, monkeypatch):
    logic, workers, on_workers, _, _ = cluster
    fetched = []  # (the worker's channel, message): each worker fetches a parent once, for every wave
    real = runner.fetch_many
    monkeypatch.setattr(runner, "fetch_many", lambda channel, address, session, ids, *a: fetched.extend(
        (id(channel), m) for m in ids) or real(channel, address, session, ids, *a))
    before = [set(w.engine.store.ids()) for w in workers]
    on_workers(False)
    sid_here, here, tokens_here = run(logic, graph())
    on_workers(True)
    sid, there, tokens = run(logic, graph())
    assert list(there) == list(here) and tokens == tokens_here  # greedy tokens, node by node
    decoding = [n for n in there if n.startswith(("r", "judge"))]
    assert all(here[n].replica == "" for n in here)
    assert {there[n].replica for n in decoding} == {"worker-0", "worker-1"}  # the waves were spread
    assert all(there[n].replica == "" for n in ("sys", "q"))  # (prompt-only nodes encode on the holder)
    assert [list(there[n].reencoded) for n in there] == [list(here[n].reencoded) for n in here]
    # outputs are session messages on the holder, as close to the holder's own as fp32 batching allows
    shared = [n for n in there if there[n].message_id]
    assert shared == [n for n in here if here[n].message_id] and "judge" in shared and "r0d0" not in shared
    for n in shared:
        a, b = logic.engine.message(here[n].message_id), logic.engine.message(there[n].message_id)
        assert a.token_ids == b.token_ids and a.offset == b.offset and len(a.parents) == len(b.parents)
        assert a.parent_offsets == b.parent_offsets
        torch.testing.assert_close(b.kv.read(), a.kv.read(), atol=1e-4, rtol=1e-4)
        assert logic.directory.lookup(sid, there[n].message_id).replica == "H"
    # the workers kept only copies of the parents they read (one per message, for later waves), and nothing
    # stays lent
    for w, old in zip(workers, before):
        assert new_messages(w.engine, old, w.copies.values()) == [] and w.engine.scheduler.load["running"] == 0
        assert len(new_messages(w.engine, old)) == len(w.copies) > 0
    assert len(fetched) == len(set(fetched)) == sum(len(w.copies) for w in workers)
    assert not logic._lent  # (nothing stays lent: the workers can fetch only the session's own messages)
    # and a session's outputs are served to that session only
    with pytest.raises(UnknownMessageError):
        fetch(logic.exporter.address, sid_here, there["judge"].message_id, logic.engine.fingerprint)
    for s in (sid, sid_here):
        SessionAPI(logic).CloseSession(pb.CloseSessionRequest(session_id=s))


def test_a_failed_or_abandoned_worker_call_keeps_nothing(cluster):
    logic, workers, on_workers, calls, plan = cluster
    on_workers(True)
    stored, sessions = set(logic.engine.store.ids()), logic.directory.list_sessions()
    before = [set(w.engine.store.ids()) for w in workers]
    plan["fail_after"] = 3  # every worker call dies after its third token
    try:
        with pytest.raises(TransferError, match="the worker's replica died"):
            run(logic, graph())
    finally:
        plan["fail_after"] = None
    # a client that leaves while the first round decodes on the workers
    made = len(calls)
    events = SessionAPI(logic).RunGraph(graph())
    for e in events:
        if e.HasField("token"):
            break
    events.close()
    assert len(calls) - made == 2 and all(c.cancelled.is_set() for c in calls[made:])
    assert all(c.closed.wait(10) for c in calls)  # (every worker call has ended)
    for w, old in zip(workers, before):
        assert new_messages(w.engine, old, w.copies.values()) == [] and w.engine.scheduler.load["running"] == 0
    assert new_messages(logic.engine, stored) == [] and not logic._lent
    assert logic.directory.list_sessions() == sessions  # (the sessions these calls opened were closed again)
    # and the next graph runs; each worker keeps at most COPIES parents' copies, the oldest going first
    workers[0].COPIES = 2
    sid, done, _ = run(logic, graph())
    assert done["judge"].replica.startswith("worker-") and len(workers[0].copies) == 2
    assert all(copy in workers[0].engine.store for copy in workers[0].copies.values())
    SessionAPI(logic).CloseSession(pb.CloseSessionRequest(session_id=sid))


# ---- staircase waves: the workers ship each reply in chunks as it decodes ------------------------------------
def executor(cluster, session="s"):
    logic, _, on_workers, _, _ = cluster
    on_workers(True)
    return logic.waves(session)


@pytest.mark.parametrize("output", ["kv", "text"])
def test_a_staircase_node_streams_the_workers_replies_as_the_holder_does(cluster, output):
    """Chunks larger than any reply: the staircase node on the holder takes the workers' whole replies, as it does
    from its own engine's decode, and gives the same greedy tokens, node for node."""
    from test_dag_staircase import WHOLE, moa, tokens_of

    from braid.methods.dag import DagRun, NodeRound

    logic = cluster[0]
    here = DagRun(logic.engine, moa(True, output, schedule=WHOLE))
    h_events = list(here)
    there = DagRun(logic.engine, moa(True, output, schedule=WHOLE), executor(cluster))
    t_events = list(there)
    for name in ("p0", "p1", "p2", "agg"):
        assert tokens_of(t_events, name) == tokens_of(h_events, name), name
    rounds = [e for e in t_events if isinstance(e, NodeRound)]
    assert len(rounds) == 1 and all(rounds[0].chunks[p] == (0, logic.engine.message(there.outputs[p]).num_tokens)
                                    for p in ("p0", "p1", "p2"))
    done = {e.node: e for e in t_events if hasattr(e, "replica")}
    assert {done[p].replica for p in ("p0", "p1", "p2")} == {"worker-0", "worker-1"} and done["agg"].replica == ""
    here.free()
    there.free()


def test_a_staircase_node_answers_from_the_workers_first_chunks(cluster):
    """Small chunks: the staircase node's answer starts before the workers' replies end, from chunks they ship
    as they decode; the replies' outputs still arrive whole on the holder."""
    from test_dag_staircase import moa

    from braid.engine import SamplingParams
    from braid.methods.dag import DagRun, NodeRound, NodeToken
    from braid.methods.staircase import StaircaseSchedule

    logic = cluster[0]
    long = SamplingParams(max_tokens=60, ignore_eos=True)
    graph = moa(True, sampling=long, schedule=StaircaseSchedule(proposer=(4, 8), aggregator=(2, 4)))
    run = DagRun(logic.engine, graph, executor(cluster))
    events = list(run)
    first_answer = next(i for i, e in enumerate(events) if isinstance(e, NodeToken) and e.node == "agg")
    last_reply = max(i for i, e in enumerate(events) if isinstance(e, NodeToken) and e.node.startswith("p"))
    assert first_answer < last_reply  # (it answered while they decoded)
    rounds = [e for e in events if isinstance(e, NodeRound)]
    assert rounds[0].chunks and all(end < logic.engine.message(run.outputs[p]).num_tokens
                                    for p, (_, end) in rounds[0].chunks.items())
    for p in ("p0", "p1", "p2"):
        assert len(logic.engine.message(run.outputs[p]).token_ids) > 60
    run.free()


def test_a_failed_worker_fails_a_staircase_wave_and_keeps_nothing(cluster):
    """A worker call that dies while a staircase node streams its wave fails the run (the staircase stops too),
    and neither the holder nor the workers keep anything of it; so does a run left midway."""
    from test_dag_staircase import moa

    from braid.engine import SamplingParams
    from braid.methods.dag import DagRun, NodeToken
    from braid.methods.staircase import StaircaseSchedule

    logic, workers, _, calls, plan = cluster
    graph = moa(True, sampling=SamplingParams(max_tokens=60, ignore_eos=True),
                schedule=StaircaseSchedule(proposer=(4, 8), aggregator=(2, 4)))
    stored = set(logic.engine.store.ids())
    before = [set(w.engine.store.ids()) for w in workers]
    plan["fail_after"] = 20
    try:
        run = DagRun(logic.engine, graph, executor(cluster))
        with pytest.raises(TransferError, match="the worker's replica died"):
            list(run)
        run.free(keep=())
    finally:
        plan["fail_after"] = None
    run = DagRun(logic.engine, graph, executor(cluster))
    events = iter(run)
    for e in events:
        if isinstance(e, NodeToken) and e.node == "agg":
            break  # (the client leaves once the answer streams)
    events.close()
    run.free(keep=())
    assert all(c.closed.wait(10) for c in calls)
    for w, old in zip(workers, before):
        assert new_messages(w.engine, old, w.copies.values()) == [] and w.engine.scheduler.load["running"] == 0
    assert new_messages(logic.engine, stored) == [] and not logic._lent


def test_a_worker_keeps_few_channels_to_holders_and_never_closes_one_in_use(cluster, monkeypatch):
    """Holder replicas come and go over a long life: a worker keeps at most CHANNELS channels to them, closing the
    least recently used idle one past that, never one a fetch is reading from."""
    import grpc

    logic, workers, *_ = cluster
    worker = BranchRunner(logic.engine, WorkerConfig(), "channels")
    monkeypatch.setattr(BranchRunner, "CHANNELS", 3)
    busy = worker._channel("127.0.0.1:1")  # a fetch from this holder is still running
    opened = {}
    for port in range(2, 8):
        opened[port] = worker._channel(f"127.0.0.1:{port}")
        worker._fetching[f"127.0.0.1:{port}"] -= 1  # (its fetch ended)
    assert list(worker.channels) == ["127.0.0.1:1", "127.0.0.1:6", "127.0.0.1:7"]
    assert worker._channel("127.0.0.1:7") is opened[7]  # kept and reused
    for port in range(2, 6):  # the ones let go are closed
        with pytest.raises(ValueError, match="closed channel"):
            opened[port].unary_unary("/braid.Test/Ping")(b"", timeout=1)
    with pytest.raises(grpc.RpcError) as err:  # the busy one is open (nothing listens there: UNAVAILABLE)
        busy.unary_unary("/braid.Test/Ping")(b"", timeout=1)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    # a fetch that fails leaves its channel idle (closable), and nothing opens one when no parent is missing
    from braid.engine import DecodeCall
    from braid.runtime.messages import NodesRequest

    def fail(*args, **kwargs):
        raise TransferError("the holder went away")

    monkeypatch.setattr(runner, "fetch_many", fail)
    req = NodesRequest("s", "sess", "127.0.0.1:9", logic.engine.fingerprint, [DecodeCall("x", parents=["m"])],
                       "127.0.0.1:9", Transport.GRPC)
    with pytest.raises(TransferError):
        worker._parents(req, [], [])
    assert worker._fetching["127.0.0.1:9"] == 0 and "127.0.0.1:9" in worker.channels
    before = dict(worker.channels)
    assert worker._parents(NodesRequest("s", "sess", "127.0.0.1:10", logic.engine.fingerprint,
                                        [DecodeCall("x")], "127.0.0.1:10", Transport.GRPC), [], []) == {}
    assert worker.channels == before
    for channel in worker.channels.values():
        channel.close()
