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

Staircase nodes (seed 003). A node with `staircase=True` reads its decoding parents chunk by chunk while they
decode, as an aggregator of Staircase Streaming does (methods.staircase, with the graph's schedule and
variant): it runs alongside its parents' wave and answers from their first chunks. Its other parents are
read whole first. Cached (kv) parents are read from their KV chunks, text parents from their tokens; a kv
parent whose encoding saw another role's private node turns the node to text chunks, so the control above
holds. Staircases nest: a staircase node may stream other staircase nodes' answers as they are decoded (as
text chunks: an answer has no single encoding until it ends), as debate rounds do. When a staircase node
ends, its prompt and reply are encoded once after its parents' whole messages (as a node that waited would
read them): that is the output its children read.

Calibrated reading. With `calibrated`, a node shaped as a synthesis (its decoding parents, all cached, after
the parents it reads whole; not streamed by a staircase) reads those replies as the served cache path does,
through the engine's calibration: the mapper on their KV, the boundary refresh, and the synthesizer LoRA in
its own forwards. Its output is then encoded again with base weights, as a staircase node's is, so any
reader may take it. When the calibration has a turn LoRA (braid.train.turns, Prompt Choreography's fine-tuning
of the agents), a calibrated graph's turns also run with it: a turn is a decoding node that reads another
decoding node's reply but is not shaped as a synthesis (a debater speaking after earlier replies, then its own
notes). Its parents are read as usual (cached); the LoRA is on in its own forwards only, and its output is
encoded again with base weights.
"""

import queue
import threading
import time
from collections.abc import Collection, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from braid.engine.engine import DecodeCall, DecodeStream, Engine, PrefillCall
from braid.engine.errors import BraidError, PreconditionError, UnknownMessageError
from braid.engine.sampling import SamplingParams
from braid.methods.calibration import served_refresh
from braid.methods.staircase import BranchFeed, RoundTaken, StaircaseResult, StaircaseSchedule, Variant, staircase
from braid.methods.synthesis import TEXT, Placement, SynthesisMode, synthesis_stream

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
    staircase: bool = False  # read the decoding parents chunk by chunk as they decode (they must come last)


@dataclass
class Graph:
    nodes: list[Node]
    # for staircase nodes; None: the server's default where the graph is sent (engine runs use the defaults)
    schedule: StaircaseSchedule | None = None
    variant: Variant = Variant.REPREFILL
    # read cached replies through the engine's trained calibration (methods.calibration: cache mapper, synthesizer
    # LoRA, boundary refresh), in the nodes shaped as a synthesis: see DagRun._calibrated
    calibrated: bool = False
    # with calibrated: run the turns with the calibration's turn LoRA where it has one (see DagRun._turn); false:
    # base weights
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
class NodeRound:
    """A staircase node's round: the token range [start, end) of each parent's message it took in before its
    next answer chunk."""
    node: str
    round: int
    chunks: dict[str, tuple[int, int]]


@dataclass
class NodeDone:
    node: str
    message_id: str  # its output message: prompt + reply
    text: str  # the reply ("" for a node without sampling)
    reencoded: list[str]  # parents it read through a re-encoded copy ("name:text" or "name:private")
    replica: str = ""  # where it was decoded, when not on the run's own engine (a Worker replica)


class WaveStream(Protocol):
    """A wave's decoding calls running elsewhere, read as `Engine.decode_stream`'s stream is: iterate for
    TokenEvents (`call`, `token_id`, `text`, `finish_reason`); `ids` once iteration ends, each call's output
    stored in the run's engine; `close()` from the iterating thread, always; `interrupt()` from any other, to
    end the iteration with an error; `replicas[c]`: where call c ran. Asked to ship as they decode,
    `arrivals[c]` is call c's message as it arrives (a BranchFeed source that reports through `listen`)."""

    ids: list[str] | None
    replicas: list[str]
    arrivals: list | None

    def __iter__(self) -> Iterator: ...

    def close(self) -> None: ...

    def interrupt(self) -> None: ...


class WaveExecutor(Protocol):
    """Where a graph's waves decode, when not on the run's engine: other replicas (synthesizer.waves runs them
    on Worker replicas). Called by DagRun, from the run's thread, for each wave's decoding nodes except those
    that run with the calibration's LoRAs (synthesis-shaped nodes and turns of a calibrated graph). The calls'
    parents are messages of the run's engine. With `ship` (chunk sizes in tokens, the last repeating), each
    call's message also comes back in chunks as it decodes, for the staircase nodes that stream the wave."""

    def decode_stream(self, calls: list[DecodeCall], ship: Sequence[int] = ()) -> WaveStream: ...


@dataclass
class DagRun:
    """Iterate for NodeToken and NodeDone events, wave by wave. After it: `outputs` (node -> message id).
    What it makes is kept from eviction until `free()`, which also drops the re-encoded copies it made
    (outputs stay, unless `free(keep=...)` says otherwise: they belong to the caller)."""

    engine: Engine
    graph: Graph
    executor: WaveExecutor | None = None  # where decoding waves run, adapted nodes aside (None: on `engine`)
    outputs: dict[str, str] = field(default_factory=dict)
    temporary: list[str] = field(default_factory=list)
    _held: list[str] = field(default_factory=list)  # what it made, kept from eviction until free()
    # decoding node -> seconds from its wave's start (its parents read, its prompt encoded) to its first token
    ttft: dict[str, float] = field(default_factory=dict)
    _taint: dict[str, frozenset[str]] = field(default_factory=dict)  # node -> its cached encoding's taint
    _context: dict[str, list[_Item]] = field(default_factory=dict)  # node -> what it read, in order
    _visible: dict[tuple[str, str], _Item] = field(default_factory=dict)  # (node, role) -> its clean copy
    _staircase_results: dict[str, StaircaseResult] = field(default_factory=dict)  # staircase node -> its run

    def __iter__(self) -> Iterator[NodeToken | NodeRound | NodeDone]:
        if self.graph.calibrated and self.engine.calibration is None:
            raise PreconditionError("the graph asks for calibrated reading, but this server's model has no "
                                    "calibration loaded (braid calibrate; braid serve --calibration)")
        for wave, attached in self.graph.plan():
            yield from self._run_wave(wave, attached)

    def shareable(self, name: str) -> bool:
        """Whether node `name`'s output may outlive the graph: neither private nor encoded with a private node
        in view (a later call could read it from any role)."""
        return not self._taint[name]

    def free(self, keep: Collection[str] | None = None) -> None:
        """Release what it held and free its re-encoded copies (those evicted meanwhile are gone already). With
        `keep`, its outputs not in `keep` go too (`keep=()`: all of them)."""
        if keep is not None:
            self.temporary += [mid for mid in self.outputs.values() if mid not in keep]
        for mid in self.temporary:
            try:
                self.engine.free(mid, when_unpinned=True)
            except UnknownMessageError:
                pass
        self.temporary = []
        self.engine.release(self._held)
        self._held = []

    # ---- one wave: each node's context, then one prefill call and one decode call for all of them ----
    def _run_wave(self, wave: Sequence[Node], attached: Sequence[Node] = ()) -> Iterator[NodeToken | NodeDone]:
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
        calibrated = [n for n in decode if self._calibrated(n)]
        turns = [n for n in decode if n not in calibrated and self._turn(n)]
        decode = [n for n in decode if n not in calibrated and n not in turns]
        if attached:
            yield from self._stream_wave(decode, attached, notes, start)
        elif decode:
            stream = (self.executor or self.engine).decode_stream([self._call(n) for n in decode])
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
            where = getattr(stream, "replicas", None) or [""] * len(decode)
            for c, n in enumerate(decode):
                yield NodeDone(n.name, self.outputs[n.name], "".join(replies.get(c, [])), notes[n.name], where[c])
        if turns:
            yield from self._adapted_turns(turns, notes, start)
        for n in calibrated:
            yield from self._synthesize(n, notes, start)

    def _call(self, n: Node):
        ctx = self._context[n.name]
        parents, offsets = [i.message for i in ctx], [i.offset for i in ctx]
        if n.sampling is None:
            return PrefillCall(n.prompt, parents=parents, offsets=offsets)
        return DecodeCall(n.prompt, parents=parents, offsets=offsets, sampling=n.sampling)

    def _finish(self, n: Node, mid: str) -> None:
        self.outputs[n.name] = mid
        self._held += self.engine.hold([mid])
        self._taint[n.name] = self._taint_of(n)

    def _taint_of(self, n: Node) -> frozenset[str]:
        """The private nodes node n's encoding attends to: its context's, and itself if it is private."""
        taint = frozenset().union(*(i.taint for i in self._context[n.name]))
        return taint | ({n.name} if n.private else set())

    # ---- staircase nodes: a wave's decodes and the nodes streaming them, run together -------------------
    def _stream_wave(self, decode: Sequence[Node], attached: Sequence[Node], notes: dict[str, list[str]],
                     start: float) -> Iterator[NodeToken | NodeRound | NodeDone]:
        """The wave's decode call in one thread and each staircase node in its own, their events merged as
        they come. A staircase node reads its branches through its own BranchFeed: the wave's decode thread
        feeds it token by token, or, for a nested staircase, the threads of the staircase nodes it streams.
        Any failure (or the consumer leaving) stops them all within a step."""
        eng, calls = self.engine, {n.name: c for c, n in enumerate(decode)}
        # everything that may fail first: from the decode call on, nothing fails before the threads
        runs = {s.name: self._staircase_run(s, self.graph.streamed(s), notes) for s in attached}
        offsets = [self._offset(None, self._context[n.name]) for n in decode]
        headers = [len(eng.tokenize(n.prompt)) for n in decode]
        answers = {s.name: _AnswerSource(eng.tokenize(s.prompt)) for s in attached}
        sources = {s.name: [(p, answers.get(p), calls.get(p)) for p in self.graph.streamed(s)] for s in attached}
        missing = [p for parts in sources.values() for p, a, c in parts if a is None and c is None]
        if missing:
            raise BraidError(f"staircase: {missing[0]!r} is not decoded in this wave")
        remote = self.executor is not None and bool(decode)  # (the wave decodes elsewhere, shipping chunks back)
        if remote:
            stream = self.executor.decode_stream([self._call(n) for n in decode], ship=self.graph.stair.proposer)
            wave, branch = None, lambda c: (stream.arrivals[c], 0)
        else:
            stream = eng.decode_stream([self._call(n) for n in decode], readable=True)  # (read as it decodes)
            wave = _WaveSource(stream, offsets, headers)
            branch = lambda c: (wave, c)  # noqa: E731
        feeds = {name: BranchFeed([], pump=False, branches=[(a, 0) if a is not None else branch(c)
                                                            for _, a, c in parts])
                 for name, parts in sources.items()}
        if remote:  # (arrivals report to the feeds reading them: what came, its end, its failure)
            for feed in feeds.values():
                for source, _ in feed.where:
                    if source in stream.arrivals:
                        source.listen(lambda feed=feed, source=source: feed.arrived(source))
        readers = {n: [feeds[s.name] for s in attached if n in self.graph.streamed(s)] for n in [*calls, *answers]}
        events: queue.Queue = queue.Queue()
        stop = threading.Event()
        wave_held: list[str] = []

        def pump() -> None:
            why, error = "its call stopped before the reply finished", None
            try:
                for ev in stream:
                    name = decode[ev.call].name
                    for feed in readers[name] if not remote else ():  # (remote: the arrivals report)
                        feed.record(wave, ev.call, ev.finish_reason is not None)
                    events.put((name, NodeToken(name, ev.token_id, ev.text, ev.finish_reason)))
                    if stop.is_set():
                        break
                else:
                    wave_held.extend(eng.hold(stream.ids))  # (before the feeds learn it ended: they read it)
            except BaseException as e:  # noqa: BLE001 - re-raised by the consumer
                why, error = f"{type(e).__name__}: {e}", e
            finally:
                events.put((None, error))  # (first: its error, not a staircase's view of it, is what fails the run)
                try:
                    stream.close()
                finally:
                    for feed in {id(f): f for fs in readers.values() for f in fs}.values():
                        feed.end(wave, why)

        def aggregate(node: Node) -> None:
            why, error, answer = "its staircase stopped before the answer finished", None, answers[node.name]
            try:
                gen = runs[node.name](feeds[node.name])
                try:
                    for ev in gen:
                        if isinstance(ev, NodeToken):
                            answer.tokens.append(ev.token_id)
                            for feed in readers[node.name]:
                                feed.record(answer, 0, ev.finish_reason is not None)
                        events.put((node.name, ev))
                        if stop.is_set():
                            break
                    else:
                        answer.ids = [node.name]  # (it ended)
                finally:
                    gen.close()
            except BaseException as e:  # noqa: BLE001 - re-raised by the consumer
                why, error = f"{type(e).__name__}: {e}", e
            for feed in readers[node.name]:
                feed.end(answer, why)
            events.put((None, error))

        threads = [threading.Thread(target=pump, daemon=True, name="dag-wave")]
        threads += [threading.Thread(target=aggregate, args=(s,), daemon=True, name="dag-staircase")
                    for s in attached]
        replies: dict[str, list[str]] = {}
        error: BaseException | None = None
        pending = 0
        try:
            for t in threads:
                t.start()
                pending += 1
            while pending:
                name, ev = events.get()
                if name is None:  # a thread ended (with its error, or None)
                    pending -= 1
                    if ev is not None and error is None:
                        error = ev
                        stop.set()
                        for feed in feeds.values():
                            feed.cancel()
                    continue
                if error is not None:
                    continue
                if isinstance(ev, NodeToken):
                    if name not in replies:
                        self.ttft[name] = time.perf_counter() - start
                    replies.setdefault(name, []).append(ev.text)
                yield ev
            if error is not None:
                raise error
        finally:
            stop.set()
            for feed in feeds.values():
                feed.cancel()
            if threads[0].is_alive():
                stream.interrupt()  # (a pump waiting for its next token sees the call end at the next step)
            elif not pending:
                stream.close()  # (no pump ever ran: the call still leaves the batch)
            for t in threads:
                if t.is_alive():
                    t.join()
            try:
                for name in feeds:  # the staircases' answer messages: only their tokens are kept (_encode_outputs)
                    for mid in self._staircase_results[name].message_ids[-1:]:
                        try:
                            eng.free(mid, when_unpinned=True)
                        except UnknownMessageError:
                            pass  # (evicted meanwhile: nothing holds it)
                for n, mid in zip(decode, stream.ids or ()):
                    if mid in eng.store:
                        self._finish(n, mid)
            finally:
                eng.release(wave_held)
        for n in attached:  # (in dependency order: a nested staircase node reads the outputs before it)
            self._encode_outputs([n], [self._staircase_results.pop(n.name).answer])
        where = stream.replicas if remote else [""] * len(decode)
        for c, n in enumerate(decode):
            yield NodeDone(n.name, self.outputs[n.name], "".join(replies.get(n.name, [])), notes[n.name], where[c])
        for n in attached:
            yield NodeDone(n.name, self.outputs[n.name], "".join(replies.get(n.name, [])), notes[n.name])

    def _staircase_run(self, n: Node, streamed: list[str], notes: dict[str, list[str]]):
        """Staircase node n's run over a feed: its whole parents read, its mode chosen (KV chunks; text chunks
        where the parents are text or staircase answers, or where a cached encoding would leak), its events
        named by parent."""
        whole = [e for e in n.parents if e.node not in streamed]
        self._context[n.name], notes[n.name] = self._read_parents(n, whole)
        kv = all(self.graph.node(p).output == "kv" and not self.graph.node(p).staircase for p in streamed)
        leaky = [e.node for e in n.parents if kv and e.node in streamed and not e.leak
                 and not self._clean(self._taint_of(self.graph.node(e.node)), n.role)]
        text = not kv or bool(leaky)
        notes[n.name] += [f"{p}:private" if p in leaky else f"{p}:text" for p in streamed if text]
        prefix = [i.message for i in self._context[n.name]]
        mode = TEXT if text else SynthesisMode(Placement.SEQUENTIAL)
        self._staircase_results[n.name] = result = StaircaseResult()

        def run(feed: BranchFeed) -> Iterator[NodeToken | NodeRound]:
            # (no clock: a parent that is slow is still coming; a failed or cancelled one ends the feed)
            for ev in staircase(self.engine, feed, n.prompt, prefix, self.graph.stair, self.graph.variant, mode,
                                n.sampling, idle_s=None, result=result):
                if isinstance(ev, RoundTaken):
                    yield NodeRound(n.name, ev.round, {streamed[b]: r for b, r in ev.chunks.items()})
                else:
                    yield NodeToken(n.name, ev.token_id, ev.text, ev.finish_reason)
        return run

    def _adaptable(self, n: Node) -> bool:
        """Whether node n may run with the calibration's LoRAs: the graph asks for calibrated reading, the engine
        has a calibration, and n decodes its own tokens (neither a staircase node nor one a staircase streams:
        those come from the wave's own decode) after at least one other node's reply, all read as cached KV."""
        replies = self.graph.replies(n)
        return self.graph.calibrated and self.engine.calibration is not None and n.sampling is not None \
            and not n.staircase and not any(n.name in self.graph.streamed(s) for s in self.graph.nodes) \
            and bool(replies) and all(self.graph.node(e.node).output == "kv" for e in replies)

    def _calibrated(self, n: Node) -> bool:
        """Whether node n reads its replies through the engine's calibration: adaptable, and shaped as a synthesis
        (its replies last, after the parents it reads whole, at unset offsets), the layout the calibration was
        trained on."""
        if not self._adaptable(n):
            return False
        first = n.parents.index(self.graph.replies(n)[0])
        return len(self.graph.replies(n)) == len(n.parents) - first and all(e.offset is None for e in n.parents)

    def _turn(self, n: Node) -> bool:
        """Whether node n runs with the calibration's turn LoRA: adaptable, not shaped as a synthesis (a debater
        that reads earlier replies, then its own notes: what braid.train.turns trains on), and the graph wants
        the turn LoRA, which the calibration has."""
        return self.graph.turn_lora and self.engine.calibration is not None \
            and self.engine.calibration.turns is not None and self._adaptable(n) and not self._calibrated(n)

    def _adapted_turns(self, wave: Sequence[Node], notes: dict[str, list[str]], start: float
                       ) -> Iterator[NodeToken | NodeDone]:
        """The wave's turns, decoded together on the run's engine with the turn LoRA on in their forwards; each
        one's output is then encoded again with base weights (its adapted KV is dropped)."""
        hooks = self.engine.calibration.turns
        stream = self.engine.decode_stream([self._call(n) for n in wave], adapter=hooks.adapter, tag=hooks.tag)
        answers = yield from self._adapted(stream, wave, start)
        self._encode_outputs(wave, [tokens for tokens, _ in answers], reread=False)
        for n, (_, text) in zip(wave, answers):
            yield NodeDone(n.name, self.outputs[n.name], text, notes[n.name])

    def _adapted(self, stream: DecodeStream, nodes: Sequence[Node], start: float
                 ) -> Generator[NodeToken, None, list[tuple[list[int], str]]]:
        """Stream an adapted decode (call c: nodes[c]) as NodeTokens, recording each node's TTFT; then drop its
        messages (adapted KV: only the tokens are kept, for _encode_outputs) and return each call's (tokens,
        text)."""
        tokens: list[list[int]] = [[] for _ in nodes]
        texts: list[list[str]] = [[] for _ in nodes]
        try:
            for ev in stream:
                if not tokens[ev.call]:
                    self.ttft[nodes[ev.call].name] = time.perf_counter() - start
                tokens[ev.call].append(ev.token_id)
                texts[ev.call].append(ev.text)
                yield NodeToken(nodes[ev.call].name, ev.token_id, ev.text, ev.finish_reason)
        finally:
            stream.close()
            for mid in stream.ids or ():
                if mid in self.engine.store:
                    self.engine.free(mid, when_unpinned=True)
        return [(t, "".join(x)) for t, x in zip(tokens, texts)]

    def _synthesize(self, n: Node, notes: dict[str, list[str]], start: float) -> Iterator[NodeToken | NodeDone]:
        """Calibrated node n: its whole parents read as usual (the prefix), its replies read as the served cache
        path reads branches (methods.synthesis); a reply whose encoding saw another role's private node is read
        through a copy re-encoded without it (through the mapper like the rest). The refresh is the one the
        calibration was trained with. Its output is encoded again with base weights."""
        edges = self.graph.replies(n)
        whole = [e for e in n.parents if e not in edges]
        prefix, notes[n.name] = self._read_parents(n, whole)
        self._context[n.name] = prefix
        leaky = [e for e in edges if not e.leak and not self._clean(self._taint[e.node], n.role)]
        branches = [self._without_private(e.node, n.role).message if e in leaky else self.outputs[e.node]
                    for e in edges]
        notes[n.name] += [f"{e.node}:private" for e in leaky]
        attached = self.engine.calibration  # (its placement, and the refresh it was trained with)
        mode = SynthesisMode(attached.calibration.placement, attached.hooks, served_refresh(attached))
        stream = synthesis_stream(self.engine, branches, n.prompt, [i.message for i in prefix], mode, n.sampling)
        [(answer, text)] = yield from self._adapted(stream, [n], start)
        self._encode_outputs([n], [answer])
        yield NodeDone(n.name, self.outputs[n.name], text, notes[n.name])

    def _encode_outputs(self, nodes: Sequence[Node], answers: Sequence[list[int]], reread: bool = True) -> None:
        """Each node's prompt and answer encoded with base weights after its parents' whole messages, read as a
        node that waited for them reads them (`reread` False: as it read them already), in one prefill: the
        outputs of staircase and adapted nodes."""
        if reread:
            for n in nodes:
                self._context[n.name], _ = self._read_parents(n)
        ctxs = [self._context[n.name] for n in nodes]
        mids = self.engine.prefill([PrefillCall(self.engine.tokenize(n.prompt) + answer,
                                                parents=[i.message for i in ctx], offsets=[i.offset for i in ctx])
                                    for n, answer, ctx in zip(nodes, answers, ctxs)])
        for n, mid in zip(nodes, mids):
            self._finish(n, mid)

    # ---- reading parents ---------------------------------------------------------------------------
    def _clean(self, taint: frozenset[str], role: str) -> bool:
        return all(self.graph.node(t).role == role for t in taint)

    def _read_parents(self, n: Node, parents: Sequence[Edge] | None = None) -> tuple[list[_Item], list[str]]:
        """The node's context (from `parents`, default all of its parents), in order, and a note per parent
        read through a re-encoded copy. Consecutive parents read as text are re-encoded together, in one
        prefill, as a text prompt would hold them."""
        ctx: list[_Item] = []
        notes: list[str] = []
        run: list[int] = []  # tokens of text parents waiting to be re-encoded together
        run_at = 0
        for e in n.parents if parents is None else parents:
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


class _WaveSource:
    """A wave's decode call as the source of staircase branches (BranchFeed's reading side): call j's message
    starts at `offsets[j]` with a header of `headers[j]` tokens."""

    def __init__(self, stream: DecodeStream, offsets: list[int], headers: list[int]):
        self.decode, self.offsets, self._headers = stream, offsets, headers

    @property
    def ids(self) -> list[str] | None:
        return self.decode.ids

    def header_length(self, call: int) -> int:
        return self._headers[call]

    def encoded(self, call: int) -> int:
        return self.decode.encoded(call)

    def partial_kv(self, call: int, start: int, end: int):
        return self.decode.partial_kv(call, start, end)


class _AnswerSource:
    """A staircase node's message (prompt + answer so far) as the source of a nested staircase's branch: its
    tokens only (text chunks), since the answer has no single encoding until it ends."""

    def __init__(self, prompt: list[int]):
        self.decode, self.offsets, self._header = self, [0], len(prompt)
        self.tokens = list(prompt)  # the message so far: its prompt, then the answer as it is decoded
        self.ids: list[str] | None = None  # set once the answer has ended

    def header_length(self, call: int) -> int:
        return self._header

    def encoded(self, call: int) -> int:
        return len(self.tokens)

    def partial_kv(self, call: int, start: int, end: int) -> tuple[list[int], None]:
        return self.tokens[start:end], None  # (read as text: there is no KV to give)


def run_dag(engine: Engine, graph: Graph, executor: WaveExecutor | None = None) -> DagRun:
    """The graph's run; iterate it for events (see DagRun). With `executor`, its decoding waves run there (on
    other replicas; calibrated nodes aside), and their outputs come back to `engine`."""
    return DagRun(engine, graph, executor)
