"""Ship KV or re-prefill text: decided once per request, at the ingress, after validation, from measured numbers."""

from dataclasses import dataclass

from braid.engine.errors import PreconditionError
from braid.kv.connector import Transport
from braid.runtime.messages import SynthesizerInfo


@dataclass(frozen=True)
class DecisionInput:
    """What a workflow's transport is decided from: the client's ask, the cluster's setting, the request's shape,
    and what the synthesizer measured and had verified (SynthesizerInfo)."""

    requested: Transport | None  # the client's (None: TRANSPORT_UNSPECIFIED, the cluster decides)
    configured: Transport | None  # the cluster's kv_transport (None: auto)
    colocated: bool  # the synthesizer's engines run the branches too
    branches: int
    branch_limit: int  # the most tokens one branch message can hold (worker header + max_tokens)
    placement: str  # where the request puts the branches (synthesis.Placement's value)
    staircase: bool  # it answers while the branches still grow
    info: SynthesizerInfo

    @property
    def per_branch(self) -> bool:
        """Whether the synthesizer reads branches longer than the verified ones from their text: under `auto`,
        unless the client chose the transport itself (a client that asks for KV gets KV for every branch), and
        not in a staircase, which answers while the branches are still growing."""
        return self.configured is None and self.requested is None and not self.staircase


@dataclass(frozen=True)
class Decision:
    transport: Transport
    reason: str  # for the client (the Decision event) and the logs
    text_over: int = 0  # the cache path reads branches longer than this many tokens from their text (0: none)


def decide(x: DecisionInput) -> Decision:
    """The request's transport, and why. `auto` reads branches from KV only where that gives the answers text
    would: with a calibration loaded and verified (`braid eval --verify`) at this many branches, at this
    placement, on branches this long; otherwise the cache path may answer tasks that read branches together
    wrongly. Length is decided per branch, on what the branches turn out to be, not on the worst case their
    max_tokens allow: KV is shipped, and at synthesis each branch longer than the verified tokens is read from
    its text instead (`text_over`; the answer's WorkflowDone lists them). Where that cannot be done (a
    staircase), a worst case beyond the envelope re-prefills text. Past the envelope, shipping wins when moving
    the most KV the branches can produce takes less time than re-prefilling their text.

    A staircase reads the workers' KV chunks as they arrive: one that would get text is FAILED_PRECONDITION."""
    transport, reason = _decide(x)
    if x.staircase and transport is Transport.TEXT:
        raise PreconditionError(f"a staircase reads the workers' KV chunks as they arrive, but the transport chosen "
                                f"is text ({reason}); ask for TRANSPORT_GRPC to answer from the cache path anyway, "
                                "or drop staircase")
    return Decision(transport, reason, x.info.verified_tokens if x.per_branch else 0)


def _decide(x: DecisionInput) -> tuple[Transport, str]:
    info, auto = x.info, x.configured is None
    if x.requested is not None:
        return (x.requested, "requested by the client")
    calibration, override = info.calibration, "ask for a KV transport to override"
    if auto and not calibration:
        return (Transport.TEXT, "no calibration is loaded for this model, and uncalibrated answers from KV "
                        f"are often wrong: the branches' text is re-prefilled ({override}, or serve with "
                        "--calibration)")
    if auto and x.branches > info.verified_branches:
        checked = (f"verified to answer as text does only up to {info.verified_branches} branches"
                   if info.verified_branches else "not verified to answer as text does (`braid eval --verify`)")
        return (Transport.TEXT, f"calibration {calibration} is {checked}; this request has {x.branches}: "
                        f"the branches' text is re-prefilled ({override})")
    over = info.verified_tokens and x.branch_limit > info.verified_tokens
    if auto and over and not x.per_branch:
        return (Transport.TEXT, f"calibration {calibration} was verified on branches of up to "
                        f"{info.verified_tokens} tokens; this request's may reach {x.branch_limit} (worker "
                        f"max_tokens): the branches' text is re-prefilled ({override}, or lower max_tokens)")
    if auto and info.verified_placement and x.placement and x.placement != info.verified_placement:
        return (Transport.TEXT, f"calibration {calibration} was verified at placement "
                        f"{info.verified_placement}; this request asks for {x.placement}: the branches' text is "
                        f"re-prefilled ({override}, or leave placement unset)")
    with_calibration = f"; calibration {calibration}" if calibration else ""
    if auto and over:
        with_calibration += (f"; a branch longer than the {info.verified_tokens} tokens it was verified on is read "
                             "from its text at synthesis")
    if x.colocated:
        return (Transport.LOCAL, f"colocated engines: KV is reused in place{with_calibration}")
    if not auto:
        return (x.configured, f"configured: kv_transport={x.configured}{with_calibration}")
    tokens = x.branches * x.branch_limit  # the most the branches can produce (their max_tokens)
    kv_bytes, prefill_s = tokens * info.kv_bytes_per_token, tokens / info.prefill_tokens_per_s
    if info.link_bytes_per_s is None:
        return (Transport.GRPC, f"no link measured yet; re-prefill of up to {tokens} tokens would take "
                        f"up to ~{1e3 * prefill_s:.0f} ms{with_calibration}")
    ship_s = kv_bytes / info.link_bytes_per_s
    if ship_s < prefill_s:
        return (Transport.GRPC, f"shipping up to {_mb(kv_bytes)} at {info.link_bytes_per_s / 1e9:.2f} GB/s "
                        f"(~{1e3 * ship_s:.0f} ms) beats re-prefill of up to {tokens} tokens at "
                        f"{info.prefill_tokens_per_s:.0f} tok/s (~{1e3 * prefill_s:.0f} ms){with_calibration}")
    return (Transport.TEXT, f"re-prefill of up to {tokens} tokens (~{1e3 * prefill_s:.0f} ms) beats "
                    f"shipping up to {_mb(kv_bytes)} at {info.link_bytes_per_s / 1e9:.2f} GB/s "
                    f"(~{1e3 * ship_s:.0f} ms)")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"
