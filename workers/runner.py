"""The worker role over one engine (Ray-free): decode a group of branches and ship their KV as they grow; or
decode a RunGraph wave's calls for the replica running the graph, and ship their outputs back to it."""

import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace

from braid.api.messages import BranchDone, BranchRequest, BranchToken, NodesRequest
from braid.engine import Engine, fan_out
from braid.engine.errors import BraidError, UnknownMessageError
from braid.kv import local
from braid.kv.collective import CollectiveSender, collective_backend, open_link
from braid.kv.connector import BranchChunk, KVSender, stream_name
from braid.kv.export import fetch
from braid.kv.grpc_transport import GrpcSender
from braid.models.chat import WORKER_HEADER

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
        return self.kv_schedule[min(shipped_chunks, len(self.kv_schedule) - 1)]


class BranchRunner:
    """Runs BranchRequests on `engine`; the Worker deployment (and a colocated Synthesizer) host one."""

    def __init__(self, engine: Engine, config: WorkerConfig, name: str = "worker"):
        self.engine, self.config, self.name = engine, config, name
        self.links = {}  # receiver address -> CollectiveLink, set up once per pair

    def _sender(self, address: str, transport: str) -> KVSender:
        fp, size = self.engine.fingerprint, self.config.kv_chunk_bytes
        if transport == "local" and local.receiver_here(address) is not None:
            return local.LocalSender(address, fp)
        if transport == "collective":
            link_id = f"{self.name}->{address}"
            if address not in self.links:
                self.links[address] = open_link(address, link_id, collective_backend())
            return CollectiveSender(address, fp, self.links[address], link_id, size)
        return GrpcSender(address, fp, size)  # grpc, or "local" to a synthesizer on another replica

    def run(self, req: BranchRequest) -> Iterator[BranchToken | BranchDone]:
        eng = self.engine
        sender = self._sender(req.kv_address, req.transport) if req.transport != "text" else None
        names = [stream_name(req.workflow, j) for j in req.indices]
        shipped, chunks = [0] * len(names), [0] * len(names)
        branches = fan_out(eng, req.task, req.prompts, self.config.header, req.sampling,
                           on_start=lambda _: sender.open(names) if sender else None)

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
                sent, sender = sender.finish(), None
            for c, msg in enumerate(messages):
                s = sent.get(names[c])
                yield BranchDone(req.indices[c], list(msg.token_ids), msg.nbytes, s.digest if s else 0)
        finally:
            if sender is not None:  # only left here when the call failed midway
                sender.abort("the worker's call failed")
                self.links.pop(req.kv_address, None)  # a broken pair is set up afresh next time
            # The branches now live at the synthesizer: copied there, or (local) handed over in this store.
            branches.free(keep_branches=handed_over)

    def run_nodes(self, req: NodesRequest) -> Iterator[BranchToken | BranchDone]:
        """A RunGraph wave's calls (engine.dag), decoded together on this engine. Each parent is fetched from
        the holder (checked there against the session) and stored here under an id of its own for the call;
        when the calls end, each output message (its prompt and reply) is shipped to the holder's receiver.
        Whatever this took in or made is freed when it returns, failed or not."""
        if req.transport not in ("grpc", "collective"):
            raise BraidError(f"a graph's wave ships its outputs over grpc or collective, not {req.transport!r}")
        eng, names = self.engine, [stream_name(req.stream, c) for c in range(len(req.calls))]
        here: dict[str, str] = {}  # the holder's parent id -> its copy here
        held: list[str] = []  # (kept from eviction until the call has pinned them)
        sender, stream = self._sender(req.kv_address, req.transport), None
        try:
            sender.open(names)
            for mid in dict.fromkeys(p for call in req.calls for p in call.parents):
                got = fetch(req.holder, req.session, mid, req.fingerprint, req.fetch_timeout_s)
                here[mid] = eng.import_message(got.token_ids, got.kv, got.offset, got.fingerprint)
                held += eng.hold([here[mid]])
            stream = eng.decode_stream([replace(c, parents=[here[p] for p in c.parents]) for c in req.calls])
            for ev in stream:
                yield BranchToken(ev.call, ev.token_id, ev.text, ev.finish_reason or "")
            outputs = [eng.message(mid) for mid in stream.ids]
            for c, msg in enumerate(outputs):  # (a message never changes: its KV is sent as it is)
                sender.send(BranchChunk(names[c], names[c], msg.offset, 0, list(msg.token_ids), msg.kv,
                                        msg.num_tokens))
            sent, sender = sender.finish(), None
            for c, msg in enumerate(outputs):
                yield BranchDone(c, list(msg.token_ids), msg.nbytes, sent[names[c]].digest, self.name)
        finally:
            if sender is not None:  # only left here when the call failed midway
                sender.abort("the worker's wave failed")
                self.links.pop(req.kv_address, None)
            if stream is not None:
                stream.close()
            eng.release(held)
            for mid in [*here.values(), *((stream.ids or []) if stream is not None else [])]:
                try:
                    eng.free(mid, when_unpinned=True)
                except UnknownMessageError:
                    pass
