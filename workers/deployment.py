"""The Worker deployment: decodes a group of branches together (one forward per step), streaming
their tokens and, in KV mode, each branch's KV to the synthesizer in staircase chunks while
it decodes."""

import logging
import threading
import zlib

import torch
from ray import serve

from braid.cluster.config import ClusterConfig
from braid.kv.chunks import tensor_bytes
from braid.kv.grpc_transport import KVSender, collective_backend, open_link
from braid.engine import DecodeCall, Engine, PrefillCall
from braid.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


@serve.deployment(name="Worker")
class Worker:
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.engine = Engine(config.engine_config("cuda" if torch.cuda.is_available() else "cpu"))
        self.lock = threading.Lock()  # the engine serves one call at a time
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.links = {}  # synthesizer KV address -> CollectiveLink, set up once per pair

    def _sender(self, address: str, transport: str) -> KVSender:
        if transport != "collective":
            return KVSender(address, self.engine.fingerprint, self.config.kv_chunk_bytes)
        link_id = f"{self.replica}->{address}"
        if address not in self.links:
            self.links[address] = open_link(address, link_id, collective_backend())
        return KVSender(address, self.engine.fingerprint, self.config.kv_chunk_bytes, self.links[address], link_id)

    def run_branches(self, req: dict):
        """req: task, branches [(index, prompt, stream_id)], sampling (SamplingParams), kv_address or None,
        transport ("grpc" or "collective").

        Yields {"token": (branch, id, text, finish)} per token, then {"done": ...} per branch.
        """
        with self.lock:
            yield from self._run(req)

    def _run(self, req: dict):
        eng, branches = self.engine, req["branches"]
        sampling: SamplingParams = req["sampling"]
        prefix = eng.prefill([PrefillCall(req["task"])])
        contexts = eng.prefill([PrefillCall(prompt, parents=prefix) for _, prompt, _ in branches])
        stream = eng.decode_stream([DecodeCall(self.config.worker_header, parents=[*prefix, c], sampling=sampling)
                                    for c in contexts])
        sender = self._sender(req["kv_address"], req["transport"]) if req["kv_address"] else None
        offsets = [eng.message(c).end for c in contexts]

        def ship(c: int, end: int, total: int = 0) -> None:
            tokens, kv = stream.partial_kv(c, shipped[c], end)
            stream_id = branches[c][2]
            sender.send(stream_id, f"{stream_id}:branch", offsets[c], tokens, kv, shipped[c], total)
            shipped[c], chunks[c] = end, chunks[c] + 1

        shipped, chunks = [0] * len(branches), [0] * len(branches)
        try:
            for event in stream:
                c = event.call
                yield {"token": (branches[c][0], event.token_id, event.text, event.finish_reason or "")}
                if sender and stream.encoded(c) - shipped[c] >= self.config.ship_after(chunks[c]):
                    ship(c, stream.encoded(c))
            messages = [eng.message(mid) for mid in stream.ids]
            if sender:
                for c, msg in enumerate(messages):
                    ship(c, msg.num_tokens, total=msg.num_tokens)
                sender.close()
                sender = None
            for c, msg in enumerate(messages):
                yield {"done": {"branch": branches[c][0], "token_ids": list(msg.token_ids), "offset": msg.offset,
                                "kv_bytes": msg.nbytes, "crc32": zlib.crc32(tensor_bytes(msg.kv))}}
        finally:
            if sender is not None:  # only left here when the call failed midway
                sender.abort()
                self.links.pop(req["kv_address"], None)  # a broken pair is set up afresh next time
            for mid in [*prefix, *contexts, *(stream.ids or [])]:  # the branches now live at the synthesizer
                if mid in eng.store:
                    eng.free(mid)
