"""Per-request timings and their summary, under the names `vllm bench serve` reports.

TTFT is request to the first answer token (worker decoding included: what a user waits for); TPOT is
(E2EL - TTFT) / (answer tokens - 1); ITL are the gaps between answer tokens; E2EL is request to the
last event. Throughputs: requests, answer tokens (`output_throughput`) and every generated token,
branches included (`generated_token_throughput`), per second of the run.
"""

from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    start: float
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)  # answer tokens
    branch_tokens: int = 0
    end: float | None = None  # its last event, or its failure (None: it has not ended)
    error: str = ""
    transport: str = ""
    lost_branches: int = 0  # branches a staircase answered without (their worker or KV failed)

    @property
    def ok(self) -> bool:
        return not self.error and self.end is not None and self.first_token is not None

    @property
    def ttft(self) -> float:
        return self.first_token - self.start

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.first_token) / (n - 1) if n > 1 else None

    @property
    def itl(self) -> list[float]:
        return list(np.diff(self.token_times))


def parse_slos(specs: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 0.5, "tpot": 0.05} (milliseconds in, seconds out)."""
    slos = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"SLO {spec!r}: the metric must be ttft, tpot or e2el")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"SLO {spec!r}: give milliseconds after the colon, e.g. ttft:500") from None
        if ms <= 0:
            raise ValueError(f"SLO {spec!r}: milliseconds must be positive")
        slos[name] = ms / 1e3
    return slos


def _stats(name: str, values: list[float]) -> dict[str, float]:
    v = np.asarray(values, dtype=float) * 1e3 if values else np.zeros(1)
    return {f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
            f"p99_{name}_ms": float(np.percentile(v, 99))}


def summarize(records: list[RequestRecord], duration_s: float, slos: dict[str, float]) -> dict:
    ok = [r for r in records if r.ok]
    answer = sum(len(r.token_times) for r in ok)
    generated = answer + sum(r.branch_tokens for r in ok)
    out = {"completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration_s,
           "request_throughput": len(ok) / duration_s, "output_throughput": answer / duration_s,
           "generated_token_throughput": generated / duration_s}
    out |= _stats("ttft", [r.ttft for r in ok])
    out |= _stats("tpot", [r.tpot for r in ok if r.tpot is not None])
    out |= _stats("itl", [x for r in ok for x in r.itl])
    out |= _stats("e2el", [r.e2el for r in ok])
    if slos:
        good = [r for r in ok if all(getattr(r, k) is not None and getattr(r, k) <= v for k, v in slos.items())]
        out["request_goodput"] = len(good) / duration_s
        out["slos_ms"] = {k: v * 1e3 for k, v in slos.items()}
    errors = sorted({r.error for r in records if r.error})
    if errors:
        out["errors"] = errors[:10]
    return out
