"""Ship KV or re-prefill text: decided per request, after validation, from measured numbers."""

from braid.protos import agent_pb2 as pb


def choose_transport(requested: int, configured: str, colocated: bool, calibration: str, verified_branches: int,
                     branches: int, kv_bytes: int, branch_tokens: int, link_bytes_per_s: float | None,
                     prefill_tokens_per_s: float, branch_limit: int = 0, verified_tokens: int = 0,
                     placement: str = "", verified_placement: str = "", per_branch: bool = True) -> tuple[int, str]:
    """(transport, reason). `calibration`: the one the synthesizer's cache path runs with ("": none);
    `verified_branches` / `verified_tokens`: up to how many branches, of up to how many tokens each (0: not
    recorded), its answers were verified to match text's (`braid eval --verify`). kv_bytes and branch_tokens
    are the most the request's `branches` can produce (their max_tokens), branch_limit the most one branch
    can hold; shipping wins when moving that KV takes less time than re-prefilling its text.

    `auto` reads branches from KV only where that gives the answers text would: with a calibration loaded
    and verified at this many branches, at this `placement` (`verified_placement`: the one the verification
    checked; `braid eval --verify`), on branches this long. Length is decided per branch, on what the branches
    turn out to be, not on the worst case their max_tokens allow: KV is shipped, and at synthesis each branch
    longer than `verified_tokens` is read from its text instead (api.workflow sets SynthesisRequest.text_over;
    the answer's WorkflowDone lists them). Where that cannot be done (`per_branch` False: a staircase, which
    answers while the branches are still growing), a worst case beyond the envelope re-prefills text. Elsewhere
    the cache path may answer tasks that read branches together wrongly."""
    if requested != pb.TRANSPORT_UNSPECIFIED:
        return requested, "requested by the client"
    override = "ask for a KV transport to override"
    if configured == "auto" and not calibration:
        return pb.TRANSPORT_TEXT, ("no calibration is loaded for this model, and uncalibrated answers from KV are "
                                   f"often wrong: the branches' text is re-prefilled ({override}, or serve with "
                                   "--calibration)")
    if configured == "auto" and branches > verified_branches:
        checked = (f"verified to answer as text does only up to {verified_branches} branches" if verified_branches
                   else "not verified to answer as text does (`braid eval --verify`)")
        return pb.TRANSPORT_TEXT, (f"calibration {calibration} is {checked}; this request has {branches}: the "
                                   f"branches' text is re-prefilled ({override})")
    if configured == "auto" and verified_tokens and branch_limit > verified_tokens and not per_branch:
        return pb.TRANSPORT_TEXT, (f"calibration {calibration} was verified on branches of up to {verified_tokens} "
                                   f"tokens; this request's may reach {branch_limit} (worker max_tokens): the "
                                   f"branches' text is re-prefilled ({override}, or lower max_tokens)")
    if configured == "auto" and verified_placement and placement and placement != verified_placement:
        return pb.TRANSPORT_TEXT, (f"calibration {calibration} was verified at placement {verified_placement}; this "
                                   f"request asks for {placement}: the branches' text is re-prefilled ({override}, or "
                                   "leave placement unset)")
    with_calibration = f"; calibration {calibration}" if calibration else ""
    if configured == "auto" and verified_tokens and branch_limit > verified_tokens:
        with_calibration += (f"; a branch longer than the {verified_tokens} tokens it was verified on is read from "
                             "its text at synthesis")
    if colocated:
        return pb.TRANSPORT_LOCAL, f"colocated engines: KV is reused in place{with_calibration}"
    if configured != "auto":
        return (pb.Transport.Value(f"TRANSPORT_{configured.upper()}"),
                f"configured: kv_transport={configured}{with_calibration}")
    prefill_s = branch_tokens / prefill_tokens_per_s
    if link_bytes_per_s is None:
        return pb.TRANSPORT_GRPC, (f"no link measured yet; re-prefill of up to {branch_tokens} tokens would take "
                                   f"up to ~{1e3 * prefill_s:.0f} ms{with_calibration}")
    ship_s = kv_bytes / link_bytes_per_s
    if ship_s < prefill_s:
        return pb.TRANSPORT_GRPC, (f"shipping up to {_mb(kv_bytes)} at {link_bytes_per_s / 1e9:.2f} GB/s "
                                   f"(~{1e3 * ship_s:.0f} ms) beats re-prefill of up to {branch_tokens} tokens at "
                                   f"{prefill_tokens_per_s:.0f} tok/s (~{1e3 * prefill_s:.0f} ms){with_calibration}")
    return pb.TRANSPORT_TEXT, (f"re-prefill of up to {branch_tokens} tokens (~{1e3 * prefill_s:.0f} ms) beats "
                               f"shipping up to {_mb(kv_bytes)} at {link_bytes_per_s / 1e9:.2f} GB/s "
                               f"(~{1e3 * ship_s:.0f} ms)")


def per_branch_gate(requested: int, configured: str) -> bool:
    """Whether the synthesizer reads branches longer than the verified ones from their text: under `auto`, unless
    the client chose the transport itself (a client that asks for KV gets KV for every branch)."""
    return configured == "auto" and requested == pb.TRANSPORT_UNSPECIFIED


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"
