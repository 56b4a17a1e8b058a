"""Agent workflows as DAGs of calls (Prompt Choreography, seed 000), run in dependency order on one engine.

A node is one call of one agent (its `role`): it reads its parents' messages, each at an offset, then
encodes its `prompt` and, with `sampling`, decodes a reply after it. Its output message (the prompt and the
reply) is what its children read. Nodes whose parents are done run together: their prefills in one engine
call, their decodes in another, so parallel agents share every forward.

How a node reads a parent:
- cached (choreographed, the default): the parent's own encoding, reused as is;
- re-encoded: the parent's tokens encoded again in the reader's context, after the reader's earlier parents
  (what a text pipeline does). A parent with `output="text"` is read this way by every child.

Leakage control (the seed's section 3.4). A `private` node is seen only by nodes of its own role. An encoding
that attended to another role's private node, directly or through cached parents, would let the reader see
it through the back door; by default such a parent is read through a copy re-encoded without those
ancestors (each of its context's items kept where clean, dropped where private, re-encoded otherwise). An
edge with `leak=True` reads the cached encoding anyway: the choice is explicit.
"""

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from braid.engine.engine import DecodeCall, Engine, PrefillCall
from braid.engine.errors import BraidError, UnknownMessageError
from braid.engine.sampling import SamplingParams

MAX_NODES = 64
OUTPUTS = ("kv", "text")


@dataclass(frozen=True)
class Edge:
    """A parent: a node of the graph (`node`) or a message the session holds already (`message`)."""

    node: str = ""
    message: str = ""
    offset: int | None = None  # None: directly after the previous parent
    leak: bool = False  # read the cached encoding even where it attended to another role's private nodes


@dataclass(frozen=True)
class Node:
    name: str
    prompt: str  # the node's own text: the header its reply follows, or, without sampling, the message itself
    role: str = ""  # the agent it belongs to ("": no one's; such a node cannot be private)
    parents: tuple[Edge, ...] = ()
    sampling: SamplingParams | None = None  # None: encode the prompt only (a shared text, a system prompt)
    output: str = "kv"  # how children read it: its cached encoding ("kv") or re-encoded in their context ("text")
    private: bool = False  # only its role's nodes may read it, directly or through cached encodings


@dataclass
class Graph:
    nodes: list[Node]

    def __post_init__(self):
        if not 1 <= len(self.nodes) <= MAX_NODES:
            raise BraidError(f"a graph needs 1 to {MAX_NODES} nodes, got {len(self.nodes)}")
        names = [n.name for n in self.nodes]
        seen: set[str] = set()
        for n in self.nodes:
            if not n.name or n.name in seen:
                raise BraidError(f"node names must be non-empty and distinct; {n.name!r} is "
                                 f"{'empty' if not n.name else 'repeated'}")
            seen.add(n.name)
            if not n.prompt:
                raise BraidError(f"node {n.name!r}: prompt is empty; it must hold at least one token")
            if n.output not in OUTPUTS:
                raise BraidError(f"node {n.name!r}: output {n.output!r} is not one of {', '.join(OUTPUTS)}")
            if n.private and not n.role:
                raise BraidError(f"node {n.name!r} is private but has no role to be private to")
        by_name = dict(zip(names, self.nodes))
        for n in self.nodes:
            for i, e in enumerate(n.parents):
                if bool(e.node) == bool(e.message):
                    raise BraidError(f"node {n.name!r}, parent {i}: name exactly one of a node or a message id")
                if e.node and e.node not in by_name:
                    raise BraidError(f"node {n.name!r}, parent {i}: {e.node!r} is not a node of this graph")
                if e.node == n.name:
                    raise BraidError(f"node {n.name!r} names itself as a parent")
                p = by_name.get(e.node)
                if p is not None and p.private and p.role != n.role:
                    raise BraidError(f"node {n.name!r} (role {n.role!r}) reads {p.name!r}, which is private to "
                                     f"role {p.role!r}")
        self.waves()  # (refuses a cycle)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def waves(self) -> list[list[Node]]:
        """The nodes in dependency order: each wave's parents are all in earlier waves."""
        done: set[str] = set()
        left, waves = list(self.nodes), []
        while left:
            ready = [n for n in left if all(not e.node or e.node in done for e in n.parents)]
            if not ready:
                raise BraidError(f"the graph has a cycle through {', '.join(sorted(n.name for n in left))}")
            waves.append(ready)
            done |= {n.name for n in ready}
            left = [n for n in left if n.name not in done]
        return waves

    @property
    def messages(self) -> list[str]:
        """Session messages the graph names as parents (to resolve before it runs)."""
        return [e.message for n in self.nodes for e in n.parents if e.message]


@dataclass(frozen=True)
class _Item:
    """One message in a node's context, as the node read it: its id, offset, and the private nodes its
    encoding attended to (`taint`)."""

    message: str
    offset: int
    taint: frozenset[str]
    source: str = ""  # the node it is (a version of), "" for a session message or a re-encoded run


@dataclass
class NodeToken:
    node: str
    token_id: int
    text: str
    finish_reason: str | None


@dataclass
class NodeDone:
    node: str
    message_id: str  # its output message: prompt + reply
    text: str  # the reply ("" for a node without sampling)
    reencoded: list[str]  # parents it read through a re-encoded copy ("name:text" or "name:private")


@dataclass
class DagRun:
    """Iterate for NodeToken and NodeDone events, wave by wave. After it: `outputs` (node -> message id).
    What it makes is kept from eviction until `free()`, which also drops the re-encoded copies it made
    (outputs stay: they belong to the caller)."""

    engine: Engine
    graph: Graph
    outputs: dict[str, str] = field(default_factory=dict)
    temporary: list[str] = field(default_factory=list)
    _held: list[str] = field(default_factory=list)  # what it made, kept from eviction until free()
    # decoding node -> seconds from its wave's start (its parents read, its prompt encoded) to its first token
    ttft: dict[str, float] = field(default_factory=dict)
    _taint: dict[str, frozenset[str]] = field(default_factory=dict)  # node -> its cached encoding's taint
    _context: dict[str, list[_Item]] = field(default_factory=dict)  # node -> what it read, in order
    _visible: dict[tuple[str, str], _Item] = field(default_factory=dict)  # (node, role) -> its clean copy

    def __iter__(self) -> Iterator[NodeToken | NodeDone]:
        for wave in self.graph.waves():
            yield from self._run_wave(wave)

    def shareable(self, name: str) -> bool:
        """Whether node `name`'s output may outlive the graph: neither private nor encoded with a private node
        in view (a later call could read it from any role)."""
        return not self._taint[name]

    def free(self) -> None:
        """Release what it held and free its re-encoded copies (those evicted meanwhile are gone already)."""
        for mid in self.temporary:
            try:
                self.engine.free(mid, when_unpinned=True)
            except UnknownMessageError:
                pass
        self.temporary = []
        self.engine.release(self._held)
        self._held = []

    # ---- one wave: each node's context, then one prefill call and one decode call for all of them ----
    def _run_wave(self, wave: Sequence[Node]) -> Iterator[NodeToken | NodeDone]:
        start = time.perf_counter()
        notes: dict[str, list[str]] = {}
        for n in wave:
            self._context[n.name], notes[n.name] = self._read_parents(n)
        encode = [n for n in wave if n.sampling is None]
        if encode:
            for n, mid in zip(encode, self.engine.prefill([self._call(n) for n in encode])):
                self._finish(n, mid)  # (all of them before any event: a consumer leaving loses nothing)
            for n in encode:
                yield NodeDone(n.name, self.outputs[n.name], "", notes[n.name])
        decode = [n for n in wave if n.sampling is not None]
        if decode:
            stream = self.engine.decode_stream([self._call(n) for n in decode])
            replies: dict[int, list[str]] = {}
            try:
                for ev in stream:
                    if ev.call not in replies:
                        self.ttft[decode[ev.call].name] = time.perf_counter() - start
                    replies.setdefault(ev.call, []).append(ev.text)
                    yield NodeToken(decode[ev.call].name, ev.token_id, ev.text, ev.finish_reason)
            finally:
                stream.close()  # (stores nothing unless the calls had ended; what it stored is recorded here)
                for n, mid in zip(decode, stream.ids or ()):
                    if mid in self.engine.store:
                        self._finish(n, mid)
            for c, n in enumerate(decode):
                yield NodeDone(n.name, self.outputs[n.name], "".join(replies.get(c, [])), notes[n.name])

    def _call(self, n: Node):
        ctx = self._context[n.name]
        parents, offsets = [i.message for i in ctx], [i.offset for i in ctx]
        if n.sampling is None:
            return PrefillCall(n.prompt, parents=parents, offsets=offsets)
        return DecodeCall(n.prompt, parents=parents, offsets=offsets, sampling=n.sampling)

    def _finish(self, n: Node, mid: str) -> None:
        self.outputs[n.name] = mid
        self._held += self.engine.hold([mid])
        taint = frozenset().union(*(i.taint for i in self._context[n.name]))
        self._taint[n.name] = taint | ({n.name} if n.private else set())

    # ---- reading parents ---------------------------------------------------------------------------
    def _clean(self, taint: frozenset[str], role: str) -> bool:
        return all(self.graph.node(t).role == role for t in taint)

    def _read_parents(self, n: Node) -> tuple[list[_Item], list[str]]:
        """The node's context, in order, and a note per parent read through a re-encoded copy. Consecutive
        parents read as text are re-encoded together, in one prefill, as a text prompt would hold them."""
        ctx: list[_Item] = []
        notes: list[str] = []
        run: list[int] = []  # tokens of text parents waiting to be re-encoded together
        run_at = 0
        for e in n.parents:
            p = self.graph.node(e.node) if e.node else None
            if p is not None and p.output == "text" and not p.private and (not run or e.offset is None):
                if not run:
                    run_at = self._offset(e.offset, ctx)
                run += self.engine.message(self.outputs[p.name]).token_ids
                notes.append(f"{p.name}:text")
                continue
            if run:
                ctx.append(self._reencode(run, run_at, ctx))
                run = []
            at = self._offset(e.offset, ctx)
            if p is None:  # a session message: nothing private in it
                ctx.append(_Item(e.message, at, frozenset()))
            elif p.output == "text" and p.private:  # its own item: its tokens are the private text itself
                item = self._reencode(self.engine.message(self.outputs[p.name]).token_ids, at, ctx)
                ctx.append(_Item(item.message, at, item.taint | {p.name}, p.name))
                notes.append(f"{p.name}:text")
            elif p.output == "text":  # (a text parent at its own offset: a run of its own)
                run, run_at = list(self.engine.message(self.outputs[p.name]).token_ids), at
                notes.append(f"{p.name}:text")
            elif e.leak or self._clean(self._taint[p.name], n.role):
                ctx.append(_Item(self.outputs[p.name], at, self._taint[p.name], p.name))
            else:
                copy = self._without_private(p.name, n.role)
                ctx.append(_Item(copy.message, at, copy.taint, p.name))
                notes.append(f"{p.name}:private")
        if run:
            ctx.append(self._reencode(run, run_at, ctx))
        return ctx, notes

    def _offset(self, offset: int | None, ctx: list[_Item]) -> int:
        if offset is not None:
            return offset
        if not ctx:
            return 0
        last = self.engine.message(ctx[-1].message)
        return ctx[-1].offset + last.num_tokens

    def _reencode(self, tokens: Sequence[int], at: int, ctx: list[_Item]) -> _Item:
        """`tokens` encoded at `at`, after the context `ctx` (its taint: the context's)."""
        new, = self.engine.prefill([PrefillCall(list(tokens), parents=[i.message for i in ctx],
                                                offsets=[i.offset for i in ctx], new_offset=at)])
        self.temporary.append(new)
        self._held += self.engine.hold([new])
        return _Item(new, at, frozenset().union(*(i.taint for i in ctx)) if ctx else frozenset())

    def _without_private(self, name: str, role: str) -> _Item:
        """A copy of node `name`'s output encoded without what `role` may not see: its context rebuilt (clean
        items kept, other roles' private nodes dropped, the rest re-encoded after what is kept), then its
        own tokens re-encoded after that, where they were."""
        key = (name, role)
        if key not in self._visible:
            rebuilt: list[_Item] = []
            for item in self._context[name]:
                if self._clean(item.taint, role):
                    rebuilt.append(item)
                elif item.source and self.graph.node(item.source).private:
                    continue  # another role's private node: not seen at all
                else:
                    rebuilt.append(self._reencode(self.engine.message(item.message).token_ids, item.offset, rebuilt))
            own = self.engine.message(self.outputs[name])
            self._visible[key] = self._reencode(own.token_ids, own.offset, rebuilt)  # (taint: what was kept)
        return self._visible[key]


def run_dag(engine: Engine, graph: Graph) -> DagRun:
    """The graph's run; iterate it for events (see DagRun)."""
    return DagRun(engine, graph)
