"""Session messages between replicas: one replica serves a stored message's KV, another fetches it; and a
session's KVComm anchor pools, moving with the session.

A session's messages live in the store of the replica whose call made them. When a later call of the
session reaches another replica (the router sent it elsewhere: a new replica, load, a lost affinity), that
replica fetches the messages it names from their holder over `KVExport.Fetch` and stores them under the
same ids, so the call runs as if it had reached the holder. The chunks are the KV transport's own
(`braid.kv.chunks`): checksummed per chunk, fingerprint-checked, bit-identical on arrival.
"""

import io
import logging
import re
import time
import zlib
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch

from braid.engine import Engine
from braid.engine.errors import BraidError, UnknownMessageError
from braid.kv.chunks import KVAssembler, iter_chunks
from braid.kv.connector import TransferError
from braid.kv.grpc_transport import GRPC_LIMITS
from braid.kv.peer_auth import peer_channel, peer_check
from braid.protos import kv_pb2, kv_pb2_grpc

log = logging.getLogger(__name__)
# what gRPC says of an address where nothing listens any more (a replica that has gone)
_REFUSED = re.compile(r"failed to connect|connection refused|Connection reset|Socket closed", re.IGNORECASE)


class HolderGoneError(TransferError):
    """The replica that held a message refuses connections at the address it announced: it has gone (as
    opposed to a slow one, whose fetch runs out of time, a plain TransferError)."""


@dataclass
class FetchedMessage:
    """A message as its holder stored it: what `Engine.import_message` takes to store it again."""

    message_id: str
    token_ids: list[int]
    kv: torch.Tensor  # [layers, 2, kv_heads, tokens, head_dim], keys rotated to offset..offset+tokens
    offset: int
    fingerprint: str  # the model (and adapter tag) that encoded it
    parents: list[str]
    parent_offsets: list[int]


class KVExporter(kv_pb2_grpc.KVExportServicer):
    """The holding side, one per replica. Called by: other replicas' `fetch` (Fetch over gRPC), for a
    message of a session that one of their calls names. `check(session_id, message_id)` raises
    UnknownMessageError unless the message belongs to that session (the directory decides), so an id alone,
    without its session, reads nothing."""

    def __init__(self, engine: Engine, check: Callable[[str, str], None], host: str = "127.0.0.1", port: int = 0,
                 max_chunk_bytes: int = 1 << 20, anchors: Callable[[str], dict] | None = None,
                 adopt: Callable[[str, str, list[tuple[str, str]], float], tuple[list[str], list[str]]] | None = None):
        """`anchors(session_id)`: the session's KVComm pools as `KVComm.export` gives them, leaving this replica;
        it raises UnknownMessageError (NOT_FOUND) unless the session is open and has anchors here.
        `adopt(holder, holder_address, [(session, message)], deadline)`: take a draining replica's messages over
        (fetched from it; by the monotonic `deadline`), returning the ids taken and the skipped ones ("id: why")."""
        self.engine, self.check, self.max_chunk_bytes, self.anchors = engine, check, max_chunk_bytes, anchors
        self.adopt = adopt
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=GRPC_LIMITS,
                                   interceptors=peer_check(host))
        kv_pb2_grpc.add_KVExportServicer_to_server(self, self._server)
        self.address = f"{host}:{self._server.add_insecure_port(f'{host}:{port}')}"
        self._server.start()

    def stop(self) -> None:
        self._server.stop(0)

    def Fetch(self, request: kv_pb2.FetchRequest, context):
        try:
            self.check(request.session_id, request.message_id)
            msg = self.engine.message(request.message_id)  # NOT_FOUND once freed or evicted here
            kv = msg.kv.read()  # (a copy where it lives in the pool: NOT_FOUND if it went meanwhile)
        except BraidError as e:
            context.abort(grpc.StatusCode[e.code], str(e))
        first = True
        for chunk, _ in iter_chunks(msg.id, msg.fingerprint, kv, self.max_chunk_bytes,
                                    total_tokens=msg.num_tokens, token_ids=msg.token_ids, offset=msg.offset):
            if first:
                chunk.parents.extend(msg.parents)
                chunk.parent_offsets.extend(msg.parent_offsets)
                first = False
            yield chunk


    def Adopt(self, request: kv_pb2.AdoptRequest, context):
        if self.adopt is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this replica takes no messages over")
        remaining = context.time_remaining()
        deadline = time.monotonic() + (remaining if remaining is not None else 60.0)
        adopted, skipped = self.adopt(request.holder, request.holder_address,
                                      [(m.session_id, m.message_id) for m in request.messages], deadline)
        return kv_pb2.AdoptReply(adopted=adopted, skipped=skipped)

    def FetchAnchors(self, request: kv_pb2.FetchAnchorsRequest, context):
        try:
            if self.anchors is None:
                raise UnknownMessageError("this replica keeps no anchors")
            state = self.anchors(request.session_id)
        except BraidError as e:
            context.abort(grpc.StatusCode[e.code], str(e))
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        for start in range(0, len(data), self.max_chunk_bytes):
            piece = data[start:start + self.max_chunk_bytes]
            yield kv_pb2.AnchorsChunk(payload=piece, crc32=zlib.crc32(piece), total_bytes=len(data))


def fetch_anchors(address: str, session_id: str, timeout: float = 60.0) -> dict:
    """The session's anchor pools from the replica at `address`, which lets go of them (`KVComm.adopt` takes
    them). Raises UnknownMessageError if it has none for the session, TransferError if it cannot be reached or
    a chunk arrives corrupt."""
    pieces, total = [], None
    try:
        with peer_channel(address, options=GRPC_LIMITS) as channel:
            stub = kv_pb2_grpc.KVExportStub(channel)
            for chunk in stub.FetchAnchors(kv_pb2.FetchAnchorsRequest(session_id=session_id), timeout=timeout):
                if zlib.crc32(chunk.payload) != chunk.crc32:
                    raise TransferError(f"anchors of session {session_id!r} from {address}: a chunk failed its "
                                        "checksum")
                pieces.append(chunk.payload)
                total = chunk.total_bytes
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            raise UnknownMessageError(f"no anchors of session {session_id!r} at {address} ({e.details()})") from None
        raise TransferError(f"could not fetch the anchors of session {session_id!r} from {address}: "
                            f"{e.code().name}: {e.details()}") from None
    data = b"".join(pieces)
    if total is None or len(data) != total:
        raise TransferError(f"anchors of session {session_id!r} from {address}: {len(data)} of {total} bytes")
    return torch.load(io.BytesIO(data), weights_only=True)  # (plain values and tensors only)


def fetch(address: str, session_id: str, message_id: str, fingerprint: str, timeout: float = 60.0,
          channel: grpc.Channel | None = None) -> FetchedMessage:
    """The message from the replica at `address` (over `channel` when given), checked chunk by chunk. Raises
    UnknownMessageError (NOT_FOUND) if the holder no longer has it, TransferError (UNAVAILABLE) if the holder
    cannot be reached, a BraidError for a corrupt or foreign chunk."""
    if channel is None:
        with peer_channel(address, options=GRPC_LIMITS) as channel:
            return fetch(address, session_id, message_id, fingerprint, timeout, channel)
    assembler = KVAssembler(fingerprint)
    parents: list[str] = []
    parent_offsets: list[int] = []
    try:
        stub = kv_pb2_grpc.KVExportStub(channel)
        for chunk in stub.Fetch(kv_pb2.FetchRequest(session_id=session_id, message_id=message_id), timeout=timeout):
            assembler.add(chunk)
            parents += chunk.parents
            parent_offsets += chunk.parent_offsets
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            raise UnknownMessageError(f"message {message_id!r} is gone from the replica that held it "
                                      f"({e.details()})") from None
        gone = e.code() == grpc.StatusCode.UNAVAILABLE and _REFUSED.search(e.details() or "")
        raise (HolderGoneError if gone else TransferError)(
            f"could not fetch message {message_id!r} from its holder at {address}: {e.code().name}: "
            f"{e.details()}") from None
    if assembler.message_id != message_id:
        raise TransferError(f"fetching {message_id!r} from {address} returned {assembler.message_id!r}")
    return FetchedMessage(message_id, assembler.token_ids(), assembler.tensor(), assembler.offset, fingerprint,
                          parents, parent_offsets)


def fetch_many(channel: grpc.Channel, address: str, session_id: str, message_ids: list[str], fingerprint: str,
               timeout: float = 60.0) -> list[FetchedMessage]:
    """Several messages from the holder at `address` at once, over `channel` (see `fetch`), in the order named."""
    if len(message_ids) < 2:
        return [fetch(address, session_id, mid, fingerprint, timeout, channel) for mid in message_ids]
    with futures.ThreadPoolExecutor(min(8, len(message_ids)), thread_name_prefix="kv-fetch") as pool:
        return list(pool.map(lambda mid: fetch(address, session_id, mid, fingerprint, timeout, channel),
                             message_ids))


def hand_over(address: str, holder: str, holder_address: str, messages: list[tuple[str, str]],
              timeout: float) -> tuple[list[str], list[str]]:
    """Ask the replica at `address` to take over these (session, message) pairs of the draining replica `holder`,
    which serves them at `holder_address` until it goes: it fetches them and holds them from then on. Returns the
    ids it took and those it skipped ("id: why"). Raises TransferError if it cannot be reached in `timeout`."""
    request = kv_pb2.AdoptRequest(holder=holder, holder_address=holder_address,
                                  messages=[kv_pb2.FetchRequest(session_id=s, message_id=m) for s, m in messages])
    try:
        with peer_channel(address, options=GRPC_LIMITS) as channel:
            reply = kv_pb2_grpc.KVExportStub(channel).Adopt(request, timeout=timeout)
    except grpc.RpcError as e:
        raise TransferError(f"replica at {address} could not take {len(messages)} messages over: {e.code().name}: "
                            f"{e.details()}") from None
    return list(reply.adopted), list(reply.skipped)


def reachable(address: str, timeout_s: float = 1.0) -> bool:
    """Whether a replica's KVExport at `address` takes a connection within `timeout_s` (one that has gone refuses
    it, though its address may still be announced)."""
    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()
