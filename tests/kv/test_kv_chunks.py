"""KV chunks: size limits, bit-identical reassembly, and refusal of corrupt or foreign chunks."""

import random

import pytest
import torch

from braid.kv.chunks import ChunkError, KVAssembler, iter_chunks
from braid.engine.errors import FingerprintMismatchError


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_bytes", [1 << 20, 3000, 100])  # whole, token-split, and layer-split
def test_round_trip_is_bit_identical(dtype, max_bytes):
    kv = torch.randn(3, 2, 2, 37, 16).to(dtype)
    chunks = [c for c, _ in iter_chunks("m1", "fp", kv, max_bytes=max_bytes, total_tokens=37)]
    assert all(len(c.data) <= max(max_bytes, kv[0, :, :, :1].numel() * kv.element_size()) for c in chunks)
    random.Random(0).shuffle(chunks)
    asm = KVAssembler("fp")
    for c in chunks:
        assert not asm.complete
        asm.add(c)
    assert asm.complete and asm.bytes_received == kv.numel() * kv.element_size()
    out = asm.tensor()
    assert out.dtype == dtype and torch.equal(out.view(torch.uint8), kv.view(torch.uint8))


def test_streaming_in_pieces_completes_when_length_known():
    kv = torch.randn(2, 2, 1, 10, 8)
    asm = KVAssembler("fp")
    for c, _ in iter_chunks("m", "fp", kv[:, :, :, :6], max_bytes=500):  # still decoding: length unknown
        asm.add(c)
    assert not asm.complete and asm.tokens_received == 6
    with pytest.raises(ChunkError, match="incomplete"):
        asm.tensor()
    for c, _ in iter_chunks("m", "fp", kv[:, :, :, 6:], token_start=6, total_tokens=10):
        asm.add(c)
    assert asm.complete and torch.equal(asm.tensor(), kv)


def test_corrupt_foreign_or_mixed_chunks_are_refused():
    kv = torch.randn(2, 2, 1, 4, 8)
    chunk, _ = next(iter_chunks("m", "fp", kv, total_tokens=4))
    bad = type(chunk)()
    bad.CopyFrom(chunk)
    bad.data = bytes([chunk.data[0] ^ 1]) + chunk.data[1:]
    with pytest.raises(ChunkError, match="checksum"):
        KVAssembler("fp").add(bad)
    with pytest.raises(FingerprintMismatchError, match="other-model"):
        KVAssembler("other-model").add(chunk)
    asm = KVAssembler("fp")
    asm.add(chunk)
    with pytest.raises(ChunkError, match="stream of 'm'"):
        asm.add(next(iter_chunks("n", "fp", kv, total_tokens=4))[0])


def test_linked_chunks_carry_no_data_and_verify_the_piece():
    kv = torch.randn(2, 2, 1, 5, 8)
    asm = KVAssembler("fp")
    for chunk, piece in iter_chunks("m", "fp", kv, max_bytes=200, total_tokens=5, link_id="L"):
        assert chunk.data == b"" and chunk.link_id == "L"
        asm.add(chunk, piece.clone())
    assert torch.equal(asm.tensor(), kv)
    chunk, piece = next(iter_chunks("m", "fp", kv, total_tokens=5, link_id="L"))
    with pytest.raises(ChunkError, match="checksum"):
        KVAssembler("fp").add(chunk, piece + 1)
