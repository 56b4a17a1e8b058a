"""Loading a Hugging Face RoPE decoder-only checkpoint from a local directory."""

import contextlib
import glob
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from braid.engine import attention
from braid.engine.config import EngineConfig

log = logging.getLogger(__name__)

# Rope types whose inv_freq is fixed, so re-rotation by a position delta is exact.
# Dynamic types recompute frequencies from the sequence length: a key's rotation
# then depends on when it was encoded, and cannot be moved by a pure rotation.
REROTATABLE_ROPE = {"default", "linear", "llama3", "yarn"}
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")


@dataclass
class ModelSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int  # largest position + 1 any token may take
    rope_type: str
    eos_token_ids: tuple[int, ...]


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    spec: ModelSpec
    inv_freq: torch.Tensor  # fp32 [head_dim / 2] on the model's device
    fingerprint: str
    device: torch.device
    dtype: torch.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's keys and values over every layer: what a message costs per token, pooled, stored or shipped."""
        s = self.spec
        return s.num_layers * 2 * s.num_kv_heads * s.head_dim * self.dtype.itemsize


FINGERPRINT_CACHE_MIN_BYTES = 1 << 30  # checkpoints this large keep their fingerprint in the cache file


def fingerprint_cache_path() -> str:
    """Where fingerprints of large checkpoints are kept: $BRAID_CACHE_DIR, else $XDG_CACHE_HOME/braid, else
    ~/.cache/braid; fingerprints.json in it."""
    root = os.environ.get("BRAID_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "braid")
    return os.path.join(root, "fingerprints.json")


def fingerprint_checkpoint(path: str, chunk: int = 16 << 20) -> str:
    """blake2b over config.json and every weight file, in name order.

    Hashing an 8B checkpoint reads 16 GB (30 s on the H200 machine), at every engine start. So for checkpoints
    of FINGERPRINT_CACHE_MIN_BYTES or more the result is kept in fingerprint_cache_path(), keyed by each file's
    absolute path, device, inode, size, and modification and change times (as git's index trusts a file
    unchanged; the change time is set by the kernel, so even a copy that keeps the modification time is
    hashed again). A cache that cannot be read or written is ignored. Two engines writing it at once may each
    keep only their own entry: the other is hashed again at its next start."""
    files = [os.path.join(path, "config.json")]
    for pattern in WEIGHT_PATTERNS:
        files += sorted(glob.glob(os.path.join(path, pattern)))
    stats = [os.stat(f) for f in files]
    total = sum(st.st_size for st in stats)
    key = json.dumps([[os.path.abspath(f), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
                      for f, st in zip(files, stats)])
    kept = total >= FINGERPRINT_CACHE_MIN_BYTES
    cached = _cached_fingerprints() if kept else {}
    if isinstance(cached.get(key), str):
        return cached[key]
    h = hashlib.blake2b(digest_size=16)
    with tqdm(total=total, unit="B", unit_scale=True, desc="fingerprint", disable=total < (1 << 30)) as bar:
        for f in files:
            h.update(os.path.basename(f).encode())
            with open(f, "rb") as fh:
                while block := fh.read(chunk):
                    h.update(block)
                    bar.update(len(block))
    fingerprint = h.hexdigest()
    if kept:
        _cache_fingerprint(key, fingerprint)
    return fingerprint


def _cached_fingerprints() -> dict[str, str]:
    try:
        with open(fingerprint_cache_path()) as f:
            cached = json.load(f)
        return cached if isinstance(cached, dict) else {}
    except (OSError, ValueError):
        return {}


def _cache_fingerprint(key: str, value: str) -> None:
    """Add one entry, replacing the file whole (a reader never sees half of it)."""
    path, tmp = fingerprint_cache_path(), None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        mine = _config_of(key)  # (one entry per checkpoint: a rewritten one replaces its old entry, and entries
        # of checkpoints that are gone are dropped)
        cached = {k: v for k, v in _cached_fingerprints().items()
                  if (c := _config_of(k)) is not None and c != mine and os.path.exists(c)}
        cached[key] = value
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".fingerprints-")
        with os.fdopen(fd, "w") as f:
            json.dump(cached, f)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        log.warning("could not keep the checkpoint fingerprint in %s: %s", path, e)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _config_of(key: str) -> str | None:
    """The config.json path a cache key starts with (None for an entry this code did not write)."""
    try:
        path = json.loads(key)[0][0]
    except (ValueError, IndexError, TypeError, KeyError):
        return None
    return path if isinstance(path, str) else None


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple)) else (int(ids),)


def _max_positions(cfg) -> int:
    limit = cfg.max_position_embeddings
    # Sliding-window layers would drop keys older than the window; the engine's
    # masks do not model that, so contexts are kept within the window instead.
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None) or []
    uses_window = "sliding_attention" in layer_types or (cfg.model_type == "mistral" and window)
    return min(limit, window) if uses_window and window else limit


def load_model(config: EngineConfig) -> LoadedModel:
    device = torch.device(config.device)
    log.info("loading %s (%s on %s)", config.model_path, config.dtype, device)
    model = AutoModelForCausalLM.from_pretrained(
        config.model_path, dtype=config.torch_dtype, attn_implementation=attention.NAME
    ).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(config.model_path)
    cfg = model.config
    rotary = model.model.rotary_emb
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in REROTATABLE_ROPE:
        raise ValueError(f"rope_type {rope_type!r} in {config.model_path} cannot be re-rotated exactly; "
                         f"supported: {sorted(REROTATABLE_ROPE)}")
    head_dim = model.model.layers[0].self_attn.head_dim
    inv_freq = rotary.inv_freq.to(device=device, dtype=torch.float32)
    if 2 * inv_freq.numel() != head_dim:
        raise ValueError(f"partial rotary embeddings (rotary dim {2 * inv_freq.numel()} < head_dim {head_dim}) "
                         "are not supported")
    spec = ModelSpec(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        vocab_size=cfg.vocab_size,
        max_positions=_max_positions(cfg),
        rope_type=rope_type,
        eos_token_ids=_eos_ids(model, tokenizer),
    )
    return LoadedModel(model, tokenizer, spec, inv_freq, fingerprint_checkpoint(config.model_path),
                       device, config.torch_dtype)
