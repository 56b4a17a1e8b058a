"""The KV connector: how a branch's KV gets from a worker's engine to the synthesizer's, split by side.

One sending side per worker call (`KVSender`), one receiving side per synthesizer engine
(`KVReceiver` in braid.kv.receiver). What crosses is typed: a `BranchChunk` goes in, a
`SentStream` comes back to the worker, a `ReceivedStream` comes out at the synthesizer.
Implementations of the sending side: gRPC (payload inline), collective (payload on an
NCCL/gloo link, header on gRPC) and local (same process: the message changes hands, no copy).

Integrity: every chunk carries the CRC-32 of its bytes, checked once where it is received;
a stream's digest is the CRC-32 of its chunks' CRC-32s in sending order. The sending side
puts its digest and byte count on a stream's last chunk and the receiving side checks what
arrived against them, without touching the tensors again (the local hand-over copies
nothing, so it has nothing to check).
"""

import enum
import struct
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from braid.engine.errors import BraidError
from braid.protos import agent_pb2 as pb


class _Transport(enum.IntEnum):
    """The behaviour of `Transport` (an enum may only be extended while it has no members)."""

    def __str__(self) -> str:  # the word configs, flags, metrics' tags and logs use: "grpc"
        return self.name.lower()

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    @property
    def ships(self) -> bool:
        """KV moves to the synthesizer (every transport but text, which re-prefills the branches' text there)."""
        return self.name != "TEXT"

    @property
    def remote(self) -> bool:
        """KV is copied to another replica's engine (over gRPC, or a collective link), not handed over in place."""
        return self.name in ("GRPC", "COLLECTIVE")

    @classmethod
    def named(cls, word: str) -> "Transport":
        """The transport a config or flag names ("grpc"); ValueError naming the choices."""
        found = next((t for t in cls if str(t) == word), None)
        if found is None:
            raise ValueError(f"transport {word!r} is not one of {', '.join(map(str, cls))}")
        return found


# How a workflow's branches reach the synthesizer: one member per value of the API's Transport enum
# (protos/agent.proto), the one list of them, less TRANSPORT_UNSPECIFIED (there, the cluster decides: None here).
# A member's value is the proto's number, so it goes into a message as it is; str() gives its word ("grpc").
# Decided once per request at the ingress (braid.api.decision) and carried as this type to the workers and the
# receiver.
Transport = _Transport("Transport", {name.removeprefix("TRANSPORT_"): number for name, number in pb.Transport.items()
                                     if number != pb.TRANSPORT_UNSPECIFIED}, module=__name__, qualname="Transport")


class TransferError(BraidError):
    code = "UNAVAILABLE"


class ReceiverLostError(TransferError):
    """The receiving side (a synthesizer's KVReceiver) could not be reached, or went away mid-stream: raised by
    a sender, so that the workflow's driver can say that its synthesizer was lost, not its worker."""


def stream_name(workflow: str, branch: int) -> str:
    """The one name of a workflow branch's KV stream, on both sides."""
    return f"{workflow}:{branch}"


def chain_digest(digest: int, chunk_crc32: int) -> int:
    """A stream's digest after one more chunk (start from 0)."""
    return zlib.crc32(struct.pack("<I", chunk_crc32), digest)


@dataclass
class BranchChunk:
    """Tokens [token_start, token_start + len(token_ids)) of a branch message and their KV."""

    stream_id: str
    message_id: str
    offset: int  # the message's first position, where it was encoded
    token_start: int
    token_ids: list[int]
    kv: torch.Tensor | None  # [L, 2, H, T, D]; must not change after send() (pass a copy); None: local hand-over
    total_tokens: int = 0  # the message's length on its last chunk; 0 while it still decodes
    local_message: str = ""  # local transport: the message id in the shared engine (kv may then be empty)


@dataclass
class SentStream:
    """What the sending side put on one stream, returned by finish()."""

    stream_id: str
    bytes: int = 0
    chunks: int = 0
    digest: int = 0


@dataclass
class ReceivedStream:
    """One complete branch message at the receiving side."""

    stream_id: str
    message_id: str
    token_ids: list[int]
    kv: torch.Tensor | None  # None when it arrived locally: the message is already in the engine
    offset: int
    bytes: int
    digest: int  # of the chunks that arrived; the receiver checked it against the sender's
    transport: Transport  # how it came: GRPC, COLLECTIVE or LOCAL
    tail_bytes: int = 0  # the final burst, sent once the message was complete
    tail_seconds: float = 0.0  # from the final burst's first chunk to its last: what shipping adds after decode

    @property
    def link_bytes_per_s(self) -> float | None:
        """Measured on the final burst only; earlier chunks are paced by decoding, not by the link."""
        return self.tail_bytes / self.tail_seconds if self.tail_seconds > 0 and self.kv is not None else None


class KVSender(ABC):
    """The sending side: one per worker call, carrying every branch of that call.

    Called by the worker's branch loop (braid.workers.runner), in this order: `open` once the
    worker holds its engine (the receiver's wait clock starts then, not while the call queues),
    `send` as each staircase chunk is encoded, `finish` after every branch's last chunk, or
    `abort` when the call fails midway.
    """

    transport: Transport
    copies = True  # False for the local hand-over: partial chunks are not gathered, only the finished message

    @abstractmethod
    def open(self, stream_ids: list[str]) -> None:
        """Announce the streams this call will send."""

    @abstractmethod
    def send(self, chunk: BranchChunk) -> None:
        """Queue a chunk; returns at once (serialising and checksumming happen off the decode loop)."""

    @abstractmethod
    def finish(self) -> dict[str, SentStream]:
        """Wait until the receiver has everything; raises TransferError if it refused any of it."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Give up; the receiver fails the streams this sender announced."""
