"""The worker role over one engine (Ray-free): decode a group of branches and ship their KV as they grow; or
decode a RunGraph wave's calls for the replica running the graph, and ship their outputs back to it."""

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, replace

import grpc

from braid.engine import Engine
from braid.engine.errors import BraidError, UnknownMessageError
from braid.kv import local
from braid.kv.collective import CollectiveLink, CollectiveSender, close_link, collective_backend, open_link
from braid.kv.connector import BranchChunk, KVSender, Transport, stream_name
from braid.kv.export import fetch_many
from braid.kv.grpc_transport import GRPC_LIMITS, GrpcSender
from braid.kv.peer_auth import peer_channel
from braid.methods.fanout import fan_out
from braid.models.chat import WORKER_HEADER
from braid.runtime.messages import BranchDone, BranchRequest, BranchToken, NodesRequest

log = logging.getLogger(__name__)


@dataclass
class WorkerConfig:
    header: str = WORKER_HEADER  # opens each worker's answer (the reference model's chat role)
    kv_chunk_bytes: int = 1 << 20  # under gRPC's 4 MiB default message limit
    kv_schedule: tuple[int, ...] = (8, 128, 256)  # staircase: ship after 8 tokens, then every 128, then 256

    def __post_init__(self):
        if not self.header:
            raise ValueError("worker header must be non-empty")
        if self.kv_chunk_bytes < 1:
            raise ValueError(f"kv_chunk_bytes must be >= 1, got {self.kv_chunk_bytes}")
        if not self.kv_schedule or any(s < 1 for s in self.kv_schedule):
            raise ValueError(f"kv_schedule must be positive token counts, got {self.kv_schedule}")

    def ship_after(self, shipped_chunks: int) -> int:
        """Tokens to accumulate before the next KV chunk (the last step repeats)."""
        return ship_after(self.kv_schedule, shipped_chunks)


def ship_after(schedule: tuple[int, ...], shipped_chunks: int) -> int:
    """Tokens to accumulate before a stream's next KV chunk, by `schedule` (its last step repeats)."""
    return schedule[min(shipped_chunks, len(schedule) - 1)]


class BranchRunner:
    """Runs BranchRequests on `engine`; the Worker deployment (and a colocated Synthesizer) host one."""

    COPIES = 256  # graph parents kept here after their wave (the holder's message -> the copy here), at most
    IDLE_LINKS = 4  # collective links kept idle per receiver, at most (more are closed: each is a process group)
    CHANNELS = 16  # channels to holders' KVExport kept, at most: the least recently used idle ones are closed

    def __init__(self, engine: Engine, config: WorkerConfig, name: str = "worker"):
        self.engine, self.config, self.name = engine, config, name
        # receiver address -> collective links (id, link) no call is using: a call takes one (or opens one) and
        # gives it back when its KV is through, so concurrent calls never share a link (its sends and receives
        # are matched in order, one call at a time); a link that failed is dropped (its receiver drops it too)
        self.links: dict[str, list[tuple[str, CollectiveLink]]] = {}
        self._links_opened = 0
        self._links_lock = threading.Lock()
        # (holder, session, message) -> its copy here: a graph's later waves read the same parents again
        # (its question, its system prompts); the copies are the store's to evict, and the oldest go past COPIES
        self.copies: OrderedDict[tuple[str, str, str], str] = OrderedDict()
        self._using: Counter[str] = Counter()  # copy -> the calls reading it now (never freed while read)
        self._copies_lock = threading.Lock()
        # holder's KVExport address -> a channel to it, kept for the next fetch (least recently used first); a
        # holder replica that went away is never called again, so past CHANNELS the idle ones are closed
        self.channels: OrderedDict[str, grpc.Channel] = OrderedDict()
        self._fetching: Counter[str] = Counter()  # holder -> the fetches on its channel now (never closed under them)

    def _sender(self, address: str, transport: Transport) -> KVSender:
        """LOCAL hands messages over in this process's store when the receiver is here; a colocated replica whose
        synthesis runs on another replica ships over gRPC instead (the receiver records how it came)."""
        fp, size = self.engine.fingerprint, self.config.kv_chunk_bytes
        if transport is Transport.LOCAL and local.receiver_here(address) is not None:
            return local.LocalSender(address, fp)
        if transport is Transport.COLLECTIVE:
            with self._links_lock:
                idle = self.links.setdefault(address, [])
                if idle:
                    link_id, link = idle.pop()
                else:
                    self._links_opened += 1
                    link_id, link = f"{self.name}->{address}#{self._links_opened}", None
            if link is None:  # (opened outside the lock: it waits for the receiver)
                link = open_link(address, link_id, collective_backend())
            return CollectiveSender(address, fp, link, link_id, size)
        return GrpcSender(address, fp, size)

    def _finish(self, sender: KVSender, address: str) -> dict:
        """The sender's streams, all through; its collective link (if any) goes back for the next call."""
        sent = sender.finish()
        if isinstance(sender, CollectiveSender):
            with self._links_lock:
                idle = self.links.setdefault(address, [])
                keep = len(idle) < self.IDLE_LINKS
                if keep:
                    idle.append((sender.link_id, sender.link))
            if not keep:
                close_link(address, sender.link_id)
        return sent

    def run(self, req: BranchRequest) -> Iterator[BranchToken | BranchDone]:
        eng = self.engine
        sender = self._sender(req.kv_address, req.transport) if req.transport.ships else None
        names = [stream_name(req.workflow, j) for j in req.indices]
        shipped, chunks = [0] * len(names), [0] * len(names)
        branches = fan_out(eng, req.task, req.prompts, req.header or self.config.header, req.sampling,
                           on_start=lambda _: sender.open(names) if sender else None,
                           readable=sender is not None and sender.copies)  # (shipped in chunks as they decode)

        def ship(c: int, end: int, total: int = 0) -> None:
            tokens, kv = branches.partial_kv(c, shipped[c], end) if sender.copies else ([], None)
            sender.send(BranchChunk(names[c], names[c], branches.offsets[c], shipped[c], tokens, kv, total,
                                    local_message=branches.ids[c] if total and not sender.copies else ""))
            shipped[c], chunks[c] = end, chunks[c] + 1

        handed_over = False
        try:
            for event in branches:
                c = event.call
                yield BranchToken(req.indices[c], event.token_id, event.text, event.finish_reason or "")
                # the last encoded token waits for the closing chunk, so that chunk (which carries the
                # total) is never empty, even when the scheduler has already fed the call's last token
                end = branches.encoded(c) - 1 if sender and sender.copies else 0
                if end - shipped[c] >= self.config.ship_after(chunks[c]):
                    ship(c, end)
            messages = [eng.message(mid) for mid in branches.ids]
            sent = {}
            if sender:
                for c, msg in enumerate(messages):
                    ship(c, msg.num_tokens, total=msg.num_tokens)
                handed_over = not sender.copies  # local: the synthesizer now owns the branch messages
                sent, sender = self._finish(sender, req.kv_address), None
            for c, msg in enumerate(messages):
                s = sent.get(names[c])
                yield BranchDone(req.indices[c], list(msg.token_ids), msg.nbytes, s.digest if s else 0)
        finally:
            if sender is not None:  # only left here when the call failed midway
                sender.abort("the worker's call failed")  # (its link, if any, is dropped: the next call opens one)
            # The branches now live at the synthesizer: copied there, or (local) handed over in this store.
            branches.free(keep_branches=handed_over)

    def run_nodes(self, req: NodesRequest) -> Iterator[BranchToken | BranchDone]:
        """A RunGraph wave's calls (methods.dag), decoded together on this engine. Each parent is read from a copy
        here, fetched from the holder (checked there against the session) unless an earlier wave left one; when
        the calls end, each output message (its prompt and reply) is shipped to the holder's receiver. The
        outputs are freed when it returns, failed or not; the parents' copies stay for later waves."""
        if not req.transport.remote:
            raise BraidError(f"a graph's wave ships its outputs over grpc or collective, not {req.transport}")
        eng, names = self.engine, [stream_name(req.stream, c) for c in range(len(req.calls))]
        held: list[str] = []  # the parents' copies, kept from eviction (and from trimming) until the calls end
        spare: list[str] = []  # copies another call made too: this call's go when it ends
        sender, stream = self._sender(req.kv_address, req.transport), None
        try:
            sender.open(names)
            here = self._parents(req, held, spare)
            stream = eng.decode_stream([replace(c, parents=[here[p] for p in c.parents]) for c in req.calls],
                                       readable=bool(req.ship))  # (shipped in chunks as it decodes)
            shipped, chunks = [0] * len(names), [0] * len(names)
            for ev in stream:
                yield BranchToken(ev.call, ev.token_id, ev.text, ev.finish_reason or "")
                c = ev.call
                # (as run() does: the last encoded token waits for the closing chunk, which is never empty)
                end = stream.encoded(c) - 1 if req.ship else 0
                if req.ship and end - shipped[c] >= ship_after(req.ship, chunks[c]):
                    tokens, kv = stream.partial_kv(c, shipped[c], end)
                    sender.send(BranchChunk(names[c], names[c], stream.offset(c), shipped[c], tokens, kv))
                    shipped[c], chunks[c] = end, chunks[c] + 1
            outputs = [eng.message(mid) for mid in stream.ids]
            for c, msg in enumerate(outputs):  # the rest (a message never changes: its KV is sent as it is)
                sender.send(BranchChunk(names[c], names[c], msg.offset, shipped[c], list(msg.token_ids[shipped[c]:]),
                                        msg.kv.read(shipped[c]).contiguous(), msg.num_tokens))
            sent, sender = self._finish(sender, req.kv_address), None
            for c, msg in enumerate(outputs):
                yield BranchDone(c, list(msg.token_ids), msg.nbytes, sent[names[c]].digest, self.name)
        finally:
            if sender is not None:  # only left here when the call failed midway
                sender.abort("the worker's wave failed")
            if stream is not None:
                stream.close()
            eng.release(held)
            self._trim(held)
            for mid in [*spare, *((stream.ids or []) if stream is not None else [])]:
                try:
                    eng.free(mid, when_unpinned=True)
                except UnknownMessageError:
                    pass

    def _parents(self, req: NodesRequest, held: list[str], spare: list[str]) -> dict[str, str]:
        """The holder's parent id -> its copy here, each held (appended to `held`) and marked in use; the missing
        ones fetched together (a copy that another call kept meanwhile makes this one `spare`)."""
        eng, here = self.engine, {}
        wanted = list(dict.fromkeys(p for call in req.calls for p in call.parents))
        with self._copies_lock:
            for mid in wanted:
                key = (req.holder, req.session, mid)
                if key in self.copies:
                    try:
                        held += eng.hold([self.copies[key]])
                    except UnknownMessageError:  # evicted by the store meanwhile
                        del self.copies[key]
                        continue
                    here[mid] = self.copies[key]
                    self._using[here[mid]] += 1
                    self.copies.move_to_end(key)
        missing = [mid for mid in wanted if mid not in here]
        if not missing:
            return here
        channel = self._channel(req.holder)
        try:
            for got in fetch_many(channel, req.holder, req.session, missing, req.fingerprint, req.fetch_timeout_s):
                copy = eng.import_message(got.token_ids, got.kv, got.offset, got.fingerprint)
                held += eng.hold([copy])
                here[got.message_id] = copy
                with self._copies_lock:
                    key = (req.holder, req.session, got.message_id)
                    if key in self.copies:
                        spare.append(copy)
                        continue
                    self.copies[key] = copy
                    self._using[copy] += 1
        finally:
            with self._copies_lock:
                self._fetching[req.holder] -= 1
                self._close_idle_channels()
        return here

    def _channel(self, holder: str) -> grpc.Channel:
        """The kept channel to `holder` (opened if none), marked in use until the caller's fetch ends; idle
        channels past CHANNELS are closed, the least recently used first."""
        with self._copies_lock:
            channel = self.channels.get(holder)
            if channel is None:
                channel = self.channels[holder] = peer_channel(holder, options=GRPC_LIMITS)
            self.channels.move_to_end(holder)
            self._close_idle_channels(keep=holder)
            self._fetching[holder] += 1
        return channel

    def _close_idle_channels(self, keep: str = "") -> None:
        """Past CHANNELS, close the least recently used channels no fetch reads from (and not `keep`'s); the
        caller holds _copies_lock."""
        idle = [h for h in self.channels if not self._fetching[h] and h != keep]
        for holder in idle[:max(0, len(self.channels) - self.CHANNELS)]:
            del self._fetching[holder]
            self.channels.pop(holder).close()

    def _trim(self, used: list[str]) -> None:
        """A call is done with the copies `used`; the oldest copies no call reads go, down to COPIES."""
        with self._copies_lock:
            self._using.subtract(used)
            self._using += Counter()
            for key in [k for k, copy in self.copies.items() if not self._using[copy]]:
                if len(self.copies) <= self.COPIES:
                    break
                try:
                    self.engine.free(self.copies.pop(key), when_unpinned=True)
                except UnknownMessageError:
                    pass
