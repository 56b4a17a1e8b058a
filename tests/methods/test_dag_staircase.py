"""Staircase nodes in DAG workflows: validation, exactness against a node that waits (chunks large enough to
take whole branches), early answers from first chunks, leakage control, and a run left midway."""

import time

import pytest
import torch

from braid.engine import SamplingParams
from braid.engine.engine import CACHED_PREFIX
from braid.engine.errors import BraidError
from braid.methods.dag import DagRun, Edge, Graph, Node, NodeDone, NodeRound, NodeToken
from braid.methods.staircase import StaircaseSchedule, Variant

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
LONG = SamplingParams(max_tokens=40, ignore_eos=True)
WHOLE = StaircaseSchedule(proposer=(10_000,), aggregator=(10_000,))  # round 0 waits for whole branches


def moa(staircase: bool, output: str = "kv", sampling=GREEDY, proposers: int = 3, **graph) -> Graph:
    nodes = [Node("sys", "System: answer well."), Node("q", "User: what is 2 and 3?", parents=(Edge("sys"),))]
    nodes += [Node(f"p{i}", f"Proposer {i}:", role=f"p{i}", parents=(Edge("sys"), Edge("q")), sampling=sampling,
                   output=output) for i in range(proposers)]
    nodes.append(Node("agg", "Aggregated:", role="agg", sampling=GREEDY, staircase=staircase,
                      parents=(Edge("sys"), Edge("q"), *(Edge(f"p{i}") for i in range(proposers)))))
    return Graph(nodes, **graph)


def tokens_of(events, node):
    return [e.token_id for e in events if isinstance(e, NodeToken) and e.node == node]


def stream_nodes(*extra, **node):
    base = [Node("q", "Q"), Node("a", "A", sampling=GREEDY, parents=(Edge("q"),)),
            Node("b", "B", sampling=GREEDY, parents=(Edge("q"),))]
    return base + list(extra)


@pytest.mark.parametrize("nodes, needle, graph", [
    (stream_nodes(Node("s", "S", staircase=True, parents=(Edge("a"),))), "set decode", {}),
    (stream_nodes(Node("s", "S", staircase=True, sampling=GREEDY, parents=(Edge("q"),))),
     "no decoding node of this graph", {}),
    (stream_nodes(Node("s", "S", staircase=True, sampling=GREEDY, parents=(Edge("a"), Edge("q")))),
     "must come last", {}),
    (stream_nodes(Node("s", "S", staircase=True, sampling=GREEDY, parents=(Edge("a", offset=3),))),
     "leave their offsets unset", {}),
    (stream_nodes(Node("s", "S", staircase=True, sampling=GREEDY, parents=(Edge("a"), Edge("a")))),
     "twice", {}),
    (stream_nodes(Node("s", "S", staircase=True, sampling=GREEDY, parents=(Edge("a"),)),
                  Node("t", "T", staircase=True, sampling=GREEDY, parents=(Edge("s"), Edge("b")))),
     "all staircase nodes or none", {}),
    (stream_nodes(Node("c", "C", sampling=GREEDY, parents=(Edge("a"),)),
                  Node("s", "S", staircase=True, sampling=GREEDY, parents=(Edge("a"), Edge("c")))),
     "must decode together", {}),
    (stream_nodes(Node("c", "C", sampling=GREEDY, output="text", parents=(Edge("q"),)),
                  Node("s", "S", staircase=True, sampling=GREEDY, parents=(Edge("a"), Edge("c")))),
     "one output kind", {}),
    (stream_nodes(Node("late", "L", parents=(Edge("a"),)),
                  Node("s", "S", staircase=True, sampling=GREEDY, parents=(Edge("late"), Edge("b")))),
     "'late' is read whole", {}),
    (stream_nodes(Node("s", "S", staircase=True, sampling=GREEDY, parents=(Edge("a"), Edge("b")))),
     "redundancy 2 leaves no branch", {"schedule": StaircaseSchedule(redundancy=2)}),
])
def test_bad_staircase_nodes_are_refused_before_anything_runs(nodes, needle, graph):
    with pytest.raises(BraidError, match=needle) as err:
        Graph(nodes, **graph)
    assert err.value.code == "INVALID_ARGUMENT"


def test_a_staircase_node_runs_alongside_the_wave_it_streams():
    graph = moa(True)
    assert [([n.name for n in w], [n.name for n in a]) for w, a in graph.plan()] == [
        (["sys"], []), (["q"], []), (["p0", "p1", "p2"], ["agg"])]


@pytest.mark.parametrize("output", ["kv", "text"])
def test_taking_whole_branches_answers_as_the_node_that_waits(llama_engine, output):
    """Chunks larger than any reply: round 0 waits for the whole branches, so the staircase node reads what the
    waiting node reads, laid out the same way, and must give the same greedy tokens; its output message is
    the waiting node's, re-encoded after the same context."""
    eng = llama_engine
    waited = DagRun(eng, moa(False, output))
    w_events = list(waited)
    streamed = DagRun(eng, moa(True, output, schedule=WHOLE))
    s_events = list(streamed)
    for name in ("p0", "p1", "p2", "agg"):
        assert tokens_of(s_events, name) == tokens_of(w_events, name), name
    rounds = [e for e in s_events if isinstance(e, NodeRound)]
    assert len(rounds) == 1 and set(rounds[0].chunks) == {"p0", "p1", "p2"}
    for p in ("p0", "p1", "p2"):
        assert rounds[0].chunks[p] == (0, eng.message(streamed.outputs[p]).num_tokens)
    mine, theirs = eng.message(streamed.outputs["agg"]), eng.message(waited.outputs["agg"])
    assert mine.token_ids == theirs.token_ids and mine.offset == theirs.offset
    torch.testing.assert_close(mine.kv.read(), theirs.kv.read(), rtol=1e-4, atol=1e-4)
    assert [e.node for e in s_events if isinstance(e, NodeDone)][-1] == "agg"
    waited.free()
    streamed.free()


@pytest.mark.parametrize("variant", list(Variant))
@pytest.mark.parametrize("output", ["kv", "text"])
def test_small_chunks_answer_before_the_branches_end(llama_engine, variant, output):
    eng = llama_engine
    graph = moa(True, output, sampling=LONG, schedule=StaircaseSchedule(proposer=(4, 8), aggregator=(2, 4)),
                variant=variant)
    dag = DagRun(eng, graph)
    events = list(dag)
    first = next(i for i, e in enumerate(events) if isinstance(e, NodeToken) and e.node == "agg")
    last_branch = max(i for i, e in enumerate(events) if isinstance(e, NodeToken) and e.node.startswith("p"))
    assert first < last_branch  # the answer starts before the branches have finished
    rounds = [e for e in events if isinstance(e, NodeRound)]
    assert len(rounds) >= 2
    for r in rounds:  # each takes a branch up to a chunk boundary, or whole once it has ended
        for p, (start, end) in r.chunks.items():
            assert graph.schedule.boundary(end) == end or end == eng.message(dag.outputs[p]).num_tokens
    done = {e.node: e for e in events if isinstance(e, NodeDone)}
    assert len(tokens_of(events, "agg")) == GREEDY.max_tokens
    assert done["agg"].reencoded == ([f"p{i}:text" for i in range(3)] if output == "text" else [])
    assert eng.message(dag.outputs["agg"]).token_ids[-GREEDY.max_tokens:] == tuple(tokens_of(events, "agg"))
    dag.free()


def test_a_kv_branch_tainted_by_another_roles_secret_is_streamed_as_text(llama_engine):
    """Alice's proposer read her private secret through its cached context; the aggregator (role agg) must not
    see it through that encoding, so it streams the branches as text: the same tokens as a graph whose
    proposers are text outputs. With `leak` on the edge it reads the KV chunks."""
    eng = llama_engine

    def graph(output="kv", leak=False):
        return Graph([Node("topic", "Topic: plans."),
                      Node("secret", "Alice's secret: the vault code is 1234", role="alice", private=True),
                      Node("pa", "Alice:", role="alice", parents=(Edge("topic"), Edge("secret")), sampling=GREEDY,
                           output=output),
                      Node("pb", "Bob:", role="bob", parents=(Edge("topic"),), sampling=GREEDY, output=output),
                      Node("agg", "Aggregated:", role="agg", sampling=GREEDY, staircase=True,
                           parents=(Edge("pa", leak=leak), Edge("pb")))], schedule=WHOLE)

    got = {}
    for key, g in (("tainted", graph()), ("text", graph("text")), ("leak", graph(leak=True))):
        dag = DagRun(eng, g)
        events = list(dag)
        got[key] = ({e.node: e.reencoded for e in events if isinstance(e, NodeDone)}["agg"], tokens_of(events, "agg"),
                    dag.shareable("agg"))
        dag.free()
    assert got["tainted"][0] == ["pa:private", "pb:text"] and got["text"][0] == ["pa:text", "pb:text"]
    assert got["tainted"][1] == got["text"][1]
    assert got["leak"][0] == [] and not got["leak"][2]  # it read the encoding that saw the secret: not shareable
    assert got["tainted"][2] and got["text"][2]


def test_a_run_left_midway_stops_every_stage_and_keeps_nothing(fresh_engine):
    eng = fresh_engine
    before = set(eng.store.ids())
    dag = DagRun(eng, moa(True, sampling=SamplingParams(max_tokens=3000, ignore_eos=True),
                          schedule=StaircaseSchedule(proposer=(4,), aggregator=(4,))))
    events = iter(dag)
    for e in events:
        if isinstance(e, NodeToken) and e.node == "agg":
            break
    events.close()
    # every stage left the batch (left running, the proposers would decode 3000 tokens: far longer)
    deadline = time.monotonic() + 1.0
    while eng.scheduler.load["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.scheduler.load == {"waiting": 0, "running": 0, "reserved_bytes": 0}
    assert set(dag.outputs) == {"sys", "q"}  # the decodes stored nothing
    for mid in dag.outputs.values():
        eng.free(mid)
    dag.free()
    made = set(eng.store.ids()) - before
    assert all(m.startswith(CACHED_PREFIX) for m in made), made  # only the prefix cache's hidden twins


def debate(staircase: bool, rounds: int = 3, agents: int = 2, sampling=GREEDY, **graph) -> Graph:
    """Each round's agents read the previous round's; with staircase, every round after the first streams it."""
    nodes, previous = [Node("q", "Debate: is 7 prime?")], []
    for k in range(rounds):
        current = [f"r{k}a{i}" for i in range(agents)]
        nodes += [Node(name, f"Agent {i}:", role=f"a{i}", sampling=sampling, staircase=staircase and k > 0,
                       output="text" if previous and not staircase else "kv",
                       parents=(Edge("q"), *(Edge(p) for p in previous))) for i, name in enumerate(current)]
        previous = current
    return Graph(nodes, **graph)


def test_nested_staircases_answer_as_text_readers_that_wait(llama_engine):
    """Round 3 streams round 2's answers while round 2 streams round 1: all run alongside round 1. Taking whole
    branches, each round reads what a waiting round reads (round 2 the KV of round 1, round 3 round 2's tokens
    as text), so the greedy tokens are the same."""
    eng = llama_engine
    graph = debate(True, schedule=WHOLE)
    assert [([n.name for n in w], [n.name for n in a]) for w, a in graph.plan()] == [
        (["q"], []), (["r0a0", "r0a1"], ["r1a0", "r1a1", "r2a0", "r2a1"])]
    streamed = DagRun(eng, graph)
    s_events = list(streamed)
    waited = DagRun(eng, debate(False))
    w_events = list(waited)
    for k in range(3):
        for i in range(2):
            assert tokens_of(s_events, f"r{k}a{i}") == tokens_of(w_events, f"r{k}a{i}"), (k, i)
    done = {e.node: e for e in s_events if isinstance(e, NodeDone)}
    assert done["r2a0"].reencoded == ["r1a0:text", "r1a1:text"] and done["r1a0"].reencoded == []
    streamed.free()
    waited.free()


def test_nested_staircases_start_before_the_first_round_ends(llama_engine):
    eng = llama_engine
    dag = DagRun(eng, debate(True, sampling=LONG, schedule=StaircaseSchedule(proposer=(4, 8), aggregator=(4, 8))))
    events = list(dag)
    index = {e.node: i for i, e in reversed(list(enumerate(events))) if isinstance(e, NodeToken)}  # first tokens
    last_r0 = max(i for i, e in enumerate(events) if isinstance(e, NodeToken) and e.node.startswith("r0"))
    assert index["r2a0"] < last_r0 and index["r2a1"] < last_r0  # the third round answers during the first
    assert all(len(tokens_of(events, f"r{k}a{i}")) == LONG.max_tokens for k in range(3) for i in range(2))
    dag.free()


def test_the_cluster_config_sets_the_default_schedule_and_a_request_overrides_it(checkpoint):
    from braid.cluster.config import ClusterConfig
    from braid.protos import agent_pb2 as pb
    from braid.runtime import convert

    config = ClusterConfig(checkpoint("llama"), kv_schedule=(4, 16), staircase_aggregator=(2,), staircase_redundancy=1)
    default = config.service_config().staircase
    assert (default.proposer, default.aggregator, default.redundancy) == ((4, 16), (2,), 1)
    nodes = [pb.GraphNode(name=n, prompt=n, decode=True) for n in ("a", "b")]
    nodes.append(pb.GraphNode(name="s", prompt="S", decode=True, staircase=True,
                              parents=[pb.GraphParent(node="a"), pb.GraphParent(node="b")]))
    got = convert.graph(pb.GraphRequest(nodes=nodes), 8, default).schedule
    assert got == default
    mine = convert.graph(pb.GraphRequest(nodes=nodes, staircase=pb.StaircaseOptions(aggregator_chunks=[3])), 8,
                         default).schedule
    assert (mine.proposer, mine.aggregator, mine.redundancy) == ((4, 16), (3,), 1)  # (what it does not set)
    zero = convert.graph(pb.GraphRequest(nodes=nodes, staircase=pb.StaircaseOptions(redundancy=0)), 8,
                         default).schedule
    assert zero.redundancy == 0 and zero.strict
    # the server's redundancy never refuses a request that did not ask for it: one streamed parent waits for it
    one = [nodes[0], pb.GraphNode(name="s", prompt="S", decode=True, staircase=True,
                                  parents=[pb.GraphParent(node="a")])]
    assert convert.graph(pb.GraphRequest(nodes=one), 8, default).stair.quorum(1) == 1
    with pytest.raises(BraidError, match="redundancy 1 leaves no branch"):
        convert.graph(pb.GraphRequest(nodes=one, staircase=pb.StaircaseOptions(redundancy=1)), 8, default)
    with pytest.raises(ValueError, match="aggregator chunk sizes must be positive"):
        ClusterConfig(checkpoint("llama"), staircase_aggregator=(0,))
    # a client's graph leaves the schedule to the server unless it sets one
    from braid.methods.dag.presets import moa as moa_preset
    sent = convert.graph_request(moa_preset("q", staircase=Variant.APPEND)).staircase
    assert sent.variant == "append" and not sent.proposer_chunks and not sent.HasField("redundancy")
    calibrated = Graph(moa_preset("q").nodes, calibrated=True)
    assert convert.graph(convert.graph_request(calibrated), 8).calibrated


class Separate:
    """The workflow driver over a synthesizer engine and `workers` worker engines, each call of branch group g on
    worker g (KV over gRPC on loopback, real Redis)."""

    def __init__(self, checkpoint, workers: int = 1):
        from braid.engine import Engine, EngineConfig
        from braid.kv.receiver import KVReceiver
        from braid.runtime.directory import Directory, EmbeddedRedis
        from braid.runtime.sessions import Sessions
        from braid.synthesizer.runner import SynthesisRunner, SynthesizerConfig
        from braid.workers.runner import BranchRunner, WorkerConfig

        self.redis = EmbeddedRedis()
        self.directory = Directory.connect(self.redis.url)
        self.synth_engine = Engine(EngineConfig(checkpoint("llama")))
        self.worker_engines = [Engine(EngineConfig(checkpoint("llama"))) for _ in range(workers)]
        self.receiver = KVReceiver(self.synth_engine.fingerprint)
        self.synth = SynthesisRunner(self.synth_engine, self.receiver, Sessions(self.synth_engine, self.directory),
                                     SynthesizerConfig())
        self.workers = [BranchRunner(e, WorkerConfig(kv_schedule=(2, 3)), f"w{g}")
                        for g, e in enumerate(self.worker_engines)]

    def run_branches(self, req):
        return self.workers[req.indices[0] % len(self.workers)].run(req)

    def run(self, request, transport="grpc"):
        from braid.api.workflow import ThreadRoles, WorkflowConfig, WorkflowDriver
        from braid.runtime.aio import iterate_blocking

        driver = WorkflowDriver(ThreadRoles(self.run_branches, self.synth.run, self.synth.info), self.directory,
                                WorkflowConfig(kv_transport=transport, branch_groups=len(self.workers)),
                                self.synth_engine.tokenize)
        return iterate_blocking(driver.run(request))

    def idle(self, within_s: float = 5.0) -> bool:
        """Whether every engine's scheduler runs nothing and the receiver holds no stream (waits up to
        `within_s`: threads let go as they unwind)."""
        engines = [self.synth_engine, *self.worker_engines]
        deadline = time.monotonic() + within_s
        while any(e.scheduler.load["running"] for e in engines) or self.receiver._streams:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def stop(self):
        self.receiver.stop()
        self.redis.stop()


def workflow_request(prompts=("a", "b b"), staircase=None, max_tokens=12, answer_tokens=4, transport=None):
    from braid.protos import agent_pb2 as pb

    return pb.WorkflowRequest(task="t", branch_prompts=list(prompts), synthesis_prompt="s",
                              worker_sampling=pb.Sampling(max_tokens=max_tokens, ignore_eos=True),
                              synthesis_sampling=pb.Sampling(max_tokens=answer_tokens, ignore_eos=True),
                              transport=pb.TRANSPORT_GRPC if transport is None else transport, staircase=staircase)


def test_a_staircase_workflow_on_separate_engines_and_when_auto_chooses_text(checkpoint):
    """The workflow driver with a worker engine and a synthesizer engine (KV over gRPC on loopback, real Redis):
    a staircase answers, with round events, and its branches and receipts are those of a waiting workflow. When
    `auto` would re-prefill text (an uncalibrated synthesizer), a staircase is refused with what to do, before
    any worker starts."""
    from braid.engine.errors import PreconditionError
    from braid.protos import agent_pb2 as pb

    setup = Separate(checkpoint)
    synth_engine, receiver = setup.synth_engine, setup.receiver
    try:
        events = list(setup.run(workflow_request(staircase=pb.StaircaseOptions(aggregator_chunks=[2]))))
        kinds = [e.WhichOneof("event") for e in events]
        assert kinds.count("synthesis_token") == 4 and kinds.count("branch_token") == 24 and kinds[-1] == "done"
        assert kinds.count("round") >= 1 and sorted(e.kv_receipt.branch for e in events
                                                    if e.HasField("kv_receipt")) == [0, 1]
        assert all(e.kv_receipt.crc32 == e.kv_receipt.crc32_sent for e in events if e.HasField("kv_receipt"))
        assert len(events[-1].done.branch_message_ids) == 2 and not events[-1].done.failed_branches
        # whole chunks: the waiting workflow's answer, token for token
        answers = []
        for options in (pb.StaircaseOptions(proposer_chunks=[1000], aggregator_chunks=[1000]), None):
            got = list(setup.run(workflow_request(staircase=options)))
            answers.append([e.synthesis_token.token_id for e in got if e.HasField("synthesis_token")])
        assert answers[0] == answers[1]
        assert receiver._streams == {}  # every stream ended and was let go
        # a client that leaves mid-answer: every stage stops, and the synthesizer keeps nothing of it
        before = set(synth_engine.store.ids())
        events = setup.run(workflow_request(staircase=pb.StaircaseOptions(aggregator_chunks=[2]), max_tokens=2000))
        for event in events:
            if event.HasField("synthesis_token"):
                break
        events.close()
        assert setup.idle()
        kept = {m for m in set(synth_engine.store.ids()) - before if not m.startswith(CACHED_PREFIX)}
        assert kept == set()
        with pytest.raises(PreconditionError, match="ask for TRANSPORT_GRPC"):
            list(setup.run(workflow_request(staircase=pb.StaircaseOptions(), transport=pb.TRANSPORT_UNSPECIFIED),
                           transport="auto"))
    finally:
        setup.stop()


def test_a_worker_lost_mid_stream_leaves_the_staircase_answer_to_the_others(checkpoint):
    """Two worker engines; the one decoding branch 1 fails mid-stream (its call is interrupted, as an engine
    stopping under it would). The staircase finishes its answer with branches 0 and 2, says which branch it lost
    and why, stores and registers the other two, and keeps nothing of the lost one; the service goes on. Without
    a staircase the same fault fails the workflow with UNAVAILABLE."""
    import threading

    from braid.engine.errors import UnavailableError
    from braid.kv.connector import TransferError
    from braid.protos import agent_pb2 as pb

    setup = Separate(checkpoint, workers=2)
    lost_engine = setup.worker_engines[1]

    def round_runs(synth=setup.synth_engine) -> bool:
        """The aggregator's first round runs: it has taken every branch's first chunk."""
        return any(g.decodes for g in list(synth.scheduler.running))

    def fail_soon(engine=lost_engine, ready=None):
        while not engine.scheduler.running or not engine.scheduler.running[0].decoding:
            time.sleep(0.005)
        victim = engine.scheduler.running[0]
        time.sleep(0.05)  # (a few tokens in)
        while ready is not None and not ready():  # (a fixed delay alone lost that race on a slow machine)
            time.sleep(0.002)
        victim.request_cancel()  # (mid-stream: it has 300 tokens to decode)

    # The lost worker, once it has shipped its first chunks, waits for the aggregator's first round, as a slow
    # worker would: on a loaded machine its 300 tokens could otherwise all be decoded before the round ran.
    real_step, gate_until = lost_engine.scheduler.step, time.monotonic() + 60

    def gated_step():
        running = lost_engine.scheduler.running
        if running and running[0].decoding and len(running[0].calls[0].generated) >= 20 and not round_runs() \
                and time.monotonic() < gate_until:
            time.sleep(0.002)
            return
        real_step()

    lost_engine.scheduler.step = gated_step
    try:
        before = set(setup.synth_engine.store.ids())
        threading.Thread(target=fail_soon, kwargs={"ready": round_runs}, daemon=True).start()  # (after branch 1's
        # first chunk was taken, so that the answer read some of it)
        events = list(setup.run(workflow_request(("a", "b b", "c c c"), pb.StaircaseOptions(aggregator_chunks=[2]),
                                                 max_tokens=300, answer_tokens=8)))
        lost_engine.scheduler.step = real_step
        kinds = [e.WhichOneof("event") for e in events]
        lost = [e.branch_failed for e in events if e.HasField("branch_failed")]
        assert [f.branch for f in lost] == [1] and "worker failed mid-stream" in lost[0].reason, lost
        assert kinds.count("synthesis_token") == 8 and kinds[-1] == "done"
        done = events[-1].done
        assert [(f.branch, f.reason) for f in done.failed_branches] == [(1, lost[0].reason)]
        assert done.branch_message_ids[1] == "" and all(done.branch_message_ids[j] for j in (0, 2))
        assert sorted(e.kv_receipt.branch for e in events if e.HasField("kv_receipt")) == [0, 2]
        eng = setup.synth_engine
        whole = {j: eng.message(done.branch_message_ids[j]).num_tokens for j in (0, 2)}
        rounds = [e.round for e in events if e.HasField("round")]
        taken = {j: max((c.end for r in rounds for c in r.chunks if c.branch == j), default=0) for j in range(3)}
        assert 0 < taken[1] < 300 and all(taken[j] == whole[j] for j in (0, 2)), (taken, whole)
        assert setup.idle()
        kept = {m for m in set(eng.store.ids()) - before if not m.startswith(CACHED_PREFIX)}
        answer_and_branches = {done.answer_message_id, done.branch_message_ids[0], done.branch_message_ids[2]}
        task, = kept - answer_and_branches  # (and the task's message: the session holds it)
        assert eng.message(task).token_ids == tuple(eng.tokenize("t"))
        # a workflow whose only branch is lost: UNAVAILABLE, whether before its first round or after it
        threading.Thread(target=fail_soon, args=(setup.worker_engines[0],), daemon=True).start()
        with pytest.raises(UnavailableError, match="every branch failed"):
            list(setup.run(workflow_request(("a",), pb.StaircaseOptions(aggregator_chunks=[2]), max_tokens=300,
                                            answer_tokens=8)))
        assert setup.idle()
        # without a staircase the lost branch fails the workflow, and the service goes on
        threading.Thread(target=fail_soon, daemon=True).start()
        with pytest.raises(TransferError, match="worker failed mid-request"):
            list(setup.run(workflow_request(("a", "b b", "c c c"), max_tokens=300)))
        assert setup.idle()
        events = list(setup.run(workflow_request(staircase=pb.StaircaseOptions())))
        assert events[-1].HasField("done") and not events[-1].done.failed_branches
    finally:
        setup.stop()
