"""kernels.paged_decode: decode attention read from the KV pool through slot tables, against SDPA over the same
keys gathered (engine.attention.decode_attention), as the shared decode attention runs it."""

import pytest
import torch

from braid.engine.attention import decode_attention
from braid.kernels.paged_decode import paged_decode_attention


def case(g, h, hkv, r, t, d, slots_in_pool, seed, dtype=torch.float32, device="cpu"):
    """A pool with more slots than the keys read, each request's keys at scattered slots, and masks in which some
    rows see only some keys (a padding row of the last request: none)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(2, hkv, slots_in_pool, d, generator=gen).to(device, dtype)
    slots = torch.stack([torch.randperm(slots_in_pool, generator=gen)[:t] for _ in range(g)]).to(device)
    mask = torch.rand(g, 1, r, t, generator=gen) < 0.7
    mask[..., 0] = True  # (every real row sees a key)
    mask[-1, 0, -1] = False  # (the last request's last row: a padding row that sees none)
    query = torch.randn(g, h, r, d, generator=gen).to(device, dtype)
    return query, pool, slots, mask.to(device)


def gathered(query, pool, slots, mask, scale):
    g, t = slots.shape
    kv = pool.index_select(2, slots.flatten()).view(2, pool.shape[1], g, t, pool.shape[3]).transpose(1, 2)
    return decode_attention(query, kv[0], kv[1], mask, scale)


@pytest.mark.parametrize("g, h, hkv, r, t, d", [(3, 4, 2, 1, 37, 16), (2, 4, 4, 3, 70, 32), (4, 8, 2, 8, 16, 16),
                                                (1, 2, 1, 2, 200, 64)])
def test_it_equals_sdpa_over_the_gathered_keys(g, h, hkv, r, t, d):
    """fp32: every row that sees a key gets SDPA's output over the gathered keys within fp32 rounding, whatever
    the GQA ratio, rows per request, and key count (more than a tile, or not a multiple of one); a row that sees
    none gives zeros, and nothing is NaN."""
    query, pool, slots, mask, = case(g, h, hkv, r, t, d, 3 * t + 5, seed=g * 100 + t)
    scale = d ** -0.5
    got = paged_decode_attention(query, pool, slots, mask, scale, block_n=32)
    want = gathered(query, pool, slots, mask, scale)
    seen = mask[:, 0].any(-1)  # [G, R]
    rows = seen[:, None, :].expand(g, h, r)
    torch.testing.assert_close(got[rows], want[rows], rtol=1e-5, atol=1e-5)
    assert not got.isnan().any() and (got[~rows] == 0).all()


def test_a_mismatched_pool_is_refused_naming_the_shapes():
    query, pool, slots, mask = case(2, 4, 2, 1, 8, 16, 20, seed=1)
    with pytest.raises(ValueError, match=r"queries \(2, 3, 1, 16\), pool \(2, 2, 20, 16\)"):
        paged_decode_attention(query[:, :3], pool, slots, mask, 0.25)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 on the GPU")
def test_bf16_on_cuda_is_the_fp32_result_rounded():
    """bf16 on CUDA, as the engine serves: within bf16 rounding of the fp32 computation over the same keys, and no
    further from it than SDPA over the gathered bf16 keys is."""
    query, pool, slots, mask = case(8, 32, 8, 1, 1000, 128, 4096, seed=3, dtype=torch.bfloat16, device="cuda")
    scale = 128 ** -0.5
    exact = gathered(query.float(), pool.float(), slots, mask, scale)
    got = paged_decode_attention(query, pool, slots, mask, scale).float()
    sdpa = gathered(query, pool, slots, mask, scale).float()
    assert (got - exact).abs().max() <= max(2 * (sdpa - exact).abs().max().item(), 1e-2)
