"""DAG workflows on one engine: validation, exactness against the same calls made by hand, parallel nodes
batched against alone, text outputs, and leakage control."""

import pytest
import torch

from braid.engine import DecodeCall, PrefillCall, SamplingParams
from braid.engine.errors import BraidError
from braid.methods.dag import DagRun, Edge, Graph, Node, NodeDone, NodeToken

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


def run(engine, graph):
    dag = DagRun(engine, graph)
    events = list(dag)
    return dag, events


def tokens_of(events, node):
    return [e.token_id for e in events if isinstance(e, NodeToken) and e.node == node]


@pytest.mark.parametrize("nodes, needle", [
    ([Node("a", "x", parents=(Edge("b"),)), Node("b", "y", parents=(Edge("a"),))], "cycle through a, b"),
    ([Node("a", "x", parents=(Edge("zz"),))], "'zz' is not a node of this graph"),
    ([Node("a", "x", parents=(Edge("a"),))], "names itself"),
    ([Node("a", "x"), Node("a", "y")], "'a' is repeated"),
    ([Node("a", "")], "prompt is empty"),
    ([Node("a", "x", output="json")], "output 'json'"),
    ([Node("a", "x", private=True)], "no role"),
    ([Node("s", "secret", role="alice", private=True), Node("b", "x", role="bob", parents=(Edge("s"),))],
     "private to role 'alice'"),
    ([Node("a", "x", parents=(Edge(),))], "exactly one of a node or a message id"),
    ([], "1 to 64 nodes"),
])
def test_bad_graphs_are_refused_before_anything_runs(nodes, needle):
    with pytest.raises(BraidError, match=needle) as err:
        Graph(nodes)
    assert err.value.code == "INVALID_ARGUMENT"


def test_a_chain_matches_the_same_calls_made_by_hand(llama_engine):
    eng = llama_engine
    graph = Graph([Node("sys", "You are terse.", role="a"),
                   Node("q", "User: 2 and 3?", parents=(Edge("sys"),)),
                   Node("ans", "Assistant:", role="a", parents=(Edge("sys"), Edge("q")), sampling=GREEDY),
                   Node("more", "User: and 4?", parents=(Edge("q"), Edge("ans"), Edge("sys", offset=40)),
                        sampling=GREEDY)])
    dag, events = run(eng, graph)
    assert [e.node for e in events if isinstance(e, NodeDone)] == ["sys", "q", "ans", "more"]
    sys_, = eng.prefill([PrefillCall("You are terse.")])
    q, = eng.prefill([PrefillCall("User: 2 and 3?", parents=[sys_])])
    ans, = eng.decode([DecodeCall("Assistant:", parents=[sys_, q], sampling=GREEDY)])
    more, = eng.decode([DecodeCall("User: and 4?", parents=[q, ans, sys_], offsets=[None, None, 40],
                                   sampling=GREEDY)])
    for name, mine in (("ans", ans), ("more", more)):
        got = eng.message(dag.outputs[name])
        assert got.token_ids == eng.message(mine).token_ids and got.offset == eng.message(mine).offset
        assert tokens_of(events, name) == list(eng.message(mine).token_ids[-5:])
    dag.free()


def test_parallel_nodes_share_a_wave_and_answer_as_alone(llama_engine):
    eng = llama_engine
    asks = [f"User: item {i} {'is long ' * i}?" for i in range(4)]
    graph = Graph([Node("task", "Task: list things."),
                   *[Node(f"w{i}", a, role=f"w{i}", parents=(Edge("task"),), sampling=GREEDY)
                     for i, a in enumerate(asks)],
                   Node("join", "Summary:", parents=tuple(Edge(f"w{i}") for i in range(4)), sampling=GREEDY)])
    assert [len(w) for w in graph.waves()] == [1, 4, 1]
    dag, events = run(eng, graph)
    task, = eng.prefill([PrefillCall("Task: list things.")])
    for i, a in enumerate(asks):
        alone, = eng.decode([DecodeCall(a, parents=[task], sampling=GREEDY)])
        assert tokens_of(events, f"w{i}") == list(eng.message(alone).token_ids[-5:])
    assert len(tokens_of(events, "join")) == 5


def test_a_text_output_is_read_re_encoded_in_the_readers_context(llama_engine):
    eng = llama_engine
    graph = Graph([Node("a", "User: red green", output="text"),
                   Node("b", "User: blue"),
                   Node("c", "Assistant:", parents=(Edge("b"), Edge("a")), sampling=GREEDY)])
    dag, events = run(eng, graph)
    done = {e.node: e for e in events if isinstance(e, NodeDone)}
    assert done["c"].reencoded == ["a:text"]
    # the same as prefilling b, then a's text after b, then decoding
    b, = eng.prefill([PrefillCall("User: blue")])
    a_after_b, = eng.prefill([PrefillCall(list(eng.message(dag.outputs["a"]).token_ids), parents=[b])])
    c, = eng.decode([DecodeCall("Assistant:", parents=[b, a_after_b], sampling=GREEDY)])
    assert tokens_of(events, "c") == list(eng.message(c).token_ids[-5:])
    dag.free()
    assert all(m not in eng.store for m in dag.temporary)


def test_leakage_control_reencodes_without_another_roles_private_nodes(llama_engine):
    """Alice's utterance was encoded with her private system prompt in view; Bob reads it re-encoded
    without it (the default), or cached when the edge says leak=True (the paper's choreographed default)."""
    eng = llama_engine

    def graph(leak: bool):
        return Graph([
            Node("alice_sys", "System: always defect.", role="alice", private=True),
            Node("bob_sys", "System: be kind.", role="bob", private=True),
            Node("topic", "Moderator: choose."),
            Node("alice_says", "Alice:", role="alice", parents=(Edge("alice_sys"), Edge("topic")),
                 sampling=GREEDY),
            Node("bob_says", "Bob:", role="bob",
                 parents=(Edge("bob_sys"), Edge("topic"), Edge("alice_says", leak=leak)), sampling=GREEDY)])

    dag, events = run(eng, graph(leak=False))
    done = {e.node: e for e in events if isinstance(e, NodeDone)}
    assert done["bob_says"].reencoded == ["alice_says:private"]
    read = dag._context["bob_says"][2].message
    said = eng.message(dag.outputs["alice_says"])
    assert read != said.id and eng.message(read).token_ids == said.token_ids
    # the copy is Alice's utterance encoded after the topic alone, where it was
    topic = dag._context["alice_says"][1]
    manual, = eng.prefill([PrefillCall(list(said.token_ids), parents=[topic.message], offsets=[topic.offset],
                                       new_offset=said.offset)])
    assert torch.allclose(eng.message(read).kv.read(), eng.message(manual).kv.read(), atol=1e-5)
    assert not torch.allclose(eng.message(read).kv.read(), said.kv.read(), atol=1e-3)  # the private prompt mattered
    leaky, events = run(eng, graph(leak=True))
    assert leaky._context["bob_says"][2].message == leaky.outputs["alice_says"]
    assert [e.reencoded for e in events if isinstance(e, NodeDone) and e.node == "bob_says"] == [[]]
    dag.free()
    leaky.free()


def test_consecutive_text_parents_are_re_encoded_together_as_a_text_prompt(llama_engine):
    eng = llama_engine
    graph = Graph([Node("a", "User: red green", output="text"), Node("b", "User: blue", output="text"),
                   Node("c", "Assistant:", parents=(Edge("b"), Edge("a")), sampling=GREEDY)])
    dag, events = run(eng, graph)
    assert len(dag.temporary) == 1  # one prefill for both
    text = list(eng.message(dag.outputs["b"]).token_ids) + list(eng.message(dag.outputs["a"]).token_ids)
    c, = eng.decode([DecodeCall(text + eng.tokenize("Assistant:"), sampling=GREEDY)])  # the plain text pipeline
    assert tokens_of(events, "c") == list(eng.message(c).token_ids[-5:])
    dag.free()


def test_private_text_and_kept_taint_still_stop_leaks(llama_engine):
    """Two ways round the control found in review: a private node read as text (its tokens are the secret),
    and a copy that keeps the reader's own role's private ancestors (their taint must stay with it)."""
    eng = llama_engine
    g = Graph([
        Node("alice_secret", "System: the code is 7.", role="alice", private=True, output="text"),
        Node("alice_says", "Alice: hello.", role="alice", parents=(Edge("alice_secret"),)),
        Node("bob_secret", "System: bob's plan.", role="bob", private=True),
        Node("bob_note", "Bob: noted.", role="bob", parents=(Edge("bob_secret"),)),
        Node("alice_reply", "Alice: ok.", role="alice", parents=(Edge("bob_note", leak=True), Edge("alice_says"))),
        Node("bob_reads", "Bob:", role="bob", parents=(Edge("alice_reply"),), sampling=GREEDY),
        Node("dave_reads", "Dave:", role="dave", parents=(Edge("bob_reads"),), sampling=GREEDY)])
    dag, events = run(eng, g)
    done = {e.node: e for e in events if isinstance(e, NodeDone)}
    assert dag._taint["alice_says"] == {"alice_secret"}  # (read as text, the secret is still in view)
    assert done["bob_reads"].reencoded == ["alice_reply:private"]
    # Bob's copy kept bob_note (bob's own), so bob_secret stays in its taint, and Dave is kept from it too
    assert dag._taint["bob_reads"] == {"bob_secret"} and done["dave_reads"].reencoded == ["bob_reads:private"]
    assert not dag.shareable("bob_reads") and not dag.shareable("alice_says") and dag.shareable("dave_reads")
    dag.free(keep=())
