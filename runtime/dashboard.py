"""Braid's Grafana dashboard: PromQL panels over the metrics of braid.runtime.metrics, as Grafana's JSON model."""

import json
from dataclasses import dataclass

RATE = "$__rate_interval"  # Grafana's rate window; plots made without Grafana substitute their own


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str  # Grafana unit id: s, bytes, Bps, reqps, short, percentunit
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)


def _quantiles(metric: str, by: str = "transport") -> tuple[tuple[str, str], ...]:
    return tuple((f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket[{RATE}])))",
                  f"p{int(q * 100)} {{{{{by}}}}}") for q in (0.5, 0.99))


PANELS = (
    Panel("Time to first token", "s", _quantiles("ray_braid_time_to_first_token_seconds")),
    Panel("Time per output token", "s", _quantiles("ray_braid_time_per_output_token_seconds")),
    Panel("Inter-token latency", "s", _quantiles("ray_braid_inter_token_latency_seconds")),
    Panel("Workflows by transport (KV reuse vs text fallback)", "reqps",
          ((f"sum by (transport) (rate(ray_braid_synthesis_requests_total[{RATE}]))", "{{transport}}"),)),
    Panel("KV bytes shipped", "Bps",
          ((f"sum by (transport) (rate(ray_braid_kv_bytes_shipped_total[{RATE}]))", "{{transport}}"),)),
    Panel("KV transfer time (last burst after a branch's last token)", "s",
          _quantiles("ray_braid_kv_transfer_seconds")),
    Panel("Message store bytes", "bytes", (("sum by (deployment) (ray_braid_store_bytes)", "{{deployment}}"),)),
    Panel("Scheduler queue depth and batch", "short",
          (("sum by (deployment) (ray_braid_scheduler_waiting)", "waiting {{deployment}}"),
           ("sum by (deployment) (ray_braid_scheduler_running)", "running {{deployment}}"),
           (f"sum by (deployment) (rate(ray_braid_scheduler_preemptions_total[{RATE}]))",
            "preempted/s {{deployment}}"))),
    Panel("Paged work KV", "bytes", (("sum by (deployment) (ray_braid_work_kv_bytes)", "{{deployment}}"),)),
    Panel("Prefix cache hit ratio since each replica started", "percentunit",
          (("sum by (deployment) (ray_braid_prefix_cache_hits) / clamp_min(sum by (deployment) "
            "(ray_braid_prefix_cache_hits + ray_braid_prefix_cache_misses), 1)", "{{deployment}}"),)),
    Panel("Session messages lost with their replica, and encoded again", "short",
          ((f"sum (rate(ray_braid_holder_losses_total[{RATE}]))", "lost/s"),
           (f"sum (rate(ray_braid_recomputed_messages_total[{RATE}]))", "encoded again/s"),
           (f"sum (rate(ray_braid_recomputed_tokens_total[{RATE}]))", "tokens encoded again/s"))),
)


def grafana_dashboard() -> dict:
    """The dashboard's JSON model, two panels a row, over a Prometheus data source picked when viewing."""
    source = {"type": "prometheus", "uid": "${datasource}"}
    panels = [{
        "id": i + 1, "type": "timeseries", "title": p.title, "datasource": source,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [{"refId": chr(ord("A") + j), "datasource": source, "expr": expr, "legendFormat": legend}
                    for j, (expr, legend) in enumerate(p.queries)],
    } for i, p in enumerate(PANELS)]
    return {
        "title": "Braid", "uid": "braid", "schemaVersion": 39, "version": 1, "editable": True,
        "tags": ["braid", "ray", "llm"], "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus"}]},
        "panels": panels,
    }


def dashboard_json() -> str:
    """As the chart ships it (helm/braid/dashboards/braid.json)."""
    return json.dumps(grafana_dashboard(), indent=1) + "\n"
