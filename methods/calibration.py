"""The trained calibration of the cache path (Parallel-Synthesis): a cache mapper over branch KV and a synthesizer LoRA.

A calibration is a directory:

    calibration.json     the manifest: the base model's fingerprint and name, the mapper's and LoRA's shapes,
                         and how it was trained
    mapper.safetensors   the cache mapper's parameters
    adapter/             the synthesizer LoRA in peft's adapter format
    turns/               optional: the turn LoRA (peft's format, and turns.json, its own manifest), for agents
                         that speak after other agents' cached replies (braid.train.turns)
    verifications/       optional: named verifications (braid eval --verify --verification NAME), NAME.json each,
                         kept beside the manifest's own; a deployment trusts one with `verification: NAME`

It is bound to one base model. `attach(engine, path)` (or `load_engine(config)`, which builds the engine
and attaches its config's calibration) refuses another model's calibration with FingerprintMismatchError
(FAILED_PRECONDITION), adds its LoRAs to the engine as adapters (engine.Engine.add_adapter) and returns
`Attached`, whose SynthesisHooks name the synthesizer's adapter and map branch KV: only the calls that name
the adapter run on it, so workers and branch encodings always run the base weights, also on a colocated
engine that does both.
"""

import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from functools import cached_property, partial

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from braid.engine.config import (
    CALIBRATION_MANIFEST,
    OWN_VERIFICATION,
    EngineConfig,
    verification_file,
    verification_names,
)
from braid.engine.engine import Engine
from braid.engine.errors import BraidError, FingerprintMismatchError
from braid.engine.model import fingerprint_checkpoint
from braid.engine.threads import one_thread
from braid.methods.synthesis import Placement, Refresh, SynthesisHooks, refresh_of

log = logging.getLogger(__name__)

MANIFEST = CALIBRATION_MANIFEST
MAPPER_FILE = "mapper.safetensors"
ADAPTER_DIR = "adapter"
TURNS_DIR = "turns"
TURNS_MANIFEST = "turns.json"
FEATURES = 3  # [1, log1p(branch length) / 4, log1p(branch count) / 2]


@dataclass(frozen=True)
class MapperConfig:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rank: int = 0  # a low-rank residual on K and V per layer and head as well (0: affine only)
    conditioned: bool = True  # the affine terms also depend on the branch's length and the branch count
    branch_slots: int = 0  # a learned K and V shift per branch index (later indices share the last slot)

    def __post_init__(self):
        if min(self.num_layers, self.num_kv_heads, self.head_dim) <= 0 or self.head_dim % 2:
            raise ValueError(f"mapper shape must be positive with an even head_dim, got {self}")
        if self.rank < 0 or self.rank > self.head_dim:
            raise ValueError(f"mapper rank must be in 0..head_dim={self.head_dim}, got {self.rank}")
        if self.branch_slots < 0:
            raise ValueError(f"branch_slots must be >= 0, got {self.branch_slots}")


class CacheMapper(torch.nn.Module):
    """Per layer and KV head, a residual correction of placed (re-encoded) branch KV; the identity at init.

        K' = K * (1 + a_K) + b_K      a_K: one scale per rotary pair (i, i + D/2), so it commutes with RoPE
        V' = V * (1 + a_V) + b_V
        (+ X' += X U W per layer and head, when rank > 0; W starts at zero)

    Each of a_K, b_K, a_V, b_V is w0 + w1 * log1p(T) / 4 + w2 * log1p(m) / 2 (T the branch's length, m the
    branch count) when conditioned, else w0 alone. With branch_slots, K and V also get a learned shift for
    the branch's index j among the synthesizer's branches: each branch was encoded as if it were the only
    one, and this lets them differ as the text model's do. Every weight starts at zero. Implements methods.synthesis's
    CacheMapper protocol: `mapper(kv [L, 2, H, T, D], branch=j, num_branches=m)`.
    """

    def __init__(self, config: MapperConfig):
        super().__init__()
        self.config = c = config
        n = FEATURES if c.conditioned else 1
        half = c.head_dim // 2
        self.scale_k = torch.nn.Parameter(torch.zeros(n, c.num_layers, c.num_kv_heads, half))
        self.shift_k = torch.nn.Parameter(torch.zeros(n, c.num_layers, c.num_kv_heads, c.head_dim))
        self.scale_v = torch.nn.Parameter(torch.zeros(n, c.num_layers, c.num_kv_heads, c.head_dim))
        self.shift_v = torch.nn.Parameter(torch.zeros(n, c.num_layers, c.num_kv_heads, c.head_dim))
        if c.branch_slots:
            self.branch_k = torch.nn.Parameter(torch.zeros(c.branch_slots, c.num_layers, c.num_kv_heads, c.head_dim))
            self.branch_v = torch.nn.Parameter(torch.zeros(c.branch_slots, c.num_layers, c.num_kv_heads, c.head_dim))
        if c.rank:
            gen = torch.Generator().manual_seed(0)
            self.down = torch.nn.Parameter(torch.randn(c.num_layers, 2, c.num_kv_heads, c.head_dim, c.rank,
                                                       generator=gen) / math.sqrt(c.head_dim))
            self.up = torch.nn.Parameter(torch.zeros(c.num_layers, 2, c.num_kv_heads, c.rank, c.head_dim))

    def features(self, lengths: torch.Tensor, num_branches: torch.Tensor) -> torch.Tensor:
        """[N] branch lengths and counts -> [N, F] (F = 1 when unconditioned)."""
        ones = torch.ones_like(lengths, dtype=torch.float32)
        if not self.config.conditioned:
            return ones[:, None]
        return torch.stack([ones, torch.log1p(lengths.float()) / 4, torch.log1p(num_branches.float()) / 2], dim=1)

    def apply(self, kv: torch.Tensor, features: torch.Tensor, branches: torch.Tensor | None = None) -> torch.Tensor:
        """kv [N, L, 2, H, T, D], features [N, F], branches [N] (each one's index among the synthesizer's
        branches; used with branch_slots) -> mapped kv of the same shape and dtype, out of place (training)."""
        scale, shift = self.affine(features, branches)
        x = kv.float()
        out = x * scale + shift
        if self.config.rank:
            out = out + torch.einsum("nlshtd,lshdr,lshre->nlshte", x, self.down, self.up)
        return out.to(kv.dtype)

    def affine(self, features: torch.Tensor, branches: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The affine part as (scale, shift), each [N, L, 2, H, 1, D] fp32: kv * scale + shift."""
        mix = lambda w: torch.einsum("nf,flhd->nlhd", features.to(w), w)  # noqa: E731  [N, L, H, D']
        a_k = mix(self.scale_k)
        scale = torch.stack([1 + torch.cat([a_k, a_k], dim=-1), 1 + mix(self.scale_v)], dim=2)
        shift = torch.stack([mix(self.shift_k), mix(self.shift_v)], dim=2)
        if self.config.branch_slots:
            slot = branches.clamp(max=self.config.branch_slots - 1).to(shift.device)
            shift = shift + torch.stack([self.branch_k[slot], self.branch_v[slot]], dim=2)
        return scale[:, :, :, :, None, :], shift[:, :, :, :, None, :]

    @torch.no_grad()
    def forward(self, kv: torch.Tensor, *, branch: int = 0, num_branches: int = 1,
                length: int | None = None) -> torch.Tensor:
        """One branch's placed KV [L, 2, H, T, D], or a part of a branch of `length` tokens, mapped in place and
        returned (the engine's mapper seam: the engine passes its own placed copy, never stored KV). The map is
        the same for every token of a branch, so mapping a part is mapping the whole, then slicing. One pass
        over the KV."""
        device = kv.device
        f = self.features(torch.tensor([length or kv.shape[3]], device=device),
                          torch.tensor([num_branches], device=device))
        scale, shift = self.affine(f, torch.tensor([branch], device=device))
        if self.config.rank:
            low = torch.einsum("lshtd,lshdr,lshre->lshte", kv.float(), self.down, self.up)
        torch.addcmul(shift[0], kv, scale[0], out=kv)  # one pass: kv * scale + shift, in fp32, rounded once
        if self.config.rank:
            kv.add_(low.to(kv.dtype))
        return kv


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 16
    alpha: int = 32
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self):
        if self.rank <= 0 or self.alpha <= 0 or not self.targets:
            raise ValueError(f"LoRA rank and alpha must be positive and targets non-empty, got {self}")

    @classmethod
    def of(cls, rank: int, alpha: int, targets: str) -> "LoraSettings":
        """From a trainer's flags: `targets` comma-separated."""
        return cls(rank, alpha, tuple(t.strip() for t in targets.split(",") if t.strip()))

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=0.0, target_modules=list(self.targets),
                          bias="none")


@dataclass
class Calibration:
    """A calibration on the host: the mapper, the LoRA's location and settings, and the manifest."""

    mapper: CacheMapper
    lora: LoraSettings
    fingerprint: str  # of the base model it was trained on
    base_model: str  # that model's name, for messages
    path: str | None = None  # where it was loaded from (holds adapter/)
    record: dict | None = None  # how it was trained
    verification: dict | None = None  # how it compared with text answers (evals.harness.verify), when checked
    turns: dict | None = None  # the turn LoRA's manifest (TURNS_DIR/TURNS_MANIFEST), when it has one
    # which verification `verification` is: OWN_VERIFICATION, the manifest's; else one recorded beside it, by name
    verification_name: str = OWN_VERIFICATION

    @cached_property
    def digest(self) -> str:
        """A short hash of the mapper's and the LoRAs' weights (the turn LoRA's too, when it has one): which
        calibration encoded an output, and which one a result was measured with. Read once (attach reads it), so
        it outlives the files of a calibration written to a temporary directory."""
        h = hashlib.blake2b(digest_size=8)
        names = [MAPPER_FILE, os.path.join(ADAPTER_DIR, "adapter_model.safetensors")]
        if self.turns is not None:
            names.append(os.path.join(TURNS_DIR, "adapter_model.safetensors"))
        for name in names:
            with open(os.path.join(self.path, name), "rb") as f:
                h.update(f.read())
        return h.hexdigest()

    @property
    def verified_branches(self) -> int:
        """Up to how many branches a recorded `braid eval --verify` found its answers as good as text's
        (0: never verified, or not even at the fewest branches evaluated)."""
        return int((self.verification or {}).get("max_branches", 0))

    @property
    def verified_tokens(self) -> int:
        """The longest branch (tokens) the recorded verification checked; 0: not recorded (no length gate)."""
        return int((self.verification or {}).get("max_branch_tokens", 0))

    def verified_for(self, refresh: Refresh | None) -> int:
        """verified_branches, where the verification checked the mode served with this boundary refresh
        (mode_name(refresh)) on these weights; else 0: a check of another mode, or of other weights (a
        verification records the calibration's digest and its base model's fingerprint), says nothing of this."""
        v = self.verification or {}
        same = v.get("calibration", self.digest) == self.digest and v.get("base_fingerprint",
                                                                           self.fingerprint) == self.fingerprint
        return self.verified_branches if same and v.get("mode") == mode_name(refresh) else 0

    @property
    def verified_placement(self) -> str:
        """Where the verified mode placed the branches: as the verification records, else the placement the
        calibration was trained for (the one `braid eval --verify`'s calibrated modes run at)."""
        return (self.verification or {}).get("placement") or self.placement.value

    @property
    def refresh(self) -> Refresh | None:
        """The boundary refresh it was trained to read (`braid calibrate --refresh`, `--refresh-tail`; None: none),
        which the cache path serves it with unless the cluster config names another. One written untrained, with
        no training record, is served with the default refresh, a token at each end."""
        config = (self.record or {}).get("config")
        if config is None:
            return Refresh()
        return refresh_of(int(config.get("refresh", 0)), int(config.get("refresh_tail", -1)))

    @property
    def placement(self) -> Placement:
        """The placement it was trained for (the first, if several): the synthesizer's default with it."""
        trained = (self.record or {}).get("config", {}).get("placements", Placement.BRANCH_POINT.value)
        return Placement(trained.split(",")[0].strip())

    @property
    def adapter_path(self) -> str:
        if self.path is None:
            raise BraidError("this calibration was not saved or loaded from disk: it has no adapter directory")
        return os.path.join(self.path, ADAPTER_DIR)

    def save(self, path: str, peft_model) -> None:
        """Write the file set; `peft_model` is the trained PeftModel whose adapter is saved."""
        os.makedirs(path, exist_ok=True)
        save_file({k: v.detach().float().cpu().contiguous() for k, v in self.mapper.state_dict().items()},
                  os.path.join(path, MAPPER_FILE))
        peft_model.save_pretrained(os.path.join(path, ADAPTER_DIR))
        manifest = {"base_fingerprint": self.fingerprint, "base_model": self.base_model,
                    "mapper": asdict(self.mapper.config),
                    "lora": {**asdict(self.lora), "targets": list(self.lora.targets)},
                    "record": self.record or {},
                    **({"verification": self.verification}
                       if self.verification and self.verification_name == OWN_VERIFICATION else {})}
        with open(os.path.join(path, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        self.path = path

    def record_verification(self, verification: dict, name: str = OWN_VERIFICATION) -> str:
        """Store a verification (evals.harness.verify); the weights are untouched. `name`: OWN_VERIFICATION, the
        calibration's own, in its manifest (replacing the one there), which deployments trust by default; any other,
        its own file beside the manifest (verification_file: <calibration>/verifications/<name>.json, replacing one
        of that name), which a deployment trusts with `verification: <name>`, the manifest left as it is. Returns
        the file written; this object then holds it as its verification."""
        if self.path is None:
            raise BraidError("this calibration was not saved or loaded from disk: it has no manifest to update")
        if name == OWN_VERIFICATION:
            target = os.path.join(self.path, MANIFEST)
            with open(target) as f:
                content = json.load(f)
            content["verification"] = verification
        else:
            target, content = verification_file(self.path, name), verification
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target + ".tmp", "w") as f:
                json.dump(content, f, indent=1)
            os.replace(target + ".tmp", target)  # (whole or not at all)
        except OSError as e:
            raise ValueError(f"cannot record verification {name!r} in {target} ({e.strerror or e}): a verification "
                             f"is kept beside its calibration; copy {self.path} to a directory you can write "
                             "(cp -r) and verify and serve that copy") from None
        self.verification, self.verification_name = verification, name
        return target

    @classmethod
    def load(cls, path: str, verification: str = OWN_VERIFICATION) -> "Calibration":
        """The calibration at `path`, holding its verification `verification` (OWN_VERIFICATION: its manifest's;
        a name: the one recorded beside it, a ValueError naming it where there is none)."""
        manifest_path = os.path.join(path, MANIFEST)
        if not os.path.isfile(manifest_path):
            raise FileNotFoundError(f"calibration {path!r} has no {MANIFEST}; pass a directory written by "
                                    "`braid calibrate`")
        with open(manifest_path) as f:
            manifest = json.load(f)
        mapper = CacheMapper(MapperConfig(**manifest["mapper"]))
        mapper.load_state_dict(load_file(os.path.join(path, MAPPER_FILE)))
        lora = LoraSettings(**{**manifest["lora"], "targets": tuple(manifest["lora"]["targets"])})
        turns = None
        if os.path.isfile(os.path.join(path, TURNS_DIR, TURNS_MANIFEST)):
            with open(os.path.join(path, TURNS_DIR, TURNS_MANIFEST)) as f:
                turns = json.load(f)
        checked = manifest.get("verification")
        if verification != OWN_VERIFICATION:
            named = verification_file(path, verification)
            if not os.path.isfile(named):
                raise ValueError(f"verification {verification!r} is not recorded beside calibration {path} (no "
                                 f"{named}); recorded there: {', '.join(verification_names(path)) or 'none'} besides "
                                 f"{OWN_VERIFICATION!r}, the one in its manifest")
            with open(named) as f:
                checked = json.load(f)
        return cls(mapper.eval().requires_grad_(False), lora, manifest["base_fingerprint"], manifest["base_model"],
                   path, manifest.get("record"), checked, turns, verification)

    @property
    def turns_path(self) -> str | None:
        """The turn LoRA's directory, when this calibration has one."""
        return None if self.turns is None else os.path.join(self.path, TURNS_DIR)

    def check(self, fingerprint: str, model: str) -> None:
        """Refuse a model other than the one this calibration (and its turn LoRA) was trained on."""
        if self.turns is not None and self.turns.get("base_fingerprint") != self.fingerprint:
            raise FingerprintMismatchError(
                f"calibration {self.path}: its turn LoRA ({TURNS_DIR}/) was trained on model fingerprint "
                f"{self.turns.get('base_fingerprint')}, the calibration on {self.fingerprint}; train the turn LoRA "
                "again for this model with `braid calibrate-turns`, or remove it")
        if fingerprint != self.fingerprint:
            raise FingerprintMismatchError(
                f"calibration {self.path or '(unsaved)'} was trained on model {self.base_model} (fingerprint "
                f"{self.fingerprint}); this engine runs {model} (fingerprint {fingerprint}). Train one for this "
                "model with `braid calibrate`, or run without one (--calibration none)")


class MergedLora:
    """A LoRA (the synthesizer's, or the turn LoRA) switched by weight swaps: each adapted Linear gets a merged
    copy of its weight (W + scale * B A, computed once at load), put in place for the adapted forwards and the
    original put back after, so those forwards cost what the base model's do and the base weights are never
    touched (a merge and unmerge in place would drift them). It costs a copy of the adapted weights. An adapted
    row always reads the merged weight, so it gets the same values whatever else shares its forward.
    It is the adapter callable itself (`adapter(rows=None)`, see `active`). `name`: which of the peft model's
    adapters (default: its active one)."""

    def __init__(self, peft_model, name: str | None = None):
        from peft.tuners.lora import Linear as LoraLinear

        name = name or peft_model.active_adapter
        self.swaps: list[tuple[torch.nn.Module, torch.nn.Parameter, torch.nn.Parameter]] = []
        # Whether other calls' base-weight rows may share its forwards (the scheduler's mixing): only when every
        # adapted layer is a decoder layer's, whose input is [1, rows, in] (not lm_head's, run on chosen rows).
        self.mixes_rows = True
        with torch.no_grad():
            for path, module in peft_model.named_modules():
                if isinstance(module, LoraLinear) and name in module.lora_A:
                    self.mixes_rows &= ".layers." in path
                    base = module.get_base_layer()
                    delta = module.get_delta_weight(name).float()
                    merged = (base.weight.float() + delta).to(base.weight.dtype)  # rounded once
                    self.swaps.append((base, base.weight, torch.nn.Parameter(merged, requires_grad=False)))
        peft_model.base_model.disable_adapter_layers()  # the LoRA path itself stays off: the swaps replace it

    def __call__(self, rows: torch.Tensor | None = None):
        return self.active(rows)

    @contextmanager
    def active(self, rows: torch.Tensor | None = None) -> Iterator[None]:
        """The adapted weights for a forward's rows: all of them (the merged copies swapped in), or those `rows`
        (bool [rows]) marks, the others running the base weights (other calls' rows batched into the same
        forward by the scheduler, and the unstored prefill calls of the synthesizer's own request): each adapted
        Linear then runs each run of like rows through its own weight, merged or base (the scheduler puts the
        adapter's calls together, so there are a few)."""
        if rows is not None:
            # the rows as runs [start, end) of one kind (a few: the scheduler puts a forward's adapted calls together)
            starts = [0, *((rows[1:] != rows[:-1]).nonzero().squeeze(1) + 1).tolist()]
            runs = list(zip(starts, [*starts[1:], len(rows)], rows[starts].tolist()))
            try:
                for module, _, merged in self.swaps:
                    module.forward = partial(_linear_on_rows, module, merged, runs)
                yield
            finally:
                for module, _, _ in self.swaps:
                    module.__dict__.pop("forward", None)
            return
        try:
            for base, _, merged in self.swaps:
                base.weight = merged
            yield
        finally:
            for base, original, _ in self.swaps:
                base.weight = original


def _linear_on_rows(module: torch.nn.Module, merged: torch.Tensor, runs: list[tuple[int, int, bool]],
                    x: torch.Tensor) -> torch.Tensor:
    """x [1, rows, in] -> [1, rows, out]: each run [start, end) of rows through the merged weight where it is
    adapted, the base weight where not."""
    if x.dim() != 3 or x.shape[0] != 1 or runs[-1][1] != x.shape[1]:  # (e.g. lm_head as a target)
        raise BraidError(f"a LoRA on {type(module).__name__} got input of shape {tuple(x.shape)} in a forward "
                         "shared with base-weight rows; only the decoder's layers may be LoRA targets")
    out = [F.linear(x[0, a:b], merged if adapted else module.weight, module.bias) for a, b, adapted in runs]
    return (out[0] if len(out) == 1 else torch.cat(out))[None]


def served_refresh(attached: "Attached | None", refresh_tokens: int | None = None) -> Refresh | None:
    """The boundary refresh the cache path reads with: `refresh_tokens` at each end when it is set (0: none), else
    the one the attached calibration was trained with, else a token at each end (the uncalibrated default)."""
    if refresh_tokens is not None:
        return refresh_of(refresh_tokens)
    return attached.record.refresh if attached is not None else Refresh()


def mode_name(refresh: Refresh | None) -> str:
    """The evaluation's name for the calibrated cache path with this boundary refresh (braid eval --modes)."""
    if refresh is None or not (refresh.head or refresh.tail):
        return "calibrated"
    # (no comma: `--modes` and `--verify-mode` take comma-separated names; a sequential refresh, never trained or
    # served, is named apart so that no verification of the parallel one vouches for it)
    return ("calibrated+refresh" + ("" if refresh == Refresh() else f"{refresh.head}-{refresh.tail}")
            + ("-in-order" if refresh.sequential else ""))


@dataclass
class Attached:
    """A calibration attached to an engine (`attach`; the engine holds it as `Engine.calibration`): its record,
    its hooks, and the pieces for ablations."""

    record: Calibration
    peft_model: object
    hooks: SynthesisHooks  # mapper and LoRA
    turns: SynthesisHooks | None = None  # the turn LoRA (no mapper), when the calibration has one (methods.dag)

    def without(self, *, mapper: bool = False, lora: bool = False) -> SynthesisHooks:
        """The hooks with a part left out (for ablations)."""
        return SynthesisHooks(None if mapper else self.hooks.mapper, None if lora else self.hooks.adapter)


def load_engine(config: EngineConfig) -> Engine:
    """An engine for `config`, with the calibration it names attached (`Engine.calibration`); "none": none."""
    engine = Engine(config)
    path = engine.config.calibration  # (resolved: "auto" is the model's own, or none)
    if path != "none":
        # (on CPU, merged on one thread, as the engine loads its model: engine.threads)
        with one_thread() if engine.lm.device.type == "cpu" else nullcontext():
            attached = attach(engine, path, engine.config.verification)
        log.info("calibration %s attached (trained on %s; verification %s)", path, attached.record.base_model,
                 engine.config.verification)
    return engine


def fingerprints(engine: Engine) -> dict[str, str | None]:
    """What a result measured on `engine` was measured with, as `braid.results.write_json` takes it: the weights'
    fingerprint and the attached calibration's digest (None: none attached)."""
    attached = engine.calibration
    return {"model": engine.fingerprint, "calibration": attached.record.digest if attached else None}


def fingerprints_at(config: EngineConfig) -> dict[str, str | None]:
    """As `fingerprints`, for a result measured on engines in other processes (a server, a cluster) built from
    `config`: its checkpoint's fingerprint and its calibration's digest, without loading either."""
    calibration = config.resolved().calibration
    return {"model": fingerprint_checkpoint(config.model_path),
            "calibration": Calibration.load(calibration).digest if calibration != "none" else None}


def attach(engine: Engine, path: str, verification: str = OWN_VERIFICATION) -> Attached:
    """Load the calibration at `path` onto `engine` (checked against its model): its LoRA (and the turn LoRA,
    when it has one) become adapters of the engine, which the returned hooks name; the base weights stay as
    they are. It holds its verification `verification` (Calibration.load), which the synthesizer's gate reads."""
    from peft import PeftModel

    calibration = Calibration.load(path, verification)
    calibration.check(engine.fingerprint, engine.config.model_path)
    lm = engine.lm
    peft_model = PeftModel.from_pretrained(lm.model, calibration.adapter_path, is_trainable=False)
    peft_model.to(lm.device).eval()  # device only: a dtype cast would also round buffers such as RoPE's inv_freq
    turns = None
    if calibration.turns_path is not None:
        peft_model.load_adapter(calibration.turns_path, adapter_name=TURNS_DIR, is_trainable=False)
        peft_model.to(lm.device)
        with open(os.path.join(calibration.turns_path, "adapter_model.safetensors"), "rb") as f:
            digest = hashlib.blake2b(f.read(), digest_size=8).hexdigest()
        engine.add_adapter(f"turns:{digest}", MergedLora(peft_model, TURNS_DIR))
        turns = SynthesisHooks(None, f"turns:{digest}")
    adapter = f"calibrated:{calibration.digest}"
    engine.add_adapter(adapter, MergedLora(peft_model, "default"))
    attached = engine.calibration = Attached(calibration, peft_model,
                                            SynthesisHooks(calibration.mapper.to(lm.device), adapter), turns)
    return attached

