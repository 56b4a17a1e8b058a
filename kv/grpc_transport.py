"""Shipping KV between engines: chunk headers over gRPC streams, payloads inline or on a collective link.

The synthesizer runs a KVReceiver. A worker call opens one KVSender to it and pushes every
branch's chunks as the branches decode, so when a branch ends its KV is already there.
- gRPC: payloads ride in the chunks (works across nodes; chunked under message size limits).
- collective: a two-rank torch.distributed group per (worker, synthesizer) pair (NCCL on GPUs,
  gloo on CPU) carries the payloads; headers still go over the one gRPC stream, so the
  receiver posts its receives in exactly the order the sender sends.
Integrity (CRC-32) and fingerprints are checked by KVAssembler as chunks arrive.
"""

import logging
import queue
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist

from braid.kv.chunks import ChunkError, KVAssembler, iter_chunks
from braid.engine.config import DTYPES
from braid.engine.errors import BraidError
from braid.protos import kv_pb2, kv_pb2_grpc

log = logging.getLogger(__name__)
GRPC_LIMITS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


class TransferError(BraidError):
    code = "UNAVAILABLE"


def collective_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


class CollectiveLink:
    """Two ranks (receiver 0, sender 1) over a TCPStore; payloads arrive in the order they are sent."""

    def __init__(self, store: dist.TCPStore, rank: int, backend: str, timeout_s: float = 60):
        timeout = timedelta(seconds=timeout_s)
        if backend == "nccl":
            self.pg, self.device = dist.ProcessGroupNCCL(store, rank, 2, timeout=timeout), torch.device("cuda")
        elif backend == "gloo":
            self.pg, self.device = dist.ProcessGroupGloo(store, rank, 2, timeout), torch.device("cpu")
        else:
            raise ValueError(f"collective backend {backend!r} is not nccl or gloo")
        self.store, self.peer, self.backend = store, 1 - rank, backend

    @classmethod
    def connect(cls, host: str, port: int, backend: str) -> "CollectiveLink":
        """The sender's side, once the receiver has answered OpenLink."""
        return cls(dist.TCPStore(host, port, 2, is_master=False, timeout=timedelta(seconds=60)), 1, backend)

    def send(self, piece: torch.Tensor) -> None:
        self.pg.send([piece.to(self.device).contiguous()], self.peer, 0).wait()

    def recv(self, shape, dtype: torch.dtype) -> torch.Tensor:
        piece = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        self.pg.recv([piece], self.peer, 0).wait()
        return piece


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


class _PendingLink:
    def __init__(self):
        self.ready = threading.Event()
        self.link: CollectiveLink | None = None
        self.error: Exception | None = None


class KVReceiver(kv_pb2_grpc.KVTransferServicer):
    def __init__(self, fingerprint: str, host: str = "127.0.0.1", port: int = 0):
        self.fingerprint, self.host = fingerprint, host
        self._streams: dict[str, _Stream] = {}
        self._links: dict[str, _PendingLink] = {}
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=GRPC_LIMITS)
        kv_pb2_grpc.add_KVTransferServicer_to_server(self, self._server)
        self.address = f"{host}:{self._server.add_insecure_port(f'{host}:{port}')}"
        self._server.start()

    def _stream(self, stream_id: str) -> _Stream:
        with self._lock:
            return self._streams.setdefault(stream_id, _Stream(self.fingerprint))

    def OpenLink(self, request, context):
        store = dist.TCPStore(self.host, 0, 2, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
        pending = _PendingLink()

        def join():  # blocks until the sender's rank joins
            try:
                pending.link = CollectiveLink(store, 0, request.backend)
            except Exception as e:  # noqa: BLE001 - reported to whoever waits on the link
                pending.error = e
            pending.ready.set()

        with self._lock:
            self._links[request.link_id] = pending
        threading.Thread(target=join, daemon=True, name=f"link-{request.link_id}").start()
        return kv_pb2.LinkInfo(host=self.host, port=store.port)

    def _link(self, link_id: str) -> CollectiveLink:
        pending = self._links.get(link_id)
        if pending is None:
            raise ChunkError(f"KV chunk names collective link {link_id!r}, which was never opened")
        if not pending.ready.wait(60) or pending.error is not None:
            raise TransferError(f"collective link {link_id!r} did not come up: {pending.error or 'timeout'}")
        return pending.link

    def Push(self, request_iterator, context):
        touched: dict[str, _Stream] = {}
        chunks = 0
        try:
            for chunk in request_iterator:
                stream = touched.setdefault(chunk.stream_id, self._stream(chunk.stream_id))
                piece = self._link(chunk.link_id).recv(chunk.shape, DTYPES[chunk.dtype]) if chunk.link_id else None
                stream.assembler.add(chunk, piece)
                chunks += 1
                if chunk.total_tokens:
                    stream.tail_start = stream.tail_start or time.perf_counter()
                    stream.tail_bytes += len(chunk.data) if piece is None else piece.numel() * piece.element_size()
                if stream.assembler.complete and not stream.done.is_set():
                    stream.finished = time.perf_counter()
                    stream.done.set()
            incomplete = [sid for sid, s in touched.items() if not s.done.is_set()]
            if incomplete:
                raise ChunkError(f"KV stream ended with {', '.join(map(repr, incomplete))} incomplete")
            return kv_pb2.PushAck(bytes=sum(s.assembler.bytes_received for s in touched.values()), chunks=chunks)
        except BraidError as e:
            for s in touched.values():
                if not s.done.is_set():
                    s.error = e
                    s.done.set()
            context.abort(grpc.StatusCode[e.code], str(e))

    def wait(self, stream_id: str, timeout: float) -> ReceivedMessage:
        """Block until the stream's message is complete; raises TransferError on error or timeout."""
        stream = self._stream(stream_id)
        arrived = stream.done.wait(timeout)
        with self._lock:  # forget the stream either way: an abandoned one must not keep its KV here
            self._streams.pop(stream_id, None)
        if not arrived:
            raise TransferError(f"KV for {stream_id!r} did not arrive within {timeout:.0f} s "
                                f"({stream.assembler.tokens_received} tokens received)")
        if stream.error is not None:
            raise stream.error
        a = stream.assembler
        return ReceivedMessage(a.message_id, a.token_ids(), a.tensor(), a.offset, a.bytes_received,
                               stream.tail_bytes, stream.finished - stream.tail_start)

    def stop(self) -> None:
        self._server.stop(0)


def open_link(address: str, link_id: str, backend: str) -> CollectiveLink:
    """Ask a KVReceiver for a collective link and join it as the sender."""
    with grpc.insecure_channel(address) as channel:
        info = kv_pb2_grpc.KVTransferStub(channel).OpenLink(kv_pb2.LinkRequest(link_id=link_id, backend=backend),
                                                            timeout=60)
    return CollectiveLink.connect(info.host, info.port, backend)


class KVSender:
    """One gRPC stream to a KVReceiver carrying any number of messages.

    send() only queues the tensor: serialising, checksumming and (with a link) the collective
    sends happen on a background thread, in one order, off the caller's decode loop.
    """

    def __init__(self, address: str, fingerprint: str, max_chunk_bytes: int = 1 << 20,
                 link: CollectiveLink | None = None, link_id: str = ""):
        self.fingerprint, self.max_chunk_bytes = fingerprint, max_chunk_bytes
        self.link, self.link_id = link, link_id
        self.bytes = 0
        self._queue: queue.Queue = queue.Queue()  # chunks, as the gRPC stream consumes them
        self._channel = grpc.insecure_channel(address, options=GRPC_LIMITS)
        self._future = kv_pb2_grpc.KVTransferStub(self._channel).Push.future(iter(self._queue.get, None))
        self._work: queue.Queue = queue.Queue()  # send() arguments, in order
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._pump, daemon=True, name="kv-sender")
        self._thread.start()

    def _pump(self):
        try:
            for args in iter(self._work.get, None):
                for chunk, piece in iter_chunks(*args):
                    self._queue.put(chunk)
                    if self.link is not None:
                        self.link.send(piece)
        except Exception as e:  # noqa: BLE001 - surfaced by close()
            self._error = e

    def send(self, stream_id: str, message_id: str, offset: int, token_ids: list[int], kv: torch.Tensor,
             token_start: int, total_tokens: int = 0) -> None:
        """Queue tokens [token_start, ...) of a message; kv must not change afterwards (pass a copy)."""
        self.bytes += kv.numel() * kv.element_size()
        self._work.put((message_id, self.fingerprint, kv, self.max_chunk_bytes, token_start, total_tokens,
                        token_ids, offset, stream_id, self.link_id))

    def abort(self) -> None:
        """Give up (the sending side failed); the receiver sees its streams end incomplete."""
        self._work.put(None)
        self._future.cancel()
        self._channel.close()

    def close(self, timeout: float = 120) -> kv_pb2.PushAck:
        self._work.put(None)
        self._thread.join(timeout)
        self._queue.put(None)
        try:
            if self._error is not None:
                raise TransferError(f"KV send failed: {type(self._error).__name__}: {self._error}")
            return self._future.result(timeout=timeout)
        except grpc.RpcError as e:
            raise TransferError(f"KV push failed: {e.code().name}: {e.details()}") from None
        finally:
            self._channel.close()
