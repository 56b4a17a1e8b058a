"""The Worker deployment: decodes a group of branches together (one forward per step), streaming
their tokens and, in KV mode, each branch's KV to the synthesizer in staircase chunks while
it decodes."""

import logging
import threading
import zlib

import torch
from ray import serve

from cluster.config import ClusterConfig
from cluster.kv_chunks import tensor_bytes
from cluster.kv_transport import KVSender
from engine import DecodeCall, Engine, PrefillCall
from engine.sampling import SamplingParams

log = logging.getLogger(__name__)


@serve.deployment(name="Worker")
class Worker:
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.engine = Engine(config.engine_config("cuda" if torch.cuda.is_available() else "cpu"))
        self.lock = threading.Lock()  # the engine serves one call at a time

    def run_branches(self, req: dict):
        """req: task, branches [(index, prompt, stream_id)], sampling (SamplingParams), kv_address or None.

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
        senders = []
        if req["kv_address"]:
            senders = [KVSender(req["kv_address"], stream_id, f"{stream_id}:branch", eng.fingerprint,
                                offset=eng.message(c).end, max_chunk_bytes=self.config.kv_chunk_bytes)
                       for (_, _, stream_id), c in zip(branches, contexts)]
        shipped, chunks = [0] * len(branches), [0] * len(branches)
        try:
            for event in stream:
                c = event.call
                yield {"token": (branches[c][0], event.token_id, event.text, event.finish_reason or "")}
                if senders and stream.encoded(c) - shipped[c] >= self.config.ship_after(chunks[c]):
                    tokens, kv = stream.partial_kv(c, shipped[c], stream.encoded(c))
                    senders[c].send(tokens, kv, shipped[c])
                    shipped[c], chunks[c] = stream.encoded(c), chunks[c] + 1
            for c, mid in enumerate(stream.ids):
                msg = eng.message(mid)
                if senders:
                    tokens, kv = stream.partial_kv(c, shipped[c], msg.num_tokens)
                    senders[c].send(tokens, kv, shipped[c], total_tokens=msg.num_tokens)
                    senders[c].close()
                yield {"done": {"branch": branches[c][0], "token_ids": list(msg.token_ids), "offset": msg.offset,
                                "kv_bytes": msg.nbytes, "crc32": zlib.crc32(tensor_bytes(msg.kv))}}
            senders = []
        finally:
            for sender in senders:  # only left here when the call failed midway
                sender.abort()
            for mid in [*prefix, *contexts, *(stream.ids or [])]:  # the branches now live at the synthesizer
                if mid in eng.store:
                    eng.free(mid)
