"""Staircase nodes (Staircase Streaming): a wave's decodes and the staircase nodes that stream them, run together.

A node with `staircase=True` reads its decoding parents chunk by chunk while they decode, as an aggregator of
Staircase Streaming does (methods.staircase, with the graph's schedule and variant): it runs alongside its parents'
wave and answers from their first chunks. Its other parents are read whole first. Cached (kv) parents are read
from their KV chunks, text parents from their tokens; a kv parent whose encoding saw another role's private node
turns the node to text chunks, so leakage control holds. Staircases nest: a staircase node may stream other
staircase nodes' answers as they are decoded (as text chunks: an answer has no single encoding until it ends), as
debate rounds do. When a staircase node ends, its prompt and reply are encoded once after its parents' whole
messages (as a node that waited would read them): that is the output its children read.
"""

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from braid.engine.engine import DecodeStream
from braid.engine.errors import BraidError
from braid.methods.dag.events import NodeDone, NodeRound, NodeToken
from braid.methods.dag.graph import Node
from braid.methods.staircase import BranchFeed, BranchSource, RoundTaken, StaircaseResult, staircase
from braid.methods.synthesis import TEXT, Placement, SynthesisMode

if TYPE_CHECKING:
    from braid.methods.dag.run import DagRun


class WaveSource:
    """A wave's decode call as the source of staircase branches (a ReportedSource; call j: a branch): call j's
    message starts at `offsets[j]` with a header of `headers[j]` tokens."""

    def __init__(self, stream: DecodeStream, offsets: list[int], headers: list[int]):
        self.stream, self.offsets, self._headers = stream, offsets, headers

    @property
    def ids(self) -> list[str] | None:
        return self.stream.ids

    def header_length(self, call: int) -> int:
        return self._headers[call]

    def encoded(self, call: int) -> int:
        return self.stream.encoded(call)

    def partial_kv(self, call: int, start: int, end: int):
        return self.stream.partial_kv(call, start, end)


class AnswerSource:
    """A staircase node's message (prompt + answer so far) as the source of a nested staircase's branch (a
    ReportedSource of one call): its tokens only (text chunks), since the answer has no single encoding until it
    ends."""

    def __init__(self, prompt: list[int]):
        self.offsets, self._header = [0], len(prompt)
        self.tokens = list(prompt)  # the message so far: its prompt, then the answer as it is decoded
        self.ids: list[str] | None = None  # once the answer has ended: the staircase's message holding it

    def header_length(self, call: int) -> int:
        return self._header

    def encoded(self, call: int) -> int:
        return len(self.tokens)

    def partial_kv(self, call: int, start: int, end: int) -> tuple[list[int], None]:
        return self.tokens[start:end], None  # (read as text: there is no KV to give)


@dataclass
class Aggregator:
    """A staircase node of the wave, planned: the parents it streams, what it reads before them (`prefix`), how
    it reads them (`mode`), its answer as a source for the staircase nodes streaming it, and its feed."""

    node: Node
    streamed: list[str]
    prefix: list[str]
    mode: SynthesisMode
    answer: AnswerSource
    result: StaircaseResult
    feed: BranchFeed | None = None


class StreamedWave:
    """A wave's decodes and the staircase nodes streaming them: the wave's decode call in one thread and each
    staircase node in its own, their events merged as they come. A staircase node reads its branches through its
    own BranchFeed: the wave's decode thread feeds it token by token, or, for a nested staircase, the threads of
    the staircase nodes it streams. Any failure (or the consumer leaving) stops them all within a step."""

    def __init__(self, run: "DagRun", decode: Sequence[Node], attached: Sequence[Node], start: float):
        self.run, self.engine, self.executor, self.graph = run, run.engine, run.executor, run.graph
        self.decode, self.attached, self.start = list(decode), list(attached), start
        self.remote = self.executor is not None and bool(decode)  # (the wave decodes elsewhere, shipping chunks back)
        self.aggregators: list[Aggregator] = []
        self.stream = None  # the wave's decode call: a DecodeStream, or a WaveStream where remote
        self.source: WaveSource | None = None  # the stream as the feeds read it (None where remote: the arrivals)
        self.readers: dict[str, list[BranchFeed]] = {}  # node -> the feeds that read it
        self.events: queue.Queue = queue.Queue()  # (node, event); (None, error or None) when a thread ends
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.pending = 0  # threads started and not ended
        self.held: list[str] = []  # the wave call's outputs, held from its end (the feeds read them) to the wave's

    def __iter__(self) -> Iterator[NodeToken | NodeRound | NodeDone]:
        # everything that may fail first: from the decode call on, nothing fails before the threads
        self.aggregators = [self._plan(s) for s in self.attached]
        offsets = [self.run.reader.offset(None, self.run.states[n.name].context) for n in self.decode]
        headers = [len(self.engine.tokenize(n.prompt)) for n in self.decode]
        self._check_streamed()
        branch = self._start(offsets, headers)
        self._feed(branch)
        self.threads = [threading.Thread(target=self._pump, daemon=True, name="dag-wave")]
        self.threads += [threading.Thread(target=self._aggregate, args=(s,), daemon=True, name="dag-staircase")
                         for s in self.aggregators]
        try:
            yield from self._merge()
        finally:
            self._stop()
        yield from self._outputs()

    # ---- before the threads --------------------------------------------------------------------------
    def _plan(self, n: Node) -> Aggregator:
        """Staircase node n, planned: its whole parents read, its mode chosen (KV chunks; text chunks where the
        parents are text or staircase answers, or where a cached encoding would leak)."""
        streamed, state, reader = self.graph.streamed(n), self.run.states[n.name], self.run.reader
        whole = [e for e in n.parents if e.node not in streamed]
        state.context, state.notes = reader.read(n, whole)
        kv = all(self.graph.node(p).output == "kv" and not self.graph.node(p).staircase for p in streamed)
        leaky = [e.node for e in n.parents if kv and e.node in streamed and not e.leak
                 and not reader.clean(reader.taint_of(self.graph.node(e.node)), n.role)]
        text = not kv or bool(leaky)
        state.notes += [f"{p}:private" if p in leaky else f"{p}:text" for p in streamed if text]
        prefix = [i.message for i in state.context]
        mode = TEXT if text else SynthesisMode(Placement.SEQUENTIAL)
        return Aggregator(n, streamed, prefix, mode, AnswerSource(self.engine.tokenize(n.prompt)), StaircaseResult())

    def _check_streamed(self) -> None:
        """Every streamed parent decodes in this wave, or is a staircase node of it."""
        here = {n.name for n in self.decode} | {s.node.name for s in self.aggregators}
        missing = [p for s in self.aggregators for p in s.streamed if p not in here]
        if missing:
            raise BraidError(f"staircase: {missing[0]!r} is not decoded in this wave")

    def _start(self, offsets: list[int], headers: list[int]) -> Callable[[int], tuple[BranchSource, int]]:
        """The wave's decode call, started: here, read as it decodes, or on the executor, each call's message
        shipped back in chunks. Returns where a feed reads call c's branch."""
        decode = self.decode
        if self.remote:
            self.stream = self.executor.decode_stream([self.run.node_call(n) for n in decode],
                                                      ship=self.graph.stair.proposer)
            return lambda c: (self.stream.arrivals[c], 0)
        # (readable: the feeds read it as it decodes)
        self.stream = self.engine.decode_stream([self.run.node_call(n) for n in decode], readable=True)
        self.source = WaveSource(self.stream, offsets, headers)
        return lambda c: (self.source, c)

    def _feed(self, branch: Callable[[int], tuple[BranchSource, int]]) -> None:
        """Each staircase node's feed over its streamed parents (a wave call, or another staircase's answer);
        where remote, the arrivals report to the feeds reading them (what came, its end, its failure)."""
        calls = {n.name: c for c, n in enumerate(self.decode)}
        answers = {s.node.name: s.answer for s in self.aggregators}
        for s in self.aggregators:
            s.feed = BranchFeed([], pump=False, branches=[(answers[p], 0) if p in answers else branch(calls[p])
                                                          for p in s.streamed])
            if self.remote:
                for source, _ in s.feed.where:
                    if source in self.stream.arrivals:
                        source.listen(lambda feed=s.feed, source=source: feed.arrived(source))
        self.readers = {name: [s.feed for s in self.aggregators if name in s.streamed] for name in [*calls, *answers]}

    # ---- the threads, and their events merged ----------------------------------------------------------
    def _pump(self) -> None:
        """The wave's decode call: its tokens passed on, and reported to the feeds reading them (remote: the
        arrivals report); once it ends, its outputs held before the feeds learn it did (they read them)."""
        why, error = "its call stopped before the reply finished", None
        try:
            for ev in self.stream:
                name = self.decode[ev.call].name
                for feed in self.readers[name] if not self.remote else ():
                    feed.record(self.source, ev.call, ev.finish_reason is not None)
                self.events.put((name, NodeToken(name, ev.token_id, ev.text, ev.finish_reason)))
                if self.stop.is_set():
                    break
            else:
                self.held.extend(self.engine.hold(self.stream.ids))
        except BaseException as e:  # noqa: BLE001 - re-raised by the consumer
            why, error = f"{type(e).__name__}: {e}", e
        finally:
            self.events.put((None, error))  # (first: its error, not a staircase's view of it, is what fails the run)
            try:
                self.stream.close()
            finally:
                for s in self.aggregators if not self.remote else ():  # (remote: the arrivals report their end)
                    s.feed.end(self.source, why)

    def _aggregate(self, s: Aggregator) -> None:
        """Staircase node s: its events passed on, its answer's tokens reported to the feeds reading it."""
        why, error = "its staircase stopped before the answer finished", None
        try:
            events = self._staircase(s)
            try:
                for ev in events:
                    if isinstance(ev, NodeToken):
                        s.answer.tokens.append(ev.token_id)
                        for feed in self.readers[s.node.name]:
                            feed.record(s.answer, 0, ev.finish_reason is not None)
                    self.events.put((s.node.name, ev))
                    if self.stop.is_set():
                        break
                else:
                    s.answer.ids = s.result.message_ids[-1:]  # (it ended)
            finally:
                events.close()
        except BaseException as e:  # noqa: BLE001 - re-raised by the consumer
            why, error = f"{type(e).__name__}: {e}", e
        for feed in self.readers[s.node.name]:
            feed.end(s.answer, why)
        self.events.put((None, error))

    def _staircase(self, s: Aggregator) -> Iterator[NodeToken | NodeRound]:
        """Staircase node s's run over its feed, its events named by node and by parent."""
        n, feed, prefix, mode, result, streamed = s.node, s.feed, s.prefix, s.mode, s.result, s.streamed
        # (no clock: a parent that is slow is still coming; a failed or cancelled one ends the feed)
        for ev in staircase(self.engine, feed, n.prompt, prefix, self.graph.stair, self.graph.variant, mode,
                            n.sampling, idle_s=None, result=result):
            if isinstance(ev, RoundTaken):
                yield NodeRound(n.name, ev.round, {streamed[b]: r for b, r in ev.chunks.items()})
            else:
                yield NodeToken(n.name, ev.token_id, ev.text, ev.finish_reason)

    def _merge(self) -> Iterator[NodeToken | NodeRound]:
        """The threads started and their events passed on as they come; the first error stops them all, and is
        raised once every thread has ended."""
        error: BaseException | None = None
        for t in self.threads:
            t.start()
            self.pending += 1
        while self.pending:
            name, ev = self.events.get()
            if name is None:  # a thread ended (with its error, or None)
                self.pending -= 1
                if ev is not None and error is None:
                    error = ev
                    self._cancel()
                continue
            if error is not None:
                continue
            if isinstance(ev, NodeToken):
                self.run.states[name].took(ev.text, self.start)
            yield ev
        if error is not None:
            raise error

    # ---- after the threads -----------------------------------------------------------------------------
    def _cancel(self) -> None:
        self.stop.set()
        for s in self.aggregators:
            s.feed.cancel()

    def _stop(self) -> None:
        """Every thread stopped (the consumer left, or one failed) and ended; then what the wave decoded kept:
        each decoding node's output, but none of the staircases' answer messages (only their tokens are kept, for
        encode_outputs)."""
        self._cancel()
        if self.threads[0].is_alive():
            self.stream.interrupt()  # (a pump waiting for its next token sees the call end at the next step)
        elif not self.pending:
            self.stream.close()  # (no pump ever ran: the call still leaves the batch)
        for t in self.threads:
            if t.is_alive():
                t.join()
        try:
            for s in self.aggregators:
                self.engine.discard(s.result.message_ids[-1:])
            for n, mid in zip(self.decode, self.stream.ids or ()):
                if mid in self.engine.store:
                    self.run.store_output(n, mid)
        finally:
            self.engine.release(self.held)

    def _outputs(self) -> Iterator[NodeDone]:
        """The staircase nodes' outputs encoded; then each node's end, the wave's decoding nodes first."""
        for s in self.aggregators:  # (in dependency order: a nested staircase node reads the outputs before it)
            self.run.encode_outputs([s.node], [s.result.answer])
        where = self.stream.replicas if self.remote else [""] * len(self.decode)
        for c, n in enumerate(self.decode):
            self.run.states[n.name].replica = where[c]
            yield self.run.states[n.name].done()
        for s in self.aggregators:
            yield self.run.states[s.node.name].done()
