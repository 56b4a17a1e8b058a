"""Waves that decode elsewhere: what a DAG run asks of the executor that decodes its plain waves on other replicas
(synthesizer.waves runs them on Worker replicas), and of the stream it reads each wave from."""

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from braid.engine.engine import DecodeCall
from braid.methods.staircase import ArrivingSource


class ArrivingCall(ArrivingSource, Protocol):
    """A wave call's message as it arrives back here, for the staircase nodes that stream it: a BranchFeed source
    that reports itself to `listen`'s listener as its chunks come, when it ends and if it fails."""

    def listen(self, listener: Callable[[], None]) -> None: ...


class WaveStream(Protocol):
    """A wave's decoding calls running elsewhere, read as `Engine.decode_stream`'s stream is: iterate for
    TokenEvents (`call`, `token_id`, `text`, `finish_reason`); `ids` once iteration ends, each call's output
    stored in the run's engine; `close()` from the iterating thread, always; `interrupt()` from any other, to
    end the iteration with an error; `replicas[c]`: where call c ran. Asked to ship as they decode,
    `arrivals[c]` is call c's message as it arrives."""

    ids: list[str] | None
    replicas: list[str]
    arrivals: list[ArrivingCall] | None

    def __iter__(self) -> Iterator: ...

    def close(self) -> None: ...

    def interrupt(self) -> None: ...


class WaveExecutor(Protocol):
    """Where a graph's waves decode, when not on the run's engine: other replicas. Called by DagRun, from the
    run's thread, for each wave's decoding nodes except those that run with the calibration's LoRAs
    (synthesis-shaped nodes and turns of a calibrated graph). The calls' parents are messages of the run's engine.
    With `ship` (chunk sizes in tokens, the last repeating), each call's message also comes back in chunks as it
    decodes, for the staircase nodes that stream the wave."""

    def decode_stream(self, calls: list[DecodeCall], ship: Sequence[int] = ()) -> WaveStream: ...
