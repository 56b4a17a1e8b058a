"""A DAG's run: its waves in dependency order, each node's parents read, then one prefill call for the wave's
encoding nodes and one decode call for its decoding nodes, so parallel agents share every forward. A wave that
staircase nodes stream runs with them (methods.dag.streaming); nodes read through the calibration run after their
wave (methods.dag.adapted)."""

import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field

from braid.engine.engine import DecodeCall, Engine, PrefillCall
from braid.engine.errors import PreconditionError
from braid.methods.dag import adapted
from braid.methods.dag.context import Reader
from braid.methods.dag.events import NodeDone, NodeRound, NodeToken
from braid.methods.dag.graph import Graph, Node
from braid.methods.dag.remote import WaveExecutor
from braid.methods.dag.state import Item, NodeState
from braid.methods.dag.streaming import StreamedWave


@dataclass
class DagRun:
    """Iterate for NodeToken, NodeRound and NodeDone events, wave by wave. After it: `outputs` (node -> message
    id) and `ttft` (decoding node -> seconds from its wave's start to its first token). What it makes is kept from
    eviction until `free()`, which also drops the re-encoded copies it made (outputs stay, unless
    `free(keep=...)` says otherwise: they belong to the caller)."""

    engine: Engine
    graph: Graph
    executor: WaveExecutor | None = None  # where decoding waves run, adapted nodes aside (None: on `engine`)
    temporary: list[str] = field(default_factory=list)  # the re-encoded copies it made
    _held: list[str] = field(default_factory=list)  # what it made, kept from eviction until free()
    states: dict[str, NodeState] = field(init=False)  # node -> what the run knows of it
    reader: Reader = field(init=False)  # how its nodes read their parents

    def __post_init__(self):
        self.states = {n.name: NodeState(n) for n in self.graph.nodes}
        self.reader = Reader(self.engine, self.graph, self.states, self._keep)

    def __iter__(self) -> Iterator[NodeToken | NodeRound | NodeDone]:
        if self.graph.calibrated and self.engine.calibration is None:
            raise PreconditionError("the graph asks for calibrated reading, but this server's model has no "
                                    "calibration loaded (braid calibrate; braid serve --calibration)")
        for wave, attached in self.graph.plan():
            yield from self._run_wave(wave, attached)

    @property
    def outputs(self) -> dict[str, str]:
        """Node -> its output message, for the nodes stored so far."""
        return {name: s.message for name, s in self.states.items() if s.message is not None}

    @property
    def ttft(self) -> dict[str, float]:
        """Decoding node -> seconds from its wave's start (its parents read, its prompt encoded) to its first
        token."""
        return {name: s.ttft for name, s in self.states.items() if s.ttft is not None}

    @property
    def _context(self) -> dict[str, list[Item]]:
        """Node -> what it read, in order."""
        return {name: s.context for name, s in self.states.items()}

    @property
    def _taint(self) -> dict[str, frozenset[str]]:
        """Stored node -> the private nodes its output's encoding attended to."""
        return {name: s.taint for name, s in self.states.items() if s.message is not None}

    def shareable(self, name: str) -> bool:
        """Whether node `name`'s output may outlive the graph: neither private nor encoded with a private node
        in view (a later call could read it from any role)."""
        return not self._taint[name]

    def free(self, keep: Collection[str] | None = None) -> None:
        """Release what it held and free its re-encoded copies (those evicted meanwhile are gone already). With
        `keep`, its outputs not in `keep` go too (`keep=()`: all of them)."""
        if keep is not None:
            self.temporary += [mid for mid in self.outputs.values() if mid not in keep]
        self.engine.discard(self.temporary)
        self.temporary = []
        self.engine.release(self._held)
        self._held = []

    # ---- one wave: each node's context, then one prefill call and one decode call for all of them ----
    def _run_wave(self, wave: Sequence[Node], attached: Sequence[Node] = ()) -> Iterator[NodeToken | NodeDone]:
        start = time.perf_counter()
        for n in wave:
            state = self.states[n.name]
            state.context, state.notes = self.reader.read(n)
        yield from self._encode_wave([n for n in wave if n.sampling is None])
        decode = [n for n in wave if n.sampling is not None]
        calibrated = [n for n in decode if adapted.calibrated(self.graph, self.engine, n)]
        turns = [n for n in decode if n not in calibrated and adapted.turn(self.graph, self.engine, n)]
        decode = [n for n in decode if n not in calibrated and n not in turns]
        if attached:
            yield from StreamedWave(self, decode, attached, start)
        elif decode:
            yield from self._decode_wave(decode, start)
        if turns:
            yield from adapted.run_turns(self, turns, start)
        for n in calibrated:
            yield from adapted.synthesize(self, n, start)

    def _encode_wave(self, encode: Sequence[Node]) -> Iterator[NodeDone]:
        """The wave's nodes without sampling, encoded in one prefill call."""
        if encode:
            for n, mid in zip(encode, self.engine.prefill([self.node_call(n) for n in encode])):
                self.store_output(n, mid)  # (all of them before any event: a consumer leaving loses nothing)
            for n in encode:
                yield self.states[n.name].done()

    def _decode_wave(self, decode: Sequence[Node], start: float) -> Iterator[NodeToken | NodeDone]:
        """The wave's decoding nodes in one decode call, here or on the executor."""
        stream = (self.executor or self.engine).decode_stream([self.node_call(n) for n in decode])
        try:
            for ev in stream:
                self.states[decode[ev.call].name].took(ev.text, start)
                yield NodeToken(decode[ev.call].name, ev.token_id, ev.text, ev.finish_reason)
        finally:
            stream.close()  # (stores nothing unless the calls had ended; what it stored is recorded here)
            for n, mid in zip(decode, stream.ids or ()):
                if mid in self.engine.store:
                    self.store_output(n, mid)
        where = getattr(stream, "replicas", None) or [""] * len(decode)
        for c, n in enumerate(decode):
            self.states[n.name].replica = where[c]
            yield self.states[n.name].done()

    # ---- what the kinds of wave share (here, methods.dag.streaming, methods.dag.adapted) -------------
    def node_call(self, n: Node) -> PrefillCall | DecodeCall:
        """Node n's call: its prompt after its context, decoded if it has sampling."""
        ctx = self.states[n.name].context
        parents, offsets = [i.message for i in ctx], [i.offset for i in ctx]
        if n.sampling is None:
            return PrefillCall(n.prompt, parents=parents, offsets=offsets)
        return DecodeCall(n.prompt, parents=parents, offsets=offsets, sampling=n.sampling)

    def store_output(self, n: Node, mid: str) -> None:
        """Node n's output is message `mid`: recorded, held, and its taint (what its encoding saw) set."""
        state = self.states[n.name]
        state.message = mid
        self._held += self.engine.hold([mid])
        state.taint = self.reader.taint_of(n)

    def encode_outputs(self, nodes: Sequence[Node], answers: Sequence[list[int]], reread: bool = True) -> None:
        """Each node's prompt and answer encoded with base weights after its parents' whole messages, read as a
        node that waited for them reads them (`reread` False: as it read them already), in one prefill: the
        outputs of staircase and adapted nodes."""
        if reread:
            for n in nodes:
                self.states[n.name].context, _ = self.reader.read(n)
        ctxs = [self.states[n.name].context for n in nodes]
        mids = self.engine.prefill([PrefillCall(self.engine.tokenize(n.prompt) + answer,
                                                parents=[i.message for i in ctx], offsets=[i.offset for i in ctx])
                                    for n, answer, ctx in zip(nodes, answers, ctxs)])
        for n, mid in zip(nodes, mids):
            self.store_output(n, mid)

    def _keep(self, mid: str) -> None:
        """A re-encoded copy the run made: held from eviction, freed by free()."""
        self.temporary.append(mid)
        self._held += self.engine.hold([mid])


def run_dag(engine: Engine, graph: Graph, executor: WaveExecutor | None = None) -> DagRun:
    """The graph's run; iterate it for events (see DagRun). With `executor`, its decoding waves run there (on
    other replicas; calibrated nodes aside), and their outputs come back to `engine`."""
    return DagRun(engine, graph, executor)
