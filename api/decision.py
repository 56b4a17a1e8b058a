"""Ship KV or re-prefill text: decided per request from measured numbers."""

from braid.protos import agent_pb2 as pb


def choose_transport(requested: int, configured: str, kv_bytes: int, branch_tokens: int,
                     link_bytes_per_s: float | None, prefill_tokens_per_s: float) -> tuple[int, str]:
    """(transport, reason). Shipping wins when moving the KV takes less time than re-prefilling its text."""
    if requested in (pb.TRANSPORT_TEXT, pb.TRANSPORT_GRPC, pb.TRANSPORT_COLLECTIVE):
        return requested, "requested by the client"
    if configured != "auto":
        return pb.Transport.Value(f"TRANSPORT_{configured.upper()}"), f"configured: kv_transport={configured}"
    prefill_s = branch_tokens / prefill_tokens_per_s
    if link_bytes_per_s is None:
        return pb.TRANSPORT_GRPC, f"no link measured yet; re-prefill would take ~{1e3 * prefill_s:.0f} ms"
    ship_s = kv_bytes / link_bytes_per_s
    if ship_s < prefill_s:
        return pb.TRANSPORT_GRPC, (f"ship {kv_bytes / 1e6:.1f} MB at {link_bytes_per_s / 1e9:.2f} GB/s "
                                   f"(~{1e3 * ship_s:.0f} ms) beats re-prefill of {branch_tokens} tokens at "
                                   f"{prefill_tokens_per_s:.0f} tok/s (~{1e3 * prefill_s:.0f} ms)")
    return pb.TRANSPORT_TEXT, (f"re-prefill of {branch_tokens} tokens (~{1e3 * prefill_s:.0f} ms) beats shipping "
                               f"{kv_bytes / 1e6:.1f} MB at {link_bytes_per_s / 1e9:.2f} GB/s (~{1e3 * ship_s:.0f} ms)")
