"""Shipping KV between engines over gRPC streams (works across nodes; chunked under size limits).

The synthesizer runs a KVReceiver; each worker opens one client stream per branch
and pushes chunks as its branch decodes, so when the branch ends its KV is already
there. Integrity and fingerprints are checked by KVAssembler as chunks arrive.
"""

import logging
import queue
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch

from cluster.kv_chunks import ChunkError, KVAssembler, iter_chunks
from engine.errors import BraidError
from protos import kv_pb2, kv_pb2_grpc

log = logging.getLogger(__name__)
GRPC_LIMITS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


class TransferError(BraidError):
    code = "UNAVAILABLE"


@dataclass
class ReceivedMessage:
    message_id: str
    token_ids: list[int]
    kv: torch.Tensor
    offset: int
    bytes: int
    tail_bytes: int  # the final burst, sent once the message was complete (it carries total_tokens)
    tail_seconds: float  # from the final burst's first chunk to its last: what shipping adds after decode

    @property
    def link_bytes_per_s(self) -> float | None:
        """Measured on the final burst only; earlier chunks are paced by decoding, not by the link."""
        return self.tail_bytes / self.tail_seconds if self.tail_seconds > 0 else None


class _Stream:
    def __init__(self, fingerprint: str):
        self.assembler = KVAssembler(fingerprint)
        self.done = threading.Event()
        self.error: Exception | None = None
        self.tail_start: float | None = None
        self.tail_bytes = 0
        self.finished: float | None = None


class KVReceiver(kv_pb2_grpc.KVTransferServicer):
    def __init__(self, fingerprint: str, host: str = "127.0.0.1", port: int = 0):
        self.fingerprint = fingerprint
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=GRPC_LIMITS)
        kv_pb2_grpc.add_KVTransferServicer_to_server(self, self._server)
        self.address = f"{host}:{self._server.add_insecure_port(f'{host}:{port}')}"
        self._server.start()

    def _stream(self, stream_id: str) -> _Stream:
        with self._lock:
            return self._streams.setdefault(stream_id, _Stream(self.fingerprint))

    def Push(self, request_iterator, context):
        stream, chunks = None, 0
        try:
            for chunk in request_iterator:
                stream = stream or self._stream(chunk.stream_id)
                stream.assembler.add(chunk)
                if chunk.total_tokens:
                    stream.tail_start = stream.tail_start or time.perf_counter()
                    stream.tail_bytes += len(chunk.data)
                chunks += 1
            if stream is not None and stream.assembler.complete:
                stream.finished = time.perf_counter()
                stream.done.set()
            elif stream is not None:
                raise ChunkError(f"KV stream {stream.assembler.message_id!r} ended incomplete")
            return kv_pb2.PushAck(bytes=stream.assembler.bytes_received if stream else 0, chunks=chunks)
        except BraidError as e:
            if stream is not None:
                stream.error = e
                stream.done.set()
            context.abort(grpc.StatusCode[e.code], str(e))

    def wait(self, stream_id: str, timeout: float) -> ReceivedMessage:
        """Block until the stream's message is complete; raises TransferError on error or timeout."""
        stream = self._stream(stream_id)
        if not stream.done.wait(timeout):
            raise TransferError(f"KV for {stream_id!r} did not arrive within {timeout:.0f} s "
                                f"({stream.assembler.tokens_received} tokens received)")
        with self._lock:
            self._streams.pop(stream_id, None)
        if stream.error is not None:
            raise stream.error
        a = stream.assembler
        return ReceivedMessage(a.message_id, a.token_ids(), a.tensor(), a.offset, a.bytes_received,
                               stream.tail_bytes, stream.finished - stream.tail_start)

    def stop(self) -> None:
        self._server.stop(0)


class KVSender:
    """One client stream to a KVReceiver; send() never blocks on the network."""

    def __init__(self, address: str, stream_id: str, message_id: str, fingerprint: str, offset: int,
                 max_chunk_bytes: int = 1 << 20):
        self.stream_id, self.message_id, self.fingerprint = stream_id, message_id, fingerprint
        self.offset, self.max_chunk_bytes = offset, max_chunk_bytes
        self.bytes = 0
        self._queue: queue.Queue = queue.Queue()
        self._channel = grpc.insecure_channel(address, options=GRPC_LIMITS)
        self._future = kv_pb2_grpc.KVTransferStub(self._channel).Push.future(iter(self._queue.get, None))

    def send(self, token_ids: list[int], kv: torch.Tensor, token_start: int, total_tokens: int = 0) -> None:
        for chunk in iter_chunks(self.message_id, self.fingerprint, kv, self.max_chunk_bytes, token_start,
                                 total_tokens, token_ids, self.offset, self.stream_id):
            self.bytes += len(chunk.data)
            self._queue.put(chunk)

    def abort(self) -> None:
        """Give up on the stream (the sending side failed); the receiver sees it end incomplete."""
        self._future.cancel()
        self._channel.close()

    def close(self, timeout: float = 60) -> kv_pb2.PushAck:
        self._queue.put(None)
        try:
            return self._future.result(timeout=timeout)
        except grpc.RpcError as e:
            raise TransferError(f"KV push of {self.stream_id!r} failed: {e.code().name}: {e.details()}") from None
        finally:
            self._channel.close()
