"""A DAG of agent calls: its nodes and their edges, checked whole when the graph is built, and the order it runs in.

A node is one call of one agent (its `role`): it reads its parents' messages, each at an offset, then encodes its
`prompt` and, with `sampling`, decodes a reply after it. Its output message (the prompt and the reply) is what its
children read. Nodes whose parents are done form a wave and run together (methods.dag.run); a staircase node runs
alongside the wave whose decodes it streams (methods.dag.streaming).
"""

from dataclasses import dataclass

from braid.engine.errors import BraidError
from braid.engine.sampling import SamplingParams
from braid.methods.staircase import StaircaseSchedule, Variant

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
    """One call of one agent: what it reads (`parents`), what it encodes (`prompt`), whether and how it decodes."""

    name: str
    prompt: str  # the node's own text: the header its reply follows, or, without sampling, the message itself
    role: str = ""  # the agent it belongs to ("": no one's; such a node cannot be private)
    parents: tuple[Edge, ...] = ()
    sampling: SamplingParams | None = None  # None: encode the prompt only (a shared text, a system prompt)
    output: str = "kv"  # how children read it: its cached encoding ("kv") or re-encoded in their context ("text")
    private: bool = False  # only its role's nodes may read it, directly or through cached encodings
    staircase: bool = False  # read the decoding parents chunk by chunk as they decode (they must come last)


@dataclass
class Graph:
    """A workflow's nodes and how its staircase and calibrated nodes run. Built only if the run can take it (names,
    parents, privacy, no cycle, staircase shapes): otherwise a BraidError says what is wrong, before anything runs."""

    nodes: list[Node]
    # for staircase nodes; None: the server's default where the graph is sent (engine runs use the defaults)
    schedule: StaircaseSchedule | None = None
    variant: Variant = Variant.REPREFILL
    # read cached replies through the engine's trained calibration (methods.calibration: cache mapper, synthesizer
    # LoRA, boundary refresh), in the nodes shaped as a synthesis: see methods.dag.adapted.calibrated
    calibrated: bool = False
    # with calibrated: run the turns with the calibration's turn LoRA where it has one (see methods.dag.adapted.turn);
    # false: base weights
    turn_lora: bool = True

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
        at = {n.name: i for i, w in enumerate(self.waves()) for n in w}  # (refuses a cycle)
        for n in self.nodes:
            if n.staircase:
                self._check_staircase(n, at)

    def _check_staircase(self, n: Node, at: dict[str, int]) -> None:
        where = f"node {n.name!r} (staircase)"
        if n.sampling is None:
            raise BraidError(f"{where} streams a reply from its parents' chunks: set decode")
        streamed = self.streamed(n)
        if not streamed:
            raise BraidError(f"{where} has no decoding node of this graph as a parent: nothing to stream")
        if len(set(streamed)) < len(streamed):
            raise BraidError(f"{where} names a parent it streams twice")
        if any(e.offset is not None for e in n.parents):
            raise BraidError(f"{where}: its parents are read one after another; leave their offsets unset")
        first = next(i for i, e in enumerate(n.parents) if e.node in streamed)
        if any(e.node not in streamed for e in n.parents[first:]):
            raise BraidError(f"{where}: the parents it streams must come last, after those it reads whole")
        if len({self.node(p).staircase for p in streamed}) > 1:
            raise BraidError(f"{where}: the parents it streams must be all staircase nodes or none")
        if len({self.node(p).output for p in streamed}) > 1:
            raise BraidError(f"{where}: the parents it streams must have one output kind (all kv or all text)")
        homes = sorted({self._home(p, at) for p in streamed})
        if len(homes) > 1:
            a, b = (next(p for p in streamed if self._home(p, at) == w) for w in homes[:2])
            raise BraidError(f"{where}: the parents it streams must decode together, but {b!r} waits for nodes "
                             f"{a!r} does not")
        late = [e.node for e in n.parents[:first] if e.node and at[e.node] > homes[0]]
        if late:
            raise BraidError(f"{where}: {late[0]!r} is read whole, so it must be done before the parents it "
                             f"streams start decoding")
        self.stair.quorum(len(streamed))  # (refuses a redundancy that leaves nothing to wait for)

    def _home(self, name: str, at: dict[str, int]) -> int:
        """The wave a node decodes alongside: its own, or for a staircase node its streamed parents' home."""
        n = self.node(name)
        return self._home(self.streamed(n)[0], at) if n.staircase else at[name]

    @property
    def stair(self) -> StaircaseSchedule:
        """The schedule staircase nodes run with."""
        return self.schedule if self.schedule is not None else StaircaseSchedule(strict=False)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def replies(self, n: Node) -> list[Edge]:
        """Node n's parents that are other nodes' replies (decoding nodes of the graph)."""
        return [e for e in n.parents if e.node and self.node(e.node).sampling is not None]

    def streamed(self, n: Node) -> list[str]:
        """The parents a staircase node reads as they decode: its parents that are decoding nodes."""
        return [e.node for e in self.replies(n)] if n.staircase else []

    def plan(self) -> list[tuple[list[Node], list[Node]]]:
        """The waves in order, each with the staircase nodes that run alongside it (streaming its decodes, or
        the answers of staircase nodes that do), in dependency order."""
        waves = self.waves()
        at = {n.name: i for i, w in enumerate(waves) for n in w}
        plan: list[tuple[list[Node], list[Node]]] = [([], []) for _ in waves]
        for i, wave in enumerate(waves):
            for n in wave:
                plan[self._home(n.name, at)][1 if n.staircase else 0].append(n)
        return [p for p in plan if p[0]]

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
