"""Shipping decoding branches' KV over a real gRPC stream, with payloads inline or on a gloo link."""

import zlib

import pytest

from braid.kv.chunks import tensor_bytes
from braid.kv.grpc_transport import KVReceiver, KVSender, TransferError, open_link
from braid.engine import DecodeCall, PrefillCall, SamplingParams
from braid.models.chat import WORKER_HEADER


def ship_two_branches(eng, receiver, sender):
    """Decode two branches in parallel, shipping every 4 encoded tokens; returns their messages."""
    p, = eng.prefill([PrefillCall("User: add these.")])
    stream = eng.decode_stream([DecodeCall(WORKER_HEADER, parents=[p], sampling=SamplingParams(
        max_tokens=n, ignore_eos=True)) for n in (20, 13)])
    offset = eng.message(p).end
    shipped = [0, 0]
    for event in stream:
        c = event.call
        if stream.encoded(c) - shipped[c] >= 4:
            toks, kv = stream.partial_kv(c, shipped[c], stream.encoded(c))
            sender.send(f"wf:{c}", f"b{c}", offset, toks, kv, shipped[c])
            shipped[c] = stream.encoded(c)
    messages = [eng.message(m) for m in stream.ids]
    for c, msg in enumerate(messages):
        toks, kv = stream.partial_kv(c, shipped[c], msg.num_tokens)
        sender.send(f"wf:{c}", f"b{c}", offset, toks, kv, shipped[c], total_tokens=msg.num_tokens)
    return messages, sender.close()


@pytest.mark.parametrize("collective", [False, True], ids=["grpc", "gloo"])
def test_branch_kv_arrives_bit_identical_while_decoding(llama_engine, collective):
    eng = llama_engine
    receiver = KVReceiver(eng.fingerprint)
    try:
        link = open_link(receiver.address, "worker-1", "gloo") if collective else None
        sender = KVSender(receiver.address, eng.fingerprint, max_chunk_bytes=700, link=link,
                          link_id="worker-1" if collective else "")
        messages, ack = ship_two_branches(eng, receiver, sender)
        assert ack.bytes == sender.bytes == sum(m.nbytes for m in messages) and ack.chunks > 6
        for c, msg in enumerate(messages):
            got = receiver.wait(f"wf:{c}", timeout=10)
            assert got.bytes == msg.nbytes and 0 < got.tail_bytes < got.bytes and got.tail_seconds >= 0
            assert got.token_ids == list(msg.token_ids) and got.offset == msg.offset
            assert zlib.crc32(tensor_bytes(got.kv)) == zlib.crc32(tensor_bytes(msg.kv))
    finally:
        receiver.stop()


def test_incomplete_or_foreign_streams_fail_cleanly(llama_engine):
    eng = llama_engine
    receiver = KVReceiver(eng.fingerprint)
    try:
        kv = eng.message(eng.prefill([PrefillCall("one two three")])[0]).kv
        half = KVSender(receiver.address, eng.fingerprint)
        half.send("s1", "m", 0, [1, 2], kv[:, :, :, :2], 0)  # total never announced
        with pytest.raises(TransferError, match="DATA_LOSS.*incomplete"):
            half.close()
        foreign = KVSender(receiver.address, "another-model")
        foreign.send("s2", "m", 0, [1], kv[:, :, :, :1], 0, total_tokens=1)
        with pytest.raises(TransferError, match="FAILED_PRECONDITION"):
            foreign.close()
        unknown_link = KVSender(receiver.address, eng.fingerprint)
        unknown_link.link_id = "never-opened"
        unknown_link.send("s3", "m", 0, [1], kv[:, :, :, :1], 0, total_tokens=1)
        with pytest.raises(TransferError, match="never opened"):
            unknown_link.close()
        with pytest.raises(TransferError, match="did not arrive"):
            receiver.wait("never", timeout=0.1)
        assert "never" not in receiver._streams  # a timed-out stream is not kept
    finally:
        receiver.stop()
