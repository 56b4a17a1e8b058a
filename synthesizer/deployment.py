"""The Synthesizer deployment: receives branch KV over gRPC, re-encodes it, and decodes.

It also hosts the session-level agent API (choreography calls on message ids), since
those messages live in its engine's store.
"""

import logging
import time
import zlib

import ray
import torch
from ray import serve

from braid.cluster.config import ClusterConfig
from braid.api.directory import Directory
from braid.kv.chunks import tensor_bytes
from braid.kv.grpc_transport import KVReceiver
from braid.api.metrics import metrics
from braid.api.service import AgentLogic, ServiceConfig
from braid.engine import Engine, PrefillCall
from braid.engine.synthesis import synthesize_stream, synthesize_text_stream

log = logging.getLogger(__name__)


@serve.deployment(name="Synthesizer")
class Synthesizer:
    def __init__(self, config: ClusterConfig, redis_url: str):
        self.config = config
        self.engine = Engine(config.engine_config("cuda" if torch.cuda.is_available() else "cpu"))
        self.receiver = KVReceiver(self.engine.fingerprint, host=ray.util.get_node_ip_address())
        replica = serve.get_replica_context().replica_id.unique_id
        self.agent = AgentLogic(self.engine, Directory.connect(redis_url, config.session_ttl_s),
                                ServiceConfig(replica=replica, default_max_tokens=config.default_max_tokens,
                                              max_branches=config.max_branches, worker_header=config.worker_header))
        self.prefill_tokens_per_s = self._measure_prefill()
        self.link_bytes_per_s: float | None = None  # from completed transfers
        log.info("synthesizer %s: KV at %s, prefill %.0f tok/s", replica, self.receiver.address,
                 self.prefill_tokens_per_s)

    def _measure_prefill(self, tokens: int = 256) -> float:
        ids = [3 + i % (self.engine.spec.vocab_size - 3) for i in range(tokens)]
        rates = []
        for _ in range(2):  # the first run warms up
            start = time.perf_counter()
            mid, = self.engine.prefill([PrefillCall(ids)])
            rates.append(tokens / (time.perf_counter() - start))
            self.engine.free(mid)
        return rates[-1]

    def info(self) -> dict:
        s = self.engine.spec
        return {"fingerprint": self.engine.fingerprint, "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "link_bytes_per_s": self.link_bytes_per_s,
                "kv_bytes_per_token": s.num_layers * 2 * s.num_kv_heads * s.head_dim * self.engine.lm.dtype.itemsize,
                "store_bytes": self.engine.store.used_bytes}

    def agent_unary(self, name: str, request):
        return getattr(self.agent, name)(request)

    def agent_stream(self, name: str, request):
        yield from getattr(self.agent, name)(request)

    def synthesize(self, req: dict):
        """req: workflow, session, task, prompt, placement, sampling, mode ("grpc", "collective" or "text"),
        branches (count) and, in text mode, branch_tokens. Yields kv_address first, then receipts, tokens, done."""
        yield {"kv_address": self.receiver.address}
        eng = self.engine
        received = []
        kv_mode = req["mode"] != "text"
        if kv_mode:
            for j in range(req["branches"]):
                got = self.receiver.wait(f"{req['workflow']}:{j}", self.config.kv_wait_timeout_s)
                received.append(got)
                rate = got.link_bytes_per_s
                if rate is not None:
                    old = self.link_bytes_per_s
                    self.link_bytes_per_s = rate if old is None else 0.8 * old + 0.2 * rate
            yield {"receipts": [{"branch": j, "bytes": g.bytes, "crc32": zlib.crc32(tensor_bytes(g.kv)),
                                 "transfer_ms": 1e3 * g.tail_seconds} for j, g in enumerate(received)]}
        with self.agent.lock:
            prefix = eng.prefill([PrefillCall(req["task"])])
            if kv_mode:
                branches = [eng.import_message(g.token_ids, g.kv, g.offset, eng.fingerprint)
                            for g in received]
                stream = synthesize_stream(eng, branches, req["prompt"], prefix=prefix, placement=req["placement"],
                                           sampling=req["sampling"])
            else:
                branches = []
                stream = synthesize_text_stream(eng, req["branch_tokens"], req["prompt"], prefix=prefix,
                                                sampling=req["sampling"])
            generated = 0
            for event in stream:
                generated += 1
                yield {"token": (event.token_id, event.text, event.finish_reason or "", event.message_id or "")}
            m = metrics()
            if not self.agent.register(req["session"], prefix + branches + stream.ids):
                m["control_plane_errors"].inc()
            transport = {"transport": req["mode"]}
            if generated > 1:
                m["tpot"].observe(stream.timings["decode"] / (generated - 1), tags=transport)
            for g in received:
                m["kv_bytes"].inc(g.bytes, tags=transport)
                m["kv_seconds"].observe(g.tail_seconds, tags=transport)
            m["store_bytes"].set(eng.store.used_bytes)
            yield {"done": {"answer_id": stream.ids[0], "answer_text": eng.text(stream.ids[0]), "branch_ids": branches,
                            "cache_ms": 1e3 * stream.timings["assemble"],
                            "first_token_ms": 1e3 * stream.timings["first_token"]}}
