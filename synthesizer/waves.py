"""RunGraph's decoding waves on Worker replicas (Ray-free): each wave's calls dealt over worker calls, their
parents lent to the workers for the wave, and their outputs' KV shipped back and stored here.

The replica that runs a graph (the session's Synthesizer replica, the holder) keeps the graph's logic: the
waves, how each node reads its parents, leakage control, re-encoded copies, staircase nodes and calibrated
reading (methods.dag). Only the decoding of plain waves moves: `WorkerWaves` is the run's `WaveExecutor`.
For each wave it deals the decoding calls round-robin over at most `calls` worker calls, which Serve's router
spreads over the Worker replicas. A worker fetches the parents it needs from this replica's KVExport (lent to
the session for the wave only), decodes its calls together, streams their tokens, and ships each output
message (prompt and reply) to this replica's KV receiver, where it is stored as the wave's output. The graph
reads it from here as if it had been decoded here: children on the next wave, the session after the graph.
"""

import logging
import queue
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from braid.engine import DecodeCall, Engine
from braid.engine.errors import BraidError, StoppedError, UnknownMessageError
from braid.engine.scheduler import TokenEvent
from braid.kv.connector import TransferError, Transport, stream_name
from braid.kv.receiver import KVReceiver
from braid.runtime.messages import BranchDone, BranchToken, NodesRequest

log = logging.getLogger(__name__)


class WorkerCall(Protocol):
    """One worker call in flight (a Serve response stream): iterate it for BranchToken and BranchDone from
    one thread; `cancel()` from any thread stops it on the worker."""

    def __iter__(self) -> Iterator[BranchToken | BranchDone]: ...

    def cancel(self) -> None: ...


@dataclass
class WaveWorkers:
    """Where this replica's graph waves decode. Built by the deployment that owns the replica."""

    call: Callable[[NodesRequest], WorkerCall]  # start one worker call
    calls: int  # worker calls per wave at most (the Worker replicas)
    transport: Transport = Transport.GRPC  # how outputs come back: GRPC or COLLECTIVE (SynthesizerConfig checks)
    fetch_timeout_s: float = 60.0  # a worker fetching one parent from here
    wait_timeout_s: float = 120.0  # a started wave going this long without word from its workers
    queue_timeout_s: float = 3600.0  # a wave waiting this long for any worker to start on it

    def __post_init__(self):
        if self.calls < 1:
            raise ValueError(f"calls must be >= 1, got {self.calls}")
        if not (self.fetch_timeout_s > 0 and self.wait_timeout_s > 0 and self.queue_timeout_s > 0):
            raise ValueError("fetch_timeout_s, wait_timeout_s and queue_timeout_s must be positive")


class WorkerWaves:
    """A graph run's WaveExecutor (methods.dag) over Worker replicas, for one session."""

    def __init__(self, engine: Engine, receiver: KVReceiver, export_address: str, workers: WaveWorkers,
                 session: str, lend: Callable[[str, Iterable[str]], AbstractContextManager]):
        self.engine, self.receiver, self.export_address, self.workers = engine, receiver, export_address, workers
        self.session, self.lend = session, lend

    def decode_stream(self, calls: list[DecodeCall], ship: Sequence[int] = ()) -> "WorkerWave":
        return WorkerWave(self, calls, tuple(ship))


class WorkerWave:
    """One wave on the workers, read as a DecodeStream (methods.dag.WaveStream). The worker calls start when it
    is made; iterating yields their tokens as they come (`call` is the index in `calls`) and, once every worker
    call has ended, stores the outputs here (`ids`; held from eviction until `close()`). A failed worker call
    fails the wave (with the worker's own status, or UNAVAILABLE), as does a wave whose workers say nothing for
    `wait_timeout_s` once started (`queue_timeout_s` before). `close()` (always called) stops the others and
    keeps nothing the wave had not finished. With `ship`, the workers ship each call's message in chunks of
    those sizes as it decodes, and `arrivals[c]` reads call c's as it comes (for the staircase nodes streaming
    the wave); the outputs stored are the same."""

    def __init__(self, owner: WorkerWaves, calls: list[DecodeCall], ship: tuple[int, ...] = ()):
        self.owner, self.calls = owner, calls
        self.ids: list[str] | None = None
        self.replicas = [""] * len(calls)
        w = owner.workers
        k = min(w.calls, len(calls))
        self.groups = [list(range(g, len(calls), k)) for g in range(k)]  # worker call g: the wave's calls
        self.name = f"wave-{secrets.token_hex(8)}"
        self._events: queue.Queue = queue.Queue()
        self._done: dict[int, BranchDone] = {}  # wave call -> its worker's receipt
        self._held: list[str] = []  # the outputs stored here, kept from eviction until close()
        self._lent = owner.lend(owner.session, {p for c in calls for p in c.parents})
        self._lent.__enter__()
        self._handles: list[WorkerCall] = []
        self._closed = False
        where = {c: (g, i) for g, members in enumerate(self.groups) for i, c in enumerate(members)}
        self.arrivals = [owner.receiver.watch(self._stream(*where[c])) for c in range(len(calls))] if ship else None
        try:
            for g, members in enumerate(self.groups):
                req = NodesRequest(f"{self.name}:{g}", owner.session, owner.export_address, owner.engine.fingerprint,
                                   [calls[c] for c in members], owner.receiver.address, w.transport,
                                   w.fetch_timeout_s, ship)
                self._handles.append(w.call(req))
            for g, handle in enumerate(self._handles):
                threading.Thread(target=self._pump, args=(g, handle), daemon=True, name="graph-wave").start()
        except BaseException:
            self.close()
            raise

    def _stream(self, g: int, i: int) -> str:
        return stream_name(f"{self.name}:{g}", i)

    def _pump(self, g: int, handle: WorkerCall) -> None:
        error = None
        try:
            for item in handle:
                self._events.put((g, item))
        except BaseException as e:  # noqa: BLE001 - raised by the reader
            error = e
        self._events.put((g, error if error is not None else StopIteration()))

    def __iter__(self) -> Iterator[TokenEvent]:
        pending, started, w = len(self.groups), False, self.owner.workers
        while pending:
            wait = w.wait_timeout_s if started else w.queue_timeout_s
            try:
                g, item = self._events.get(timeout=wait)
            except queue.Empty:
                raise TransferError(f"graph wave {self.name}: no word from its workers for {wait:.0f} s "
                                    f"({'after they started' if started else 'none started'})") from None
            started = True
            if isinstance(item, StopIteration):
                pending -= 1
            elif isinstance(item, BaseException):
                raise self._failed(g, item)
            elif isinstance(item, BranchToken):
                yield TokenEvent(self.groups[g][item.branch], item.token_id, item.text, item.finish_reason or None)
            else:
                c = self.groups[g][item.branch]
                self._done[c] = item
                self.replicas[c] = item.replica
        missing = [c for c in range(len(self.calls)) if c not in self._done]
        if missing:
            raise TransferError(f"graph wave {self.name}: worker calls ended without call {missing[0]}'s output")
        self.ids = self._store()

    def interrupt(self) -> None:
        """From any thread: the iteration ends at once with CANCELLED (`close` still stops the workers)."""
        self._events.put((-1, StoppedError(f"graph wave {self.name} was interrupted")))

    def _failed(self, g: int, error: BaseException) -> BaseException:
        error = getattr(error, "cause", None) or error  # (out of Ray's wrapper)
        if isinstance(error, BraidError):
            return error
        return TransferError(f"graph wave {self.name}: the worker call for calls {self.groups[g]} failed: "
                             f"{type(error).__name__}: {error}")

    def _store(self) -> list[str]:
        """Each output, as its worker shipped it, stored here under a new id (checked as any parent is). The
        receiver checked its KV against what the worker sent; its tokens (which no CRC covers) are checked here
        against those the worker reported."""
        eng, ids = self.owner.engine, []
        try:
            for g, members in enumerate(self.groups):
                for i, c in enumerate(members):
                    got = self.owner.receiver.wait(self._stream(g, i), self.owner.workers.wait_timeout_s)
                    if got.token_ids != self._done[c].token_ids:
                        raise TransferError(f"graph wave {self.name}: call {c}'s output arrived with other tokens "
                                            f"than its worker decoded")
                    call = self.calls[c]
                    ids.append(eng.import_message(got.token_ids, got.kv, got.offset, eng.fingerprint,
                                                  call.parents, call.offsets or ()))
                    self._held += eng.hold(ids[-1:])
        except BaseException:
            for mid in ids:
                try:
                    eng.free(mid, when_unpinned=True)
                except UnknownMessageError:  # (evicted: the error that brought us here is what counts)
                    pass
            raise
        order = [c for members in self.groups for c in members]
        return [ids[order.index(c)] for c in range(len(self.calls))]

    def close(self) -> None:
        """Stop what still runs (the workers free what they took in), drop the outputs not stored, end the loan."""
        if self._closed:
            return
        self._closed = True
        for handle in self._handles:
            try:
                handle.cancel()
            except Exception as e:  # noqa: BLE001 - it may have ended already
                log.debug("cancelling a worker call: %s", e)
        if self.ids is None:
            self.owner.receiver.forget([self._stream(g, i) for g, members in enumerate(self.groups)
                                        for i in range(len(members))])
        self.owner.engine.release(self._held)  # (the graph's run holds what it keeps)
        self._lent.__exit__(None, None, None)

