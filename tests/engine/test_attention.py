"""engine.attention's attention in place: FlexAttention over the KV pool through page tables, against SDPA over the
same keys gathered out of the pool."""

import pytest
import torch
import torch.nn.functional as F

from braid.engine.attention import paged_attention, paged_mask


def _gathered(query, kv, slots, counts, mask, scale):
    """The reference: each group's keys gathered out of the pool, SDPA with the same mask (fp32)."""
    out = torch.zeros_like(query)
    for g, n in enumerate(counts):
        k, v = kv[0][:, slots[g, :n]][None], kv[1][:, slots[g, :n]][None]
        out[g] = F.scaled_dot_product_attention(query[g:g + 1], k, v, attn_mask=mask[g, :, :n][None, None],
                                                scale=scale, enable_gqa=True)[0]
    return out


@pytest.mark.parametrize("rows", [1, 5, 200])  # (200: several query blocks of the block mask)
def test_attention_in_place_matches_sdpa_over_gathered_keys(rows):
    """Groups whose keys lie anywhere in the pool, in any order: blocks out of order, a block two groups share, a
    parent's partial block, a block listed that holds none of the group's keys (a block handed back), padded key
    lists; GQA. Every row sees at least its first key (as every engine row sees itself)."""
    torch.manual_seed(0)
    b, blocks, hkv, h, d = 4, 40, 2, 4, 8
    kv = torch.randn(2, hkv, (blocks + 1) * b, d)
    pages = [[7, 3, 30, 12], [12, 5, 6, 31, 33], [20, 21, 22]]  # 12 in two groups (a shared parent's block)
    keys = [
        [28, 29, 30, 31, 12, 13, 14, 120, 121, 48],  # (block 3 partly; block 30 listed, none of its slots read)
        [48, 49, 50, 20, 21, 22, 23, 24, 124, 125, 126, 127, 132],
        list(range(80, 92)),
    ]
    counts = [len(k) for k in keys]
    t = max(counts)
    trash = blocks * b
    slots = torch.tensor([k + [trash] * (t - len(k)) for k in keys])
    inside = torch.arange(t)[None, :] < torch.tensor(counts)[:, None]
    mask = (torch.rand(3, rows, t) > 0.4) & inside[:, None, :]
    mask[:, :, 0] = True
    query = torch.randn(3, h, rows, d)
    paged = paged_mask(pages, slots, inside, mask, b)
    got = paged_attention(query, kv, paged, 0.3)
    want = _gathered(query, kv, slots, counts, mask, 0.3)
    assert (got - want).abs().max() < 1e-5
    assert paged.window == slice(3 * b, 34 * b)  # (only the blocks some group lists: the trash block is not read)


def test_one_group_needs_no_padding():
    """One group, its keys a view of its cache's slots (no `inside`): what a prefill chunk's attention takes."""
    torch.manual_seed(1)
    b, h, d = 8, 2, 16
    kv = torch.randn(2, h, 20 * b, d)
    keys = list(range(40, 64)) + list(range(8, 13))
    slots = torch.tensor([keys])
    mask = torch.ones(1, 6, len(keys), dtype=torch.bool).tril(diagonal=len(keys) - 6)
    query = torch.randn(1, h, 6, d)
    got = paged_attention(query, kv, paged_mask([[5, 6, 7, 1]], slots, None, mask, b), None)
    assert (got - _gathered(query, kv, slots, [len(keys)], mask, d ** -0.5)).abs().max() < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn runs on CUDA")
def test_flash_attn_where_installed_matches_sdpa():
    """With flash-attn installed (the `gpu` extra), a plain causal group (one call that sees its whole cache, no
    mask) runs flash-attn's bottom-right-aligned causal kernel: against SDPA with the same rule as a boolean mask,
    in bf16, GQA, with more keys than queries (a chunk after a cached context)."""
    pytest.importorskip("flash_attn")
    from braid.engine.attention import attention_forward, use_flash

    assert use_flash(torch.device("cuda"), torch.bfloat16)
    torch.manual_seed(0)
    q = torch.randn(1, 8, 37, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 100, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    got = attention_forward(None, q, k, v, None, scaling=0.125)[0]  # [1, Q, H, D]
    causal = torch.ones(37, 100, dtype=torch.bool, device="cuda").tril(diagonal=100 - 37)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=causal, scale=0.125,
                                          enable_gqa=True).transpose(1, 2)
    assert (got.float() - want).abs().max() < 2e-2
