"""Compute kernels shared by the engine: RoPE re-rotation (torch and Triton)."""

from braid.kernels.rope import rerotate_keys, rerotate_keys_, rerotate_keys_torch

__all__ = ["rerotate_keys", "rerotate_keys_", "rerotate_keys_torch"]
