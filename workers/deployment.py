"""The Worker deployment: decodes one branch per call, streaming its tokens and, in KV mode,
its KV to the synthesizer in staircase chunks while it decodes."""

import logging
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

    def fingerprint(self) -> str:
        return self.engine.fingerprint

    def run_branch(self, req: dict):
        """req: task, branch_prompt, branch, sampling (SamplingParams), kv_address or None, stream_id.

        Yields {"token": ...} per token, then {"done": ...} with the branch's tokens and KV receipt.
        """
        eng, j = self.engine, req["branch"]
        sampling: SamplingParams = req["sampling"]
        prefix = eng.prefill([PrefillCall(req["task"])])
        ctx = eng.prefill([PrefillCall(req["branch_prompt"], parents=prefix)])
        stream = eng.decode_stream([DecodeCall(self.config.worker_header, parents=[*prefix, *ctx],
                                               sampling=sampling)])
        sender = None
        if req["kv_address"]:
            sender = KVSender(req["kv_address"], req["stream_id"], f"{req['stream_id']}:branch", eng.fingerprint,
                              offset=eng.message(ctx[0]).end, max_chunk_bytes=self.config.kv_chunk_bytes)
        shipped, chunks, closed = 0, 0, False
        try:
            for event in stream:
                yield {"token": (j, event.token_id, event.text, event.finish_reason or "")}
                if sender and stream.encoded(0) - shipped >= self.config.ship_after(chunks):
                    tokens, kv = stream.partial_kv(0, shipped, stream.encoded(0))
                    sender.send(tokens, kv, shipped)
                    shipped, chunks = stream.encoded(0), chunks + 1
            msg = eng.message(stream.ids[0])
            if sender:
                tokens, kv = stream.partial_kv(0, shipped, msg.num_tokens)
                sender.send(tokens, kv, shipped, total_tokens=msg.num_tokens)
                sender.close()
                closed = True
            yield {"done": {"branch": j, "token_ids": list(msg.token_ids), "offset": msg.offset,
                            "kv_bytes": msg.nbytes, "crc32": zlib.crc32(tensor_bytes(msg.kv))}}
        finally:
            if sender and not closed:
                sender.abort()
            for mid in [*prefix, *ctx, *(stream.ids or [])]:  # the branch now lives at the synthesizer
                if mid in eng.store:
                    eng.free(mid)
