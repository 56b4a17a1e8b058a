"""Shipping a decoding branch's KV over a real gRPC stream, chunk by chunk, bit-identically."""

import zlib

import pytest

from cluster.kv_chunks import tensor_bytes
from cluster.kv_transport import KVReceiver, KVSender, TransferError
from engine import DecodeCall, PrefillCall, SamplingParams


def test_branch_kv_arrives_bit_identical_while_decoding(llama_engine):
    eng = llama_engine
    receiver = KVReceiver(eng.fingerprint)
    try:
        p, = eng.prefill([PrefillCall("User: add these.")])
        stream = eng.decode_stream([DecodeCall("Worker:", parents=[p], sampling=SamplingParams(
            max_tokens=20, ignore_eos=True))])
        sender = KVSender(receiver.address, "wf:0", "branch-0", eng.fingerprint, offset=eng.message(p).end,
                          max_chunk_bytes=700)
        shipped = 0
        for _ in stream:
            if stream.encoded(0) - shipped >= 4:
                toks, kv = stream.partial_kv(0, shipped, stream.encoded(0))
                sender.send(toks, kv, shipped)
                shipped = stream.encoded(0)
        msg = eng.message(stream.ids[0])
        toks, kv = stream.partial_kv(0, shipped, msg.num_tokens)
        sender.send(toks, kv, shipped, total_tokens=msg.num_tokens)
        ack = sender.close()
        got = receiver.wait("wf:0", timeout=10)
        assert ack.bytes == sender.bytes == got.bytes == msg.nbytes and ack.chunks > 3
        assert 0 < got.tail_bytes < got.bytes and got.tail_seconds >= 0
        assert got.token_ids == list(msg.token_ids) and got.offset == msg.offset
        assert zlib.crc32(tensor_bytes(got.kv)) == zlib.crc32(tensor_bytes(msg.kv))
    finally:
        receiver.stop()


def test_incomplete_or_foreign_streams_fail_cleanly(llama_engine):
    eng = llama_engine
    receiver = KVReceiver(eng.fingerprint)
    try:
        kv = eng.message(eng.prefill([PrefillCall("one two three")])[0]).kv
        half = KVSender(receiver.address, "s1", "m", eng.fingerprint, offset=0)
        half.send([1, 2], kv[:, :, :, :2], 0)  # total never announced
        with pytest.raises(TransferError, match="DATA_LOSS.*incomplete"):
            half.close()
        foreign = KVSender(receiver.address, "s2", "m", "another-model", offset=0)
        foreign.send([1], kv[:, :, :, :1], 0, total_tokens=1)
        with pytest.raises(TransferError, match="FAILED_PRECONDITION"):
            foreign.close()
        with pytest.raises(TransferError, match="did not arrive"):
            receiver.wait("never", timeout=0.1)
    finally:
        receiver.stop()
