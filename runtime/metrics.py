"""Serve metrics (Ray dashboard and its Prometheus export, prefixed `ray_`), named as a vLLM user expects."""

import logging
import threading
import time
import weakref
from functools import cache

from ray.serve.metrics import Counter, Gauge, Histogram

log = logging.getLogger(__name__)
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


@cache
def metrics() -> dict:
    """Created once per replica process (Ray metrics must be made where they are recorded)."""
    return {
        "ttft": Histogram("braid_time_to_first_token_seconds", "Workflow request to first synthesizer token.",
                          boundaries=LATENCY_BUCKETS, tag_keys=("transport",)),
        "tpot": Histogram("braid_time_per_output_token_seconds", "Synthesizer decode time per output token.",
                          boundaries=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5],
                          tag_keys=("transport",)),
        "itl": Histogram("braid_inter_token_latency_seconds", "Gap between consecutive answer tokens at the ingress.",
                         boundaries=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0],
                         tag_keys=("transport",)),
        "kv_bytes": Counter("braid_kv_bytes_shipped", "KV bytes shipped from workers to the synthesizer.",
                            tag_keys=("transport",)),
        "kv_seconds": Histogram("braid_kv_transfer_seconds", "Final KV burst of a branch, after its last token.",
                                boundaries=LATENCY_BUCKETS, tag_keys=("transport",)),
        "requests": Counter("braid_synthesis_requests", "Workflows by transport: KV reuse or text fallback.",
                            tag_keys=("transport",)),
        # Serve tags every metric with its deployment and replica itself.
        "store_bytes": Gauge("braid_store_bytes", "Bytes of KV held in an engine's message store."),
        "control_plane_errors": Counter("braid_control_plane_errors", "Redis operations that failed mid-request."),
        "trace_drops": Counter("braid_trace_drops", "Workflow traces not recorded (the recorder's queue was full, "
                               "or its disk refused the write)."),
        "waiting": Gauge("braid_scheduler_waiting", "Engine calls queued for KV room (the queue depth)."),
        "running": Gauge("braid_scheduler_running", "Engine calls in the running batch."),
        "work_kv_bytes": Gauge("braid_work_kv_bytes", "Paged work-KV bytes held by running calls."),
        "preemptions": Counter("braid_scheduler_preemptions", "Calls preempted for work-KV room (encoded again "
                               "later)."),
        "discarded": Counter("braid_scheduler_discarded_draws", "Tokens drawn in vain with overlap: for a call that "
                             "had stopped on a token not read yet."),
        "kv_copied": Counter("braid_kv_copied_bytes", "KV bytes an engine copied: parents into its pool at reuse "
                             "(none for a parent read in place), a finished call's KV out at commit.",
                             tag_keys=("at",)),
        "prefix_hits": Gauge("braid_prefix_cache_hits", "Calls that reused cached KV, since the replica started."),
        "prefix_misses": Gauge("braid_prefix_cache_misses", "Cacheable calls that found nothing, since start."),
        # session messages encoded again from their lineage (runtime.sessions): their holder had gone, or evicted
        "recomputed_messages": Counter("braid_recomputed_messages", "Session messages encoded again from their "
                                       "lineage."),
        "recomputed_tokens": Counter("braid_recomputed_tokens", "Tokens of session messages encoded again."),
        "recompute_seconds": Counter("braid_recompute_seconds", "Seconds spent encoding session messages again."),
        "holder_losses": Counter("braid_holder_losses", "Session messages found lost with the replica that held "
                                 "them."),
        "adopted_messages": Counter("braid_adopted_messages", "Session messages taken over from a draining replica "
                                    "(handed over, not encoded again)."),
    }


RECOVERY = {"messages": "recomputed_messages", "tokens": "recomputed_tokens", "seconds": "recompute_seconds",
            "holder_losses": "holder_losses", "adopted": "adopted_messages"}  # Sessions.recovery's keys -> metric


def report_engine(engine, every_s: float = 1.0, recovery: dict | None = None) -> threading.Thread:
    """Keep this replica's engine gauges (scheduler queue, batch and preemptions, work KV, store, prefix cache)
    current, and with `recovery` (runtime.sessions.Sessions.recovery) its counts of messages encoded again."""
    m, ref = metrics(), weakref.ref(engine)  # (weakly: the engine is freed when its replica drops it)
    counted = {"preemptions": 0, "discarded": 0, "reuse": 0, "commit": 0, **{k: 0 for k in RECOVERY}}

    def loop():
        while (engine := ref()) is not None:
            try:
                load = engine.scheduler.load
                m["waiting"].set(load["waiting"])
                m["running"].set(load["running"])
                m["work_kv_bytes"].set(load["reserved_bytes"])
                for key in ("preemptions", "discarded"):
                    now = getattr(engine.scheduler, key)
                    if now > counted[key]:
                        m[key].inc(now - counted[key])
                        counted[key] = now
                m["store_bytes"].set(engine.store.used_bytes)
                for at, copied in engine.kv_copied.items():
                    if copied > counted[at]:
                        m["kv_copied"].inc(copied - counted[at], tags={"at": at})
                        counted[at] = copied
                if engine.prefix_cache is not None:
                    m["prefix_hits"].set(engine.prefix_cache.hits)
                    m["prefix_misses"].set(engine.prefix_cache.misses)
                for key, name in RECOVERY.items() if recovery is not None else ():
                    if recovery[key] > counted[key]:
                        m[name].inc(recovery[key] - counted[key])
                        counted[key] = recovery[key]
            except Exception:  # noqa: BLE001 - a metric that cannot be set now may be next time
                log.warning("engine metrics not recorded", exc_info=True)
            del engine
            time.sleep(every_s)

    thread = threading.Thread(target=loop, daemon=True, name="engine-metrics")
    thread.start()
    return thread
