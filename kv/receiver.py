"""The receiving side of the KV connector: one per synthesizer engine, for every transport.

A gRPC KVTransfer server takes chunk streams from workers (payloads inline, or on a
collective link it sets up on request); a worker in the same process hands messages over
locally. The synthesizer calls `wait` for each branch stream of a workflow, then
`import_message` to store it in its engine.

Time limits count the stream's own work: a stream waits without a clock while its worker
has not started (up to `queue_timeout`), then fails if nothing arrives for `idle_timeout`.
A broken sender connection or an `Abandon` call fails the streams at once.

Integrity is checked here, not by whoever relays the receipts: each chunk against its CRC-32,
and a copied stream as a whole against the digest and byte count its sender put on its last
chunk, so a stream that arrived otherwise fails and never reaches `import_message`.
"""

import logging
import threading
import time
from concurrent import futures
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist

from braid.engine import Engine
from braid.engine.config import DTYPES
from braid.engine.errors import BraidError, FingerprintMismatchError
from braid.kv import local
from braid.kv.chunks import ChunkError, KVAssembler
from braid.kv.collective import CollectiveLink
from braid.kv.connector import ReceivedStream, TransferError, Transport
from braid.kv.grpc_transport import GRPC_LIMITS
from braid.kv.peer_auth import peer_check
from braid.protos import kv_pb2, kv_pb2_grpc

log = logging.getLogger(__name__)
GONE_FOR_S = 3600.0  # how long a given-up stream's id is remembered


class _Stream:
    def __init__(self, fingerprint: str):
        self.assembler = KVAssembler(fingerprint)
        self.lock = threading.Lock()  # (the assembler is read while chunks still arrive: see watch)
        self.listeners: list = []  # called after each chunk, and when the stream completes or fails
        self.done = threading.Event()
        self.error: Exception | None = None
        self.created = time.monotonic()
        self.active: float | None = None  # last sign of work: the open announcement or a chunk
        self.transport = Transport.GRPC  # how it is arriving
        self.local_message = ""
        self.tail_start: float | None = None
        self.tail_bytes = 0
        self.finished: float | None = None

    def fail(self, error: Exception) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()
            self.changed()

    def changed(self) -> None:
        for listener in list(self.listeners):
            listener()


class BranchArrivals:
    """One branch stream read while it arrives (a BranchFeed source that reports itself: methods.staircase's
    ArrivingSource): how many tokens of the branch message can be read, their tokens and KV, and whether it has
    ended or failed."""

    def __init__(self, stream_id: str, stream: _Stream):
        self.stream_id, self._stream = stream_id, stream

    def listen(self, listener) -> None:
        """Call `listener()` now, after each chunk, and when the stream completes or fails (from the thread
        receiving it)."""
        self._stream.listeners.append(listener)
        listener()

    @property
    def offsets(self) -> list[int]:
        return [self._stream.assembler.offset]  # where the message was encoded (set by its first chunk)

    @property
    def length(self) -> int | None:
        """The message's whole length once its last chunk has come (None before)."""
        s = self._stream
        return s.assembler.total_tokens if s.done.is_set() and s.error is None else None

    @property
    def error(self) -> Exception | None:
        return self._stream.error

    def encoded(self, call: int = 0) -> int:
        with self._stream.lock:
            return self._stream.assembler.contiguous

    def partial_kv(self, call: int, start: int, end: int) -> tuple[list[int], torch.Tensor]:
        with self._stream.lock:
            return self._stream.assembler.read(start, end)


def _check_sent(last: kv_pb2.KVChunk, got: KVAssembler) -> None:
    """A stream's last chunk says what its sender put on the stream: what arrived must be that (a chunk changed
    with its CRC-32, lost, repeated or reordered changes the digest)."""
    if got.digest != last.stream_digest or got.bytes_received != last.stream_bytes:
        raise TransferError(f"KV stream {last.stream_id!r} arrived corrupted: digest {got.digest:#010x} over "
                            f"{got.bytes_received} bytes, its sender sent digest {last.stream_digest:#010x} over "
                            f"{last.stream_bytes} bytes")


class _PendingLink:
    def __init__(self):
        self.ready = threading.Event()
        self.link: CollectiveLink | None = None
        self.error: Exception | None = None


class KVReceiver(kv_pb2_grpc.KVTransferServicer):
    """Called by: workers (Push, OpenLink over gRPC; `opened`/`deliver_local` in process), the ingress
    (Abandon, when a workflow is given up) and the synthesizer (`wait`, `import_message`)."""

    def __init__(self, fingerprint: str, host: str = "127.0.0.1", port: int = 0):
        self.fingerprint, self.host = fingerprint, host
        self._streams: dict[str, _Stream] = {}
        # streams given up (abandoned, forgotten, timed out) -> why and when: a late chunk or wait for one finds it
        # failed instead of starting it over, and nothing here keeps its KV; forgotten after GONE_FOR_S
        self._gone: dict[str, tuple[str, float]] = {}
        self._links: dict[str, _PendingLink] = {}
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=GRPC_LIMITS,
                                   interceptors=peer_check(host))
        kv_pb2_grpc.add_KVTransferServicer_to_server(self, self._server)
        self.address = f"{host}:{self._server.add_insecure_port(f'{host}:{port}')}"
        self._server.start()
        local.register(self.address, self)

    def _stream(self, stream_id: str) -> _Stream:
        with self._lock:
            gone = self._gone.get(stream_id)
            if gone is not None:  # (a failed stream of its own, with a fresh error: not kept)
                stream = _Stream(self.fingerprint)
                stream.error, stream.active = TransferError(gone[0]), time.monotonic()
                stream.done.set()
                return stream
            return self._streams.setdefault(stream_id, _Stream(self.fingerprint))

    def _give_up(self, stream_ids, reason: str) -> None:
        """Fail these streams (whoever waits on one sees `reason`) and drop them, remembering why for a while."""
        now = time.monotonic()
        with self._lock:
            for sid, (_, when) in list(self._gone.items()):
                if now - when > GONE_FOR_S:
                    del self._gone[sid]
            dropped = [self._streams.pop(sid, None) for sid in stream_ids]
            for sid in stream_ids:
                self._gone[sid] = (reason, now)
        for stream in dropped:
            if stream is not None:
                stream.fail(TransferError(reason))

    # ---- the receiving side's API ----------------------------------------------------------------
    def opened(self, stream_id: str) -> None:
        """A sender started working on the stream (or made progress): its idle clock restarts."""
        self._stream(stream_id).active = time.monotonic()

    def deliver_local(self, stream_id: str, message_id: str, fingerprint: str) -> None:
        """A worker on this engine finished the branch: the message is in the shared store."""
        stream = self._stream(stream_id)
        if fingerprint != self.fingerprint:
            stream.fail(FingerprintMismatchError(f"stream {stream_id!r} was encoded by model {fingerprint}, this "
                                                 f"engine runs {self.fingerprint}"))
            return
        stream.transport, stream.local_message = Transport.LOCAL, message_id
        stream.finished = stream.active = time.monotonic()
        stream.done.set()

    def watch(self, stream_id: str) -> "BranchArrivals":
        """The stream's branch as it arrives, for a staircase reading it before it is complete. `wait` still
        ends the stream once the reader is done with it (or `forget`, if it gives up)."""
        return BranchArrivals(stream_id, self._stream(stream_id))

    def forget(self, stream_ids) -> None:
        """Drop these streams and whatever KV they hold (a reader that gave up on them)."""
        self._give_up(list(stream_ids), "its reader gave up on this KV stream")

    def abandon(self, stream_ids, reason: str) -> None:
        for sid in stream_ids:
            self._give_up([sid], f"KV stream {sid!r} abandoned: {reason}")

    def wait(self, stream_id: str, idle_timeout: float, queue_timeout: float = 3600.0) -> ReceivedStream:
        """Block until the stream's message is complete; raises TransferError on error or timeout, or if it
        arrived unlike what its sender sent (the digests differ)."""
        stream = self._stream(stream_id)
        late = None  # why it timed out
        try:
            while not stream.done.is_set():
                now = time.monotonic()
                if stream.active is None and now - stream.created > queue_timeout:
                    late = f"no worker started on KV stream {stream_id!r} within {queue_timeout:.0f} s"
                elif stream.active is not None and now - stream.active > idle_timeout:
                    late = (f"KV for {stream_id!r} stopped arriving: nothing for {idle_timeout:.0f} s "
                            f"({stream.assembler.tokens_received} tokens received)")
                if late:
                    break
                stream.done.wait(min(1.0, idle_timeout, queue_timeout))
        finally:
            with self._lock:  # forget the stream either way: an abandoned one must not keep its KV here
                self._streams.pop(stream_id, None)
                if late:  # (given up: a late chunk must not start it over)
                    self._gone[stream_id] = (late, time.monotonic())
        if late:
            raise TransferError(late)
        if stream.error is not None:
            raise stream.error
        a = stream.assembler
        if stream.transport is Transport.LOCAL:
            return ReceivedStream(stream_id, stream.local_message, [], None, 0, 0, 0, Transport.LOCAL)
        return ReceivedStream(stream_id, a.message_id, a.token_ids(), a.tensor(), a.offset, a.bytes_received,
                              a.digest, stream.transport, stream.tail_bytes, stream.finished - stream.tail_start)

    def import_message(self, engine: Engine, got: ReceivedStream) -> str:
        """Store a received branch in `engine` (checked like any parent); a local one is already there."""
        if got.kv is None:
            engine.message(got.message_id)  # NOT_FOUND if it was freed meanwhile
            return got.message_id
        # (encoded on a worker after its task and prompt, which this replica's record of it does not hold)
        return engine.import_message(got.token_ids, got.kv, got.offset, self.fingerprint,
                                     unrecorded="the worker's context it was decoded after (a shipped branch)")

    def stop(self) -> None:
        local.unregister(self.address)
        self._server.stop(0)

    # ---- gRPC ------------------------------------------------------------------------------------
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

    def CloseLink(self, request, context):
        self._drop_links({request.link_id})
        return kv_pb2.PushAck()

    def Abandon(self, request, context):
        self.abandon(list(request.stream_ids), request.reason or "the workflow was given up")
        return kv_pb2.PushAck()

    def Push(self, request_iterator, context):
        touched: dict[str, _Stream] = {}
        links: set[str] = set()  # the collective links this call's payloads came on
        chunks = 0
        try:
            for chunk in request_iterator:
                if chunk.link_id:  # (open chunks name it too, so a call that fails before any payload drops it)
                    links.add(chunk.link_id)
                stream = touched.setdefault(chunk.stream_id, self._stream(chunk.stream_id))
                if stream.error is not None:  # given up here (abandoned, or its reader left): stop sending
                    raise stream.error
                stream.active = time.monotonic()
                if chunk.open:
                    continue
                piece = self._link(chunk.link_id).recv(chunk.shape, DTYPES[chunk.dtype]) if chunk.link_id else None
                stream.transport = Transport.COLLECTIVE if chunk.link_id else Transport.GRPC
                with stream.lock:
                    stream.assembler.add(chunk, piece)
                if chunk.HasField("stream_digest"):  # (its last chunk: before the stream can be complete)
                    _check_sent(chunk, stream.assembler)
                chunks += 1
                if chunk.total_tokens:
                    stream.tail_start = stream.tail_start or time.perf_counter()
                    stream.tail_bytes += len(chunk.data) if piece is None else piece.numel() * piece.element_size()
                if stream.assembler.complete and not stream.done.is_set():
                    stream.finished = time.perf_counter()
                    stream.done.set()
                stream.changed()
            incomplete = [sid for sid, s in touched.items() if not s.done.is_set()]
            if incomplete:
                raise ChunkError(f"KV stream ended with {', '.join(map(repr, incomplete))} incomplete")
            return kv_pb2.PushAck(bytes=sum(s.assembler.bytes_received for s in touched.values()), chunks=chunks)
        except BraidError as e:
            for s in touched.values():
                s.fail(e)
            self._drop_links(links)
            context.abort(grpc.StatusCode[e.code], str(e))
        except Exception as e:  # noqa: BLE001 - the sender went away (its process died, it cancelled)
            for s in touched.values():
                s.fail(TransferError(f"the worker's KV stream broke: {type(e).__name__}: {e}"))
            self._drop_links(links)
            raise

    def _drop_links(self, link_ids: set[str]) -> None:
        """Links their sender has let go of: a failed call's (it may be mid-payload), or ones it closed."""
        with self._lock:
            for link_id in link_ids:
                self._links.pop(link_id, None)
