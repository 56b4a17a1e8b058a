"""Repositioning: keys re-rotated from p to q equal keys encoded at q, for every supported rope type."""

import pytest
import torch

from braid.engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
from braid.kernels import rerotate_keys_torch
from braid.kernels.rope_triton import rerotate_keys_triton

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
}


@pytest.fixture(scope="module", params=list(ROPES))
def rope_engine(request, checkpoint):
    eng = Engine(EngineConfig(checkpoint("llama", rope_parameters=ROPES[request.param])))
    assert eng.spec.rope_type == request.param
    if request.param == "yarn":  # the case where forgetting attention_scaling would show
        assert eng.lm.model.model.rotary_emb.attention_scaling != 1.0
    return eng


@pytest.mark.parametrize("p,q", [(7, 300), (300, 7), (0, 2000), (1500, 1501)])
def test_repositioned_keys_equal_encoding_at_target(rope_engine, p, q):
    eng = rope_engine
    text = "Each branch writes a partial result; the final answer adds them."
    at_p, at_q = eng.prefill([PrefillCall(text, new_offset=p), PrefillCall(text, new_offset=q)])
    src, ref = eng.message(at_p), eng.message(at_q)
    stored = src.kv.read().clone()
    delta = torch.full((src.num_tokens,), q - p, dtype=torch.long, device=src.kv.read().device)
    moved = rerotate_keys_torch(src.kv.read()[:, 0], delta, eng.lm.inv_freq)
    assert (moved - ref.kv.read()[:, 0]).abs().max() < 1e-4
    src_v, ref_v = src.kv.read()[:, 1], ref.kv.read()[:, 1]
    assert torch.equal(src_v, ref_v) or (src_v - ref_v).abs().max() < 1e-5
    # Through the engine: attending to the message placed at q equals attending to it encoded at q.
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    via_move, via_ref = eng.decode([DecodeCall("Answer:", parents=[at_p], offsets=[q], sampling=greedy),
                                    DecodeCall("Answer:", parents=[at_q], offsets=[q], sampling=greedy)])
    assert eng.message(via_move).token_ids == eng.message(via_ref).token_ids
    assert (eng.message(via_move).kv.read() - eng.message(via_ref).kv.read()).abs().max() < 1e-4
    assert torch.equal(src.kv.read(), stored)  # stored KV is never mutated by placement


def test_rotation_without_attention_scaling_error_is_large(checkpoint):
    """Sanity check that the test above can fail: skipping the re-rotation is far off."""
    eng = Engine(EngineConfig(checkpoint("llama", rope_parameters=ROPES["yarn"])))
    a, b = eng.prefill([PrefillCall("one two three four", new_offset=5), PrefillCall("one two three four",
                                                                                     new_offset=400)])
    assert (eng.message(a).kv.read()[:, 0] - eng.message(b).kv.read()[:, 0]).abs().max() > 1e-2


# Both compute in fp32 (cos/sin of angles up to 5000 rad differ by ~1e-7 between libms) and round
# once to the output dtype, so bf16 results may differ by one rounding step.
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-3, 2**-7)])
def test_triton_rerotation_equals_torch(dtype, atol, rtol):
    torch.manual_seed(0)
    head_dim, tokens = 64, 100  # tokens not a multiple of the block: exercises the masks
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (compiled on a GPU, interpreted on CPU)
    keys = torch.randn(2, 3, tokens, head_dim).to(dtype).to(device)
    delta = torch.randint(-5000, 5000, (tokens,)).to(device)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))).to(device)
    got = rerotate_keys_triton(keys, delta, inv_freq)
    want = rerotate_keys_torch(keys, delta, inv_freq)
    assert got.dtype == dtype and got.shape == keys.shape
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rerotation_in_place_equals_the_copy(dtype):
    """rerotate_keys_ (the engine's, on a placed copy it owns: the keys of a [L, 2, H, T, D] tensor, strided)
    rotates in place exactly as rerotate_keys makes a new tensor, and leaves the values alone; the differentiable
    path (keys that need a gradient) agrees with the one without to fp32 rounding."""
    from braid.kernels import rerotate_keys, rerotate_keys_

    torch.manual_seed(0)
    kv = torch.randn(2, 2, 3, 50, 64).to(dtype)
    delta = torch.randint(-3000, 3000, (50,))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    want, values = rerotate_keys(kv[:, 0], delta, inv_freq), kv[:, 1].clone()
    assert rerotate_keys_(kv[:, 0], delta, inv_freq).data_ptr() == kv.data_ptr()
    assert torch.equal(kv[:, 0], want) and torch.equal(kv[:, 1], values)
    grad = rerotate_keys_torch(want.float().requires_grad_(), delta, inv_freq)
    assert grad.requires_grad
    torch.testing.assert_close(grad, rerotate_keys_torch(want.float(), delta, inv_freq), atol=1e-5, rtol=1e-5)
