"""Prompt graphs: prompts that share prefixes, packed so each shared token is encoded once (Prompt Trees).

A graph is a list of nodes. A node is a run of tokens that sees its ordered parents,
each at the offset it is placed at: the choreography API's model (a tree is the case
of one parent each). A node's tokens are encoded once, at one place, so a child sees
each parent where that parent is encoded; the offsets are checked against it. A
workflow that needs the same message at two places (a worker reply after its context,
and again at the synthesizer's branch point) holds two nodes with the same tokens.

Linearised depth-first into rows of a fixed width, the nodes keep the position ids of
their placement, and one visibility rule decides attention: a token sees the earlier
tokens of its own node and every token of every ancestor node. A leaf (a node that no
node sees) stands for one flat sequence: its ancestors and itself, each at its place.

The objective is the flat one: over every leaf's flat sequence, the next-token
cross-entropy of its supervised tokens, summed, divided by the number of such targets
over all sequences (each sequence counted once). A token of a node that k leaves'
sequences include counts k times. A token is predicted where its own view puts the
token before it: the previous token of its node, or, for a node's first token, the
last token of its last parent. A root's first token is never a target.

Attention is decided in one place (`attention_backend`): SDPA with a dense boolean
mask [R, 1, W, W] everywhere (FlexAttention has no backward on CPU), FlexAttention
with a path-bit `mask_mod` on CUDA, where the block-sparse kernel skips the blocks
no token of a block may see.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from braid.engine import attention

BACKENDS = ("auto", "sdpa", "flex")


class GraphError(ValueError):
    """A node or graph that cannot be encoded as given; the message names the value."""


@dataclass(frozen=True)
class Node:
    tokens: tuple[int, ...]
    supervised: tuple[bool, ...]  # per token: is it a target
    parents: tuple[int, ...]  # node indices, in the order the node sees them
    start: int  # position id of the node's first token

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class PromptGraph:
    nodes: list[Node] = field(default_factory=list)

    def add(self, tokens: Sequence[int], supervised: bool | Sequence[bool] = False, parents: Sequence[int] = (),
            offsets: Sequence[int] | None = None, start: int | None = None) -> int:
        """Add a node; returns its index. `offsets[i]` is where the node sees `parents[i]` (by default, where
        that parent is encoded); `start` is the node's own first position (by default right after the
        furthest parent, or 0 for a root)."""
        tokens, parents = tuple(int(t) for t in tokens), tuple(int(p) for p in parents)
        if not tokens:
            raise GraphError("a node needs at least one token")
        sup = (bool(supervised),) * len(tokens) if isinstance(supervised, bool) else tuple(map(bool, supervised))
        if len(sup) != len(tokens):
            raise GraphError(f"supervised has {len(sup)} flags for {len(tokens)} tokens")
        bad = [p for p in parents if not 0 <= p < len(self.nodes)]
        if bad or len(set(parents)) != len(parents):
            raise GraphError(f"parents {list(parents)} must be distinct nodes already added (0..{len(self.nodes) - 1})")
        if offsets is not None:
            if len(offsets) != len(parents):
                raise GraphError(f"{len(offsets)} offsets for {len(parents)} parents")
            for p, o in zip(parents, offsets):
                if o != self.nodes[p].start:
                    raise GraphError(f"parent {p} is seen at offset {o} but encoded at {self.nodes[p].start}: a node "
                                     f"is encoded once, at one place; add a copy of it placed at {o}")
        end = max((self.nodes[p].start + len(self.nodes[p]) for p in parents), default=0)
        start = end if start is None else int(start)
        if start < 0:
            raise GraphError(f"start must be >= 0, got {start}")
        self.nodes.append(Node(tokens, sup, parents, start))
        return len(self.nodes) - 1

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def tokens(self) -> int:
        return sum(len(n) for n in self.nodes)

    def closures(self) -> list[int]:
        """Each node's ancestors and itself, as a bit set over node indices."""
        out: list[int] = []
        for i, n in enumerate(self.nodes):
            bits = 1 << i
            for p in n.parents:
                bits |= out[p]
            out.append(bits)
        return out

    def leaves(self) -> list[int]:
        seen = {p for n in self.nodes for p in n.parents}
        return [i for i in range(len(self.nodes)) if i not in seen]

    def path_counts(self) -> list[int]:
        """How many leaves' flat sequences include each node: the weight of its tokens."""
        closures, leaves = self.closures(), self.leaves()
        return [sum(closures[leaf] >> i & 1 for leaf in leaves) for i in range(len(self.nodes))]

    @property
    def flat_tokens(self) -> int:
        """Tokens the flat sequences hold together (the graph encodes `tokens` of them)."""
        return sum(len(n) * k for n, k in zip(self.nodes, self.path_counts()))

    def order(self) -> list[int]:
        """Depth-first linearisation: a node comes right after the last of its parents to be placed."""
        children: list[list[int]] = [[] for _ in self.nodes]
        for i, n in enumerate(self.nodes):
            for p in n.parents:
                children[p].append(i)
        order, placed = [], set()
        stack = [i for i, n in reversed(list(enumerate(self.nodes))) if not n.parents]
        while stack:
            i = stack.pop()
            if i in placed:
                continue
            order.append(i)
            placed.add(i)
            stack += [c for c in reversed(children[i]) if all(p in placed for p in self.nodes[c].parents)]
        return order

    def subgraph(self, keep: int) -> "PromptGraph":
        """The nodes in bit set `keep` (closed under parents), renumbered in order."""
        index, out = {}, PromptGraph()
        for i, n in enumerate(self.nodes):
            if keep >> i & 1:
                index[i] = len(out.nodes)
                out.nodes.append(Node(n.tokens, n.supervised, tuple(index[p] for p in n.parents), n.start))
        return out

    def flat(self) -> list["PromptGraph"]:
        """One graph per leaf: its flat sequence, sharing nothing with the others."""
        closures = self.closures()
        return [self.subgraph(closures[leaf]).compact() for leaf in self.leaves()]

    def compact(self) -> "PromptGraph":
        """Linear chains merged into single nodes (fewer nodes: fewer path bits), same tokens and rule."""
        children: list[list[int]] = [[] for _ in self.nodes]
        for i, n in enumerate(self.nodes):
            for p in n.parents:
                children[p].append(i)

        def merges(i: int) -> bool:  # node i is its only parent's only child and starts right after it
            n = self.nodes[i]
            if len(n.parents) != 1:
                return False
            p = self.nodes[n.parents[0]]
            return len(children[n.parents[0]]) == 1 and n.start == p.start + len(p)

        index, out = {}, PromptGraph()
        for i in self.order():
            n = self.nodes[i]
            if merges(i):
                j = index[n.parents[0]]
                head = out.nodes[j]
                out.nodes[j] = Node(head.tokens + n.tokens, head.supervised + n.supervised, head.parents, head.start)
                index[i] = j
            else:
                index[i] = len(out.nodes)
                out.nodes.append(Node(n.tokens, n.supervised, tuple(index[p] for p in n.parents), n.start))
        return out


@dataclass
class PackedGraphs:
    """Graphs linearised into R rows of width W, and the targets of the flat objective."""

    ids: torch.Tensor  # [R, W] token ids (padding: pad_id)
    positions: torch.Tensor  # [R, W] position ids from the placement
    node: torch.Tensor  # [R, W] row-local node index; padding is node N_r, which only sees itself
    visible: torch.Tensor  # [R, N, N] bool: node a sees node b (b is an ancestor of a, or a itself)
    path_bits: torch.Tensor  # [R, W, C] int64: each token's node's ancestors and itself, 64 nodes a chunk
    pred: torch.Tensor  # [T] flat index (r * W + j) of the token whose logits predict target t
    labels: torch.Tensor  # [T] the target token ids
    weight: torch.Tensor  # [T] float: how many flat sequences hold target t
    graph_of_target: torch.Tensor  # [T] which packed graph each target belongs to (for per-graph scores)
    tokens: int  # tokens encoded (padding excluded)
    flat_tokens: int  # tokens the same graphs' flat sequences hold

    @property
    def cached_token_ratio(self) -> float:
        return self.flat_tokens / max(1, self.tokens)

    def pin_memory(self) -> "PackedGraphs":
        """Page-locked copies (the DataLoader calls this with pin_memory=True), so `to(cuda)` overlaps."""
        return PackedGraphs(**{k: (v.pin_memory() if isinstance(v, torch.Tensor) else v)
                               for k, v in self.__dict__.items()})

    def to(self, device) -> "PackedGraphs":
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in self.__dict__.items()}
        return PackedGraphs(**moved)


def pack(graphs: Sequence[PromptGraph], width: int, pad_id: int) -> PackedGraphs:
    """First-fit the graphs, each linearised depth-first, into as many rows of `width` tokens as they need."""
    rows: list[list[tuple[int, PromptGraph]]] = []
    used: list[int] = []
    for g, graph in enumerate(graphs):
        if graph.tokens > width:
            raise GraphError(f"graph {g} has {graph.tokens} tokens; rows are {width} wide")
        r = next((r for r in range(len(rows)) if used[r] + graph.tokens <= width), None)
        if r is None:
            rows.append([])
            used.append(0)
            r = len(rows) - 1
        rows[r].append((g, graph))
        used[r] += graph.tokens
    n_rows = max(1, len(rows))
    most = max((sum(len(gr) for _, gr in row) for row in rows), default=0) + 1  # + the padding node
    chunks = (most + 63) // 64
    ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
    positions = torch.zeros(n_rows, width, dtype=torch.long)
    node = torch.zeros(n_rows, width, dtype=torch.long)
    visible = torch.zeros(n_rows, most, most, dtype=torch.bool)
    bits = torch.zeros(n_rows, width, chunks, dtype=torch.long)
    pred, labels, weight, graph_of = [], [], [], []
    for r, row in enumerate(rows):
        at, base = 0, 0  # next free column; row-local index of the graph's first node
        row_bits: list[int] = []
        for g, graph in row:
            closures, counts, order = graph.closures(), graph.path_counts(), graph.order()
            last = {}  # each node's last column
            for i in order:
                n = graph.nodes[i]
                last[i] = at + len(n) - 1
                ids[r, at:at + len(n)] = torch.tensor(n.tokens)
                positions[r, at:at + len(n)] = torch.arange(n.start, n.start + len(n))
                node[r, at:at + len(n)] = base + i
                for j, sup in enumerate(n.supervised):
                    if not sup or (j == 0 and not n.parents):
                        continue
                    pred.append(r * width + (at + j - 1 if j else last[n.parents[-1]]))
                    labels.append(n.tokens[j])
                    weight.append(float(counts[i]))
                    graph_of.append(g)
                at += len(n)
            for i in range(len(graph)):
                row_bits.append(closures[i] << base)
                visible[r, base + i, base:base + len(graph)] = torch.tensor([bool(closures[i] >> a & 1)
                                                                             for a in range(len(graph))])
            base += len(graph)
        pad_node = most - 1
        node[r, at:] = pad_node
        visible[r, pad_node, pad_node] = True
        row_bits += [0] * (most - 1 - len(row_bits)) + [1 << pad_node]
        chunked = torch.tensor([[_int64((b >> (64 * c)) & ((1 << 64) - 1)) for c in range(chunks)] for b in row_bits])
        bits[r] = chunked[node[r]]
    return PackedGraphs(ids, positions, node, visible, bits, torch.tensor(pred, dtype=torch.long),
                        torch.tensor(labels, dtype=torch.long), torch.tensor(weight),
                        torch.tensor(graph_of, dtype=torch.long), sum(g.tokens for g in graphs),
                        sum(g.flat_tokens for g in graphs))


def _int64(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def dense_mask(batch: PackedGraphs) -> torch.Tensor:
    """[R, W, W] bool, True = attend: the visibility rule, causal within a node."""
    rows = torch.arange(batch.node.shape[0], device=batch.node.device)[:, None, None]
    q, k = batch.node[:, :, None], batch.node[:, None, :]
    width = batch.node.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=batch.node.device).tril()
    return batch.visible[rows, q, k] & ((q != k) | causal)


def mask_mod(path_bits: torch.Tensor):
    """FlexAttention's rule over [R, W, C] path bits: the key's node is an ancestor of the query's (or it),
    and the key is not after the query in the row (ancestors come first: the linearisation is depth-first)."""
    chunks = path_bits.shape[-1]

    def rule(b, h, q, kv):
        ok = (path_bits[b, kv, 0] & ~path_bits[b, q, 0]) == 0
        for c in range(1, chunks):
            ok = ok & ((path_bits[b, kv, c] & ~path_bits[b, q, c]) == 0)
        return ok & (kv <= q)

    return rule


def block_mask(batch: PackedGraphs):
    from torch.nn.attention.flex_attention import create_block_mask

    rows, width = batch.node.shape
    return create_block_mask(mask_mod(batch.path_bits), B=rows, H=None, Q_LEN=width, KV_LEN=width,
                             device=batch.node.device)


def attention_backend(device: torch.device | str, requested: str = "auto") -> str:
    """The one place that decides how packed graphs attend: FlexAttention on CUDA, SDPA elsewhere.

    `flex` on CPU runs forward only (no backward there in torch); it is allowed so it can be checked."""
    if requested not in BACKENDS:
        raise GraphError(f"attention backend {requested!r} is not one of {', '.join(BACKENDS)}")
    if requested == "auto":
        return "flex" if torch.device(device).type == "cuda" else "sdpa"
    return requested


def hidden_states(model, batch: PackedGraphs, backend: str = "sdpa") -> torch.Tensor:
    """The decoder's last hidden states [R, W, hidden] for the packed rows (`batch` on the model's device).

    Sets the model's attention implementation to the backend's and leaves it set: the backward must see
    the same one (gradient checkpointing runs the forward again there)."""
    if backend == "flex":
        mask, model.config._attn_implementation = block_mask(batch), "flex_attention"
    else:
        mask, model.config._attn_implementation = dense_mask(batch)[:, None], attention.NAME
    return model.get_decoder()(input_ids=batch.ids, position_ids=batch.positions, attention_mask=mask,
                               use_cache=False).last_hidden_state


def enable_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward instead of keeping them (less memory)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@dataclass
class GraphLoss:
    loss: torch.Tensor  # scalar: the flat objective
    correct: torch.Tensor  # [T] bool: the target is the argmax
    weighted_targets: float  # sum of the targets' weights (the flat objective's denominator)


def graph_loss(model, batch: PackedGraphs, backend: str = "sdpa") -> GraphLoss:
    """The flat objective over the packed graphs, in one forward pass."""
    hidden = hidden_states(model, batch, backend)  # [R, W, d]
    logits = model.lm_head(hidden.flatten(0, 1)[batch.pred]).float()  # [T, vocab]
    ce = F.cross_entropy(logits, batch.labels, reduction="none")  # [T]
    total = batch.weight.sum()
    return GraphLoss((ce * batch.weight).sum() / total.clamp_min(1), logits.argmax(-1) == batch.labels,
                     float(total))


def prefix_graph(sequences: Sequence[Sequence[tuple[Sequence[int], bool]]]) -> PromptGraph:
    """A prefix tree over sequences of pieces (token ids, supervised): pieces that continue the same
    prefix with the same tokens and flags are one node; linear chains are then merged (Prompt Trees' trie)."""
    graph, children = PromptGraph(), {}  # (parent or -1, piece) -> node
    for sequence in sequences:
        at = -1
        for tokens, sup in sequence:
            if not tokens:
                continue
            key = (at, tuple(tokens), bool(sup))
            if key not in children:
                children[key] = graph.add(tokens, bool(sup), () if at < 0 else (at,))
            at = children[key]
    if len(graph.leaves()) != len(sequences):
        raise GraphError(f"{len(sequences)} sequences make {len(graph.leaves())} leaves: a sequence that is another's "
                         "prefix (or a duplicate) would count once; pack it as a graph of its own")
    return graph.compact()
