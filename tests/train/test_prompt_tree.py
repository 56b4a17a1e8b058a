"""Prompt graphs: the packed loss and every gradient equal the flat ones; the masks agree; bad graphs refused."""

import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from braid.models import REFERENCE_MODEL
from braid.models.checkpoints import make_config
from braid.train.prompt_tree import (GraphError, PromptGraph, attention_backend, dense_mask, enable_checkpointing, graph_loss,
                               hidden_states, mask_mod, pack, prefix_graph)


def reference_model():
    return AutoModelForCausalLM.from_pretrained(REFERENCE_MODEL, dtype=torch.float32).eval()


def qwen3_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config("qwen3", "tiny"), dtype=torch.float32).eval()


def random_tree(rng: random.Random, vocab: int, max_nodes: int = 20) -> PromptGraph:
    """Fan-out 1-8 per node, 1-4 levels below the root, 1-12 tokens a node, random supervision."""
    graph, depth = PromptGraph(), rng.randint(1, 4)

    def tokens():
        n = rng.randint(1, 12)
        return [rng.randrange(vocab) for _ in range(n)], [rng.random() < 0.6 for _ in range(n)]

    frontier = [(graph.add(*tokens()), 0)]
    while frontier and len(graph) < max_nodes:
        node, level = frontier.pop(0)
        if level == depth:
            continue
        for _ in range(rng.randint(1, 8)):
            if len(graph) == max_nodes:
                break
            frontier.append((graph.add(*tokens(), parents=(node,)), level + 1))
    return graph


def flat_objective(model, sequences):
    """The flat objective by a plain causal forward per sequence: (ids, supervised) each, positions 0..L-1."""
    total, count, device = 0.0, 0, model.device
    for ids, sup in sequences:
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, :-1].float()
        target = torch.tensor(sup[1:], device=device)
        total = total + F.cross_entropy(logits[target], torch.tensor(ids[1:], device=device)[target],
                                        reduction="sum")
        count += int(target.sum())
    return total / count


def path_sequences(graph: PromptGraph):
    out = []
    for flat in graph.flat():
        ids, sup = [], []
        for i in flat.order():
            ids += flat.nodes[i].tokens
            sup += flat.nodes[i].supervised
        out.append((ids, sup))
    return out


def grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(packed, flat):
    assert packed.keys() == flat.keys()
    for name in flat:
        torch.testing.assert_close(packed[name], flat[name], atol=1e-5, rtol=1e-4, msg=name)


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))


@pytest.mark.parametrize("device", ["cpu", CUDA])  # (CUDA: FlexAttention, backward included; CPU: SDPA)
@pytest.mark.parametrize("build", [reference_model, qwen3_model], ids=["reference", "qwen3"])
def test_packed_trees_give_the_flat_loss_and_gradients(build, device):
    model, rng = build().to(device), random.Random(7)
    vocab = model.config.vocab_size
    graphs = [random_tree(rng, vocab) for _ in range(4)]
    assert any(len(g.leaves()) >= 6 for g in graphs) and any(len(g) >= 10 for g in graphs)
    batch = pack(graphs, width=256, pad_id=0)
    assert batch.cached_token_ratio > 1.5  # shared prefixes really are shared
    result = graph_loss(model, batch.to(device), attention_backend(device))
    packed = grads(model, result.loss)
    flat_loss = flat_objective(model, [s for g in graphs for s in path_sequences(g)])
    assert abs(result.loss.item() - flat_loss.item()) < 1e-5
    assert_same_gradients(packed, grads(model, flat_loss))


def test_several_parents_at_explicit_offsets_match_the_same_tokens_assembled_by_hand():
    """Parallel-Synthesis's placement: branches at the branch point n, the synthesizer after the longest.
    Two synthesizer turns and one worker turn share the system prompt and the branches."""
    model, rng = qwen3_model(), random.Random(3)
    rand = lambda n: [rng.randrange(model.config.vocab_size) for _ in range(n)]  # noqa: E731
    system, lengths = rand(6), [4, 7, 5]
    g = PromptGraph()
    root = g.add(system)
    branches = [g.add(rand(n), True, parents=(root,), offsets=(0,)) for n in lengths]
    n, end = len(system), len(system) + max(lengths)
    assert all(g.nodes[b].start == n for b in branches)
    synth_a = g.add(rand(5), True, parents=branches, offsets=[n] * 3, start=end)
    synth_b = g.add(rand(3), True, parents=branches, offsets=[n] * 3, start=end)
    worker = g.add(rand(4), True, parents=(branches[1],))
    assert g.leaves() == [synth_a, synth_b, worker] and g.path_counts()[branches[0]] == 2

    # by hand: each leaf's own row, with the positions and the mask written out
    def row(parts, sees, firsts):
        """parts: (tokens, start) per node; sees[i]: nodes node i sees; firsts[i]: the column predicting its first."""
        ids, pos, owner = [], [], []
        for i, (toks, start) in enumerate(parts):
            ids += toks
            pos += range(start, start + len(toks))
            owner += [i] * len(toks)
        width = len(ids)
        mask = torch.zeros(width, width, dtype=torch.bool)
        for q in range(width):
            for k in range(width):
                mask[q, k] = owner[k] in sees[owner[q]] and (owner[k] != owner[q] or k <= q)
        logits = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]),
                       attention_mask=mask[None, None]).logits[0].float()
        total, count, at = 0.0, 0, 0
        for i, (toks, _) in enumerate(parts):
            sup = g.nodes[node_of[i]].supervised
            for j in range(len(toks)):
                if sup[j] and (j or firsts[i] is not None):
                    src = at + j - 1 if j else firsts[i]
                    total = total + F.cross_entropy(logits[src][None], torch.tensor([toks[j]]), reduction="sum")
                    count += 1
            at += len(toks)
        return total, count

    b = [g.nodes[i].tokens for i in branches]
    total, count = 0.0, 0
    for leaf, toks, start in ((synth_a, g.nodes[synth_a].tokens, end), (synth_b, g.nodes[synth_b].tokens, end)):
        node_of = [root, *branches, leaf]
        ends = [len(system) - 1 + sum(lengths[:j + 1]) for j in range(3)]  # each branch's last column
        t, c = row([(system, 0), (b[0], n), (b[1], n), (b[2], n), (toks, start)],
                   sees={0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 3}, 4: {0, 1, 2, 3, 4}},
                   firsts=[None, n - 1, n - 1, n - 1, ends[-1]])
        total, count = total + t, count + c
    node_of = [root, branches[1], worker]
    t, c = row([(system, 0), (b[1], n), (g.nodes[worker].tokens, n + lengths[1])],
               sees={0: {0}, 1: {0, 1}, 2: {0, 1, 2}}, firsts=[None, n - 1, n + lengths[1] - 1])
    by_hand = (total + t) / (count + c)

    batch = pack([g], width=64, pad_id=0)
    assert batch.tokens == g.tokens == len(system) + sum(lengths) + 12
    result = graph_loss(model, batch)
    packed = grads(model, result.loss)
    assert abs(result.loss.item() - by_hand.item()) < 1e-5
    assert_same_gradients(packed, grads(model, by_hand))


def test_flex_mask_mod_is_the_dense_rule_and_flex_attention_gives_the_same_states():
    rng = random.Random(1)
    graphs = [random_tree(rng, 100, max_nodes=40) for _ in range(3)]
    batch = pack(graphs, width=800, pad_id=0)
    rows, width = batch.node.shape
    assert batch.path_bits.shape[-1] >= 2  # more than 64 nodes in a row: chunked path bits
    q = torch.arange(width)[:, None]
    kv = torch.arange(width)[None, :]
    rule = mask_mod(batch.path_bits)
    by_rule = torch.stack([rule(torch.tensor(r), 0, q, kv) for r in range(rows)])
    assert torch.equal(by_rule, dense_mask(batch))
    model = qwen3_model()
    with torch.no_grad():
        dense = hidden_states(model, batch, "sdpa")
        flex = hidden_states(model, batch, "flex")
    real = batch.node < batch.visible.shape[1] - 1
    torch.testing.assert_close(flex[real], dense[real], atol=1e-4, rtol=1e-4)


def test_backend_is_decided_in_one_place():
    assert attention_backend("cpu") == "sdpa" and attention_backend("cuda") == "flex"
    assert attention_backend("cuda", "sdpa") == "sdpa"
    with pytest.raises(GraphError, match="'dense' is not one of auto, sdpa, flex"):
        attention_backend("cpu", "dense")


def test_prefix_graph_shares_pieces_and_counts_paths():
    sys, a, b = ([1, 2, 3], False), ([4, 5], False), ([6], True)
    g = prefix_graph([[sys, a, b], [sys, a, ([7, 8], True)], [sys, ([9], True)]])
    assert len(g) == 5 and g.tokens == 9 and g.flat_tokens == (3 + 2 + 1) + (3 + 2 + 2) + (3 + 1)
    assert sorted(g.path_counts()) == [1, 1, 1, 2, 3] and len(g.flat()) == 3
    with pytest.raises(GraphError, match="a sequence that is another's prefix"):
        prefix_graph([[sys, a], [sys, a, b]])


def test_bad_graphs_are_refused_with_the_value():
    g = PromptGraph()
    root = g.add([1, 2, 3])
    with pytest.raises(GraphError, match="seen at offset 5 but encoded at 0"):
        g.add([4], parents=(root,), offsets=(5,))
    with pytest.raises(GraphError, match=r"parents \[3\] must be distinct nodes already added"):
        g.add([4], parents=(3,))
    with pytest.raises(GraphError, match="2 flags for 1 tokens"):
        g.add([4], supervised=[True, False])
    with pytest.raises(GraphError, match="graph 0 has 3 tokens; rows are 2 wide"):
        pack([g], width=2, pad_id=0)


def test_gradient_checkpointing_keeps_the_gradients():
    model, rng = qwen3_model(), random.Random(5)
    batch = pack([random_tree(rng, model.config.vocab_size) for _ in range(2)], width=256, pad_id=0)
    model.train()  # (checkpointing only recomputes in training mode; the tiny config has no dropout)
    plain = grads(model, graph_loss(model, batch).loss)
    enable_checkpointing(model)
    assert_same_gradients(grads(model, graph_loss(model, batch).loss), plain)
