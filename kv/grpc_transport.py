"""The gRPC sending side: one Push stream per worker call, payloads inline in the chunks."""

import logging
import queue
import threading

import grpc

from braid.kv.chunks import iter_chunks
from braid.kv.connector import (
    BranchChunk,
    KVSender,
    ReceiverLostError,
    SentStream,
    TransferError,
    Transport,
    chain_digest,
)
from braid.kv.peer_auth import peer_channel
from braid.protos import kv_pb2, kv_pb2_grpc

log = logging.getLogger(__name__)
GRPC_LIMITS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


class GrpcSender(KVSender):
    """One gRPC stream to a KVReceiver carrying any number of branch streams.

    send() only queues the tensor: serialising, checksumming and (for the collective subclass)
    the tensor sends happen on a background thread, in one order, off the caller's decode loop.
    A stream's last chunk (of the BranchChunk that carries its total) also carries the stream's
    digest and byte count as sent, so the receiver checks the whole stream itself.
    """

    transport = Transport.GRPC

    def __init__(self, address: str, fingerprint: str, max_chunk_bytes: int = 1 << 20):
        self.fingerprint, self.max_chunk_bytes = fingerprint, max_chunk_bytes
        self.link_id = ""
        self.sent: dict[str, SentStream] = {}
        self._queue: queue.Queue = queue.Queue()  # chunks, as the gRPC stream consumes them
        self._channel = peer_channel(address, options=GRPC_LIMITS)
        self._future = kv_pb2_grpc.KVTransferStub(self._channel).Push.future(iter(self._queue.get, None))
        self._work: queue.Queue = queue.Queue()  # open/send arguments, in order
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._pump, daemon=True, name="kv-sender")
        self._thread.start()

    def _send_piece(self, piece) -> None:
        """Payloads ride in the chunk itself; the collective sender overrides this."""

    def _pump(self):
        try:
            for item in iter(self._work.get, None):
                if isinstance(item, str):
                    self._queue.put(kv_pb2.KVChunk(stream_id=item, fingerprint=self.fingerprint, open=True,
                                                   link_id=self.link_id))
                    continue
                c: BranchChunk = item
                stats = self.sent.setdefault(c.stream_id, SentStream(c.stream_id))
                end = c.token_start + c.kv.shape[3]
                for chunk, piece in iter_chunks(c.message_id, self.fingerprint, c.kv, self.max_chunk_bytes,
                                                c.token_start, c.total_tokens, c.token_ids, c.offset, c.stream_id,
                                                self.link_id):
                    stats.chunks += 1
                    stats.bytes += piece.numel() * piece.element_size()
                    stats.digest = chain_digest(stats.digest, chunk.crc32)
                    # the stream's last chunk (the closing BranchChunk's last tokens and layers) closes it: the
                    # receiver checks what arrived against these
                    if c.total_tokens and chunk.token_end == end and chunk.layer_end == chunk.total_layers:
                        chunk.stream_digest, chunk.stream_bytes = stats.digest, stats.bytes
                    self._queue.put(chunk)
                    self._send_piece(piece)
        except Exception as e:  # noqa: BLE001 - surfaced by finish()
            self._error = e

    def open(self, stream_ids: list[str]) -> None:
        for sid in stream_ids:
            self._work.put(sid)

    def send(self, chunk: BranchChunk) -> None:
        self._work.put(chunk)

    def abort(self, reason: str) -> None:
        log.info("KV sender aborted: %s", reason)
        self._work.put(None)
        self._future.cancel()
        self._channel.close()

    def finish(self, timeout: float = 120) -> dict[str, SentStream]:
        self._work.put(None)
        self._thread.join(timeout)
        self._queue.put(None)
        try:
            if self._thread.is_alive():  # (still sending: its link, if any, may be mid-payload)
                raise TransferError(f"KV send did not finish within {timeout:.0f} s")
            if isinstance(self._error, grpc.RpcError):
                raise self._error
            if self._error is not None:
                raise TransferError(f"KV send failed: {type(self._error).__name__}: {self._error}")
            self._future.result(timeout=timeout)
            return self.sent
        except grpc.RpcError as e:
            lost = e.code() == grpc.StatusCode.UNAVAILABLE  # (CANCELLED: the receiver gave the stream up itself)
            raise (ReceiverLostError if lost else TransferError)(
                f"KV push to the receiver failed: {e.code().name}: {e.details()}") from None
        finally:
            self._channel.close()


def abandon(address: str, stream_ids: list[str], reason: str, timeout: float = 10) -> None:
    """Tell a KVReceiver to stop waiting for these streams (best effort: logged if it cannot be reached)."""
    try:
        with peer_channel(address) as channel:
            kv_pb2_grpc.KVTransferStub(channel).Abandon(kv_pb2.AbandonRequest(stream_ids=stream_ids, reason=reason),
                                                       timeout=timeout)
    except grpc.RpcError as e:
        log.warning("could not abandon KV streams at %s: %s", address, e.code().name)
