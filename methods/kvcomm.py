"""KVComm: reuse a shared text's KV under each agent's own prefix, offset by interpolated anchors.

An agent's prompt is its fixed role prefix, then placeholders (texts that change per request: the user's
text, other agents' replies), each followed by a fixed join; the last join opens the agent's reply and is
the decode header. Dense prefill encodes every placeholder and join after the prefix. KVComm instead starts
from each placeholder's *base* KV (the text encoded on its own behind a base prefix, once per replica through
the prefix cache) and adds the offset it would have under this agent's prefix, interpolated from *anchors*:
earlier texts of the same placeholder whose real KV under this agent was measured. The join after a
placeholder gets the same treatment (its own base KV plus the anchors' join offsets).

The base prefix is the prompt's `base_prefix`: in an agent graph, the first agent's role prefix (the paper's
base is the text "under its initial context"; its code encodes it behind a role header). Agents' prompts
share a template, so offsets between two of them are small next to offsets from a bare context: on the
reference task a fifth to a third as large, with half the interpolation error per layer, and fewer answers
lost for the reuse (evals/kvcomm_quality.py measures it). The first agent's prompt is
the base itself: it prefills the text, which the others then find in the prefix cache. Anchors are kept
per base prefix.

Keys are compared and offset in frame 0: every key de-rotated to position 0 (`kernels.rerotate_keys`), then
rotated to where it goes. Values carry no position and are offset directly. Braid matches per token: each
token of a new text interpolates the offsets of the pool's tokens whose base KV is nearest its own, where
the paper aligns texts by index (on the reference task this leaves half the residual offset error).

One pool per (scope, placeholder, base prefix); `scope` keeps tenants apart (a request only ever matches
anchors made by requests of its own scope). An anchor holds the base KV of its text (also its embedding), its
length, a use count, and per agent the offset of the placeholder and of the join after it.

- prediction: a text is shareable for an agent when the pool holds an anchor at least as long as it with
  that agent's offsets, and the mean over its tokens of the entropy of w = softmax(-d / temperature) is at
  most gamma * log(#pool tokens) (d: L2 distance between a token's base KV and each pool token's, over
  layers, K/V, heads and dims, relative to the text's mean token norm). An anchor holding the text itself
  is used alone: it is its measured KV.
- fallback: a text that is not shareable is prefilled densely; its measured offsets fill in a new anchor
  (or the agent's part of the anchor that already holds the text).
- pruning: a pool never exceeds `capacity`; the least used of its `EARLIEST` oldest anchors goes.

gamma = 0 or capacity = 0 turns reuse off: every prompt is dense prefill, exactly.
"""

import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from braid.engine.engine import DecodeCall, DecodeStream, Engine, PrefillCall, Tokens
from braid.engine.errors import BraidError, PreconditionError
from braid.engine.sampling import SamplingParams
from braid.kernels import rerotate_keys
from braid.methods.synthesis import Refresh, Runs, refresh_branches

log = logging.getLogger(__name__)
EARLIEST = 5  # pruning looks at this many of the oldest anchors and drops the least used of them
SKETCH = 128  # token embedding size: a fixed random projection of a token's base KV (all layers, K and V)
TOP_K = 8  # a token interpolates from the TOP_K pool tokens nearest it (on the reference task 16 left a per-layer
# error within 0.6% of 8's, at twice the gathering)
SKETCH_CACHE = 256  # recent texts whose sketches are kept (every agent of a round reads the same texts)
ENTROPY_SAMPLE = 128  # tokens of a text the entropy criterion is estimated on (evenly spaced)
EXPORT_FORMAT = 2  # of `export`'s state: 2 keys pools by their base prefix
RECOMPUTE_WINDOWS = 64  # `recompute` picks whole windows of a context cut into at most this many (a context of
# up to 64 tokens: single tokens)


@dataclass(frozen=True)
class KVCommConfig:
    # entropy threshold, as a fraction of log(#pool tokens); 0: never reuse. KVComm's 0.3 is for its own
    # per-text weights; Braid's are per token, which reuse little at 0.3 (chosen on development seeds 9000-9039
    # of the reference task with evals/kvcomm_quality.py's sweep)
    gamma: float = 0.5
    capacity: int = 20  # V: anchors per pool; 0: never reuse
    # of the softmax over distances between a token's base KV and the pool's tokens', relative to the text's
    # mean token norm; lower: nearer to one nearest token (more reuse, larger errors)
    temperature: float = 0.05
    # a reused context re-encodes this many tokens at each end with the agent's prefix in view
    # (methods.synthesis.Refresh); 0: none, the paper's method as it is
    refresh: int = 0
    # and this fraction of its tokens, those whose interpolated offsets are least certain (the widest spread of
    # the anchor tokens they interpolate from), each with the prefix and the context before it in view; 0: none,
    # the paper's method as it is (chosen on held-out seeds with evals/kvcomm_quality.py, on the reference task and on a
    # harder setting of 8 agents and 5 questions)
    recompute: float = 0.2

    def __post_init__(self):
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"kvcomm gamma must be in [0, 1], got {self.gamma}")
        if not isinstance(self.capacity, int) or self.capacity < 0:
            raise ValueError(f"kvcomm capacity must be an int >= 0, got {self.capacity!r}")
        if not self.temperature > 0:
            raise ValueError(f"kvcomm temperature must be > 0, got {self.temperature}")
        if not isinstance(self.refresh, int) or self.refresh < 0:
            raise ValueError(f"kvcomm refresh must be an int >= 0, got {self.refresh!r}")
        if not 0 <= self.recompute <= 1:
            raise ValueError(f"kvcomm recompute must be a fraction in [0, 1], got {self.recompute}")

    @property
    def enabled(self) -> bool:
        return self.gamma > 0 and self.capacity > 0


@dataclass
class AgentPrompt:
    """One agent's prompt: prefix, then (placeholder, text) slots, each followed by its join.
    joins[-1] is the decode header (non-empty); joins before it may be empty."""

    agent: str  # whose offsets the anchors keep (one role template)
    prefix: Tokens
    slots: Sequence[tuple[str, Tokens]]
    joins: Sequence[Tokens]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # what each placeholder's base KV is encoded behind: the prefix of a reference agent of the same template
    # (an agent graph's first agent); None: the KVComm's own base_prefix
    base_prefix: Tokens | None = None


@dataclass(frozen=True)
class SlotDecision:
    placeholder: str
    tokens: int
    reused: bool
    anchors: tuple[tuple[int, float], ...] = ()  # (anchor id, mean weight) interpolated from, when reused
    new_anchor: bool = False  # its measured offsets started a new anchor


@dataclass
class Prepared:
    """What `KVComm.prepare` built: decode `header` after `parents` (prefix message, context message)."""

    parents: list[str]
    header: list[int]
    slots: list[SlotDecision]
    seconds: float  # preparing: reuse or dense prefill, offsets included
    held: list[str] = field(default_factory=list)  # stored for the parents' sake (a refreshed context's whole)

    @property
    def reused(self) -> bool:
        return all(s.reused for s in self.slots)

    @property
    def owned(self) -> list[str]:
        """Every message it stored: what `KVComm.free` frees."""
        return [*self.parents, *self.held]


@dataclass(eq=False)
class Anchor:
    """A placeholder text whose offsets were measured. Offsets are token-major [T, L*2*H*D] fp32 rows of
    frame-0 KV (every key de-rotated to position 0): what `features` makes of a KV tensor."""

    id: int
    tokens: tuple[int, ...]
    sketch: torch.Tensor  # [T, SKETCH]: its tokens' embeddings, a random projection of their base KV
    offsets: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)  # agent: (text, join)
    uses: int = 0  # prompts interpolated from it
    norms: dict[str, torch.Tensor] = field(default_factory=dict)  # agent: [T] its text offsets' squared norms

    def measured(self, agent: str, text: torch.Tensor, join: torch.Tensor | None) -> None:
        """Record `agent`'s offsets (what a dense prefill measured)."""
        self.offsets[agent] = (text, join)
        self.norms[agent] = (text.float() ** 2).sum(dim=1).cpu()

    def text_norms(self, agent: str) -> torch.Tensor:
        """[T]: the squared norms of `agent`'s text offsets (for `spread`; kept, not recomputed per prompt)."""
        if agent not in self.norms:
            self.norms[agent] = (self.offsets[agent][0].float() ** 2).sum(dim=1).cpu()
        return self.norms[agent]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   [self.sketch, *(x for pair in self.offsets.values() for x in pair if x is not None),
                    *self.norms.values()])


@dataclass(frozen=True)
class Match:
    """How a text's offsets are interpolated for one agent: its token j takes sum_k weight[j, k] times the
    offset of token `token[j, k]` of anchor `anchors[anchor[j, k]]`; the join after it takes, from each
    anchor, that anchor's share of the weight times its join offset."""

    anchors: tuple[Anchor, ...]
    anchor: torch.Tensor  # [T, k] long: which anchor
    token: torch.Tensor  # [T, k] long: which of its tokens
    weight: torch.Tensor  # [T, k]: rows sum to 1
    shareable: bool

    @property
    def anchor_weights(self) -> torch.Tensor:  # [anchors]: each anchor's share of the weight, mean over tokens
        share = torch.zeros(len(self.anchors)).index_add_(0, self.anchor.flatten(), self.weight.flatten())
        return share / self.anchor.shape[0]


def features(kv: torch.Tensor) -> torch.Tensor:
    """KV [L, 2, H, T, D] as one fp32 row per token [T, L*2*H*D]."""
    return kv.permute(3, 0, 1, 2, 4).reshape(kv.shape[3], -1).float()


def unfeatures(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Token rows [T, L*2*H*D] back to KV [L, 2, H, T, D] in `like`'s shape (T may differ) and dtype."""
    L, two, H, _, D = like.shape
    return rows.reshape(rows.shape[0], L, two, H, D).permute(1, 2, 3, 0, 4).contiguous().to(like.dtype)


class AnchorPool:
    """The anchors of one placeholder in one scope, read against one base prefix, oldest first; never more
    than `capacity`."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.anchors: list[Anchor] = []

    def __len__(self) -> int:
        return len(self.anchors)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.anchors)

    def find(self, tokens: tuple[int, ...]) -> Anchor | None:
        return next((a for a in self.anchors if a.tokens == tokens), None)

    def match(self, tokens: tuple[int, ...], sketch: torch.Tensor, agent: str, config: KVCommConfig) -> Match:
        """Which anchor tokens the text `tokens` (its token embeddings `sketch` [T, SKETCH]) interpolates from
        for `agent`, and whether it is shareable (KVComm, eq. 5: the length, then the entropy, criterion)."""
        n = len(tokens)
        same = self.find(tokens)
        if same is not None:  # its own measured KV, or (without this agent's offsets) an anchor still filling in
            return Match((same,), torch.zeros(n, 1, dtype=torch.long), torch.arange(n)[:, None], torch.ones(n, 1),
                         agent in same.offsets)
        found = tuple(a for a in self.anchors if agent in a.offsets)
        if not found or n > max(len(a.tokens) for a in found):
            empty = torch.zeros(n, 0)
            return Match(found, empty.long(), empty.long(), empty, False)
        # every token against every pool token: w[j, p] = softmax_p(-||h_j - h_p|| / (|h| temperature)), with
        # distances relative to the text's mean token norm |h|, so that one temperature fits any model's scale
        pool = torch.cat([a.sketch for a in found])  # [P, SKETCH]
        scale = sketch.norm(dim=1).mean()
        d = torch.cdist(sketch, pool) / (scale * config.temperature)  # [T, P]
        # the entropy criterion is a mean over tokens: estimated on at most ENTROPY_SAMPLE of them
        logw = torch.log_softmax(-d[::max(1, n // ENTROPY_SAMPLE)], dim=1)
        entropy = float(-(logw.exp() * logw).sum(dim=1).mean())
        near, p = d.topk(min(TOP_K, d.shape[1]), dim=1, largest=False)  # interpolate from the nearest TOP_K
        weight, p = torch.softmax(-near, dim=1).cpu(), p.cpu()  # (the full softmax, renormalised over them)
        owner = torch.cat([torch.full((len(a.tokens),), i) for i, a in enumerate(found)])
        first = torch.tensor([0, *[len(a.tokens) for a in found]]).cumsum(0)
        return Match(found, owner[p], p - first[owner[p]], weight,
                     entropy <= config.gamma * math.log(d.shape[1]) + 1e-9)

    def add(self, anchor: Anchor) -> Anchor | None:
        """Insert `anchor`, pruning first if full; returns the anchor pruned."""
        pruned = None
        if len(self.anchors) >= self.capacity:
            oldest = self.anchors[:EARLIEST]
            pruned = min(oldest, key=lambda a: a.uses)  # (min keeps the oldest among equals)
            self.anchors.remove(pruned)
        self.anchors.append(anchor)
        return pruned


def base_key(base_prefix: Sequence[int]) -> str:
    """A short name for a base prefix (its tokens' digest): anchors read against one base are pooled apart from
    anchors read against another, whose offsets would not add up."""
    return hashlib.blake2b(b",".join(str(t).encode() for t in base_prefix), digest_size=8).hexdigest()


def rotate(kv: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """KV [L, 2, H, T, D] with its keys moved by delta [T] positions (a copy; values as they are)."""
    return torch.stack([rerotate_keys(kv[:, 0], delta.to(kv.device), inv_freq), kv[:, 1]], dim=1)


def interpolate(base: torch.Tensor, offsets: Sequence[torch.Tensor], m: Match) -> torch.Tensor:
    """Token rows base [T, F] plus, per token, the match's weighted sum of anchor tokens' offsets (offsets[a]
    [T_a, F] for anchor a) (KVComm, eq. 6): one sparse [T, T_a] by dense [T_a, F] product per anchor."""
    out = base.clone()
    j = torch.arange(base.shape[0])[:, None].expand_as(m.anchor)
    for a, d in enumerate(offsets):
        sel = m.anchor == a
        if sel.any():
            w = torch.sparse_coo_tensor(torch.stack([j[sel], m.token[sel]]), m.weight[sel], (base.shape[0], d.shape[0]),
                                        check_invariants=False)  # (indices from topk: in range by construction)
            out += torch.sparse.mm(w.to(d.device), d)
    return out


def spread(norms: Sequence[torch.Tensor], m: Match, mean: torch.Tensor) -> torch.Tensor:
    """Each token's doubt [T]: how much the anchor-token offsets it interpolates disagree, their weighted variance
    sum_k w_k |o_k - mean|^2 = sum_k w_k |o_k|^2 - |mean|^2, relative to the mean squared offset norm over the
    pool tokens (`norms`: per anchor of the match, its offsets' squared norms [T_a]; `mean` [T, F]: the
    interpolated offsets, interpolate(0, offsets, m))."""
    first = torch.tensor([0, *[n.shape[0] for n in norms]]).cumsum(0)
    norms = torch.cat(list(norms))  # [pool tokens]
    mean_sq = (m.weight * norms[first[m.anchor] + m.token]).sum(dim=1)
    return (mean_sq - (mean.float() ** 2).sum(dim=1).cpu()) / norms.mean().clamp_min(1e-30)


def interpolate_join(base: torch.Tensor, offsets: Sequence[torch.Tensor], share: torch.Tensor) -> torch.Tensor:
    """Token rows base [T, F] + sum_a share[a] * offsets[a] (KVComm, eq. 7: the same text in every anchor)."""
    out = base.clone()
    for w, d in zip(share.tolist(), offsets):
        out += w * d
    return out


class KVComm:
    """Anchor pools over one engine. Thread-safe; `prepare` is the entry point."""

    def __init__(self, engine: Engine, config: KVCommConfig = KVCommConfig(), base_prefix: Tokens = ()):
        self.engine, self.config = engine, config
        self.base_prefix = engine.tokenize(base_prefix) if isinstance(base_prefix, str) else list(base_prefix)
        self.pools: dict[tuple[str, str, str], AnchorPool] = {}  # (scope, placeholder, base_key): pool
        self._lock = threading.Lock()
        self._next_id = 0
        self.prepared = self.reused = 0
        self._projection: torch.Tensor | None = None
        self._sketches: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # recent (base, text)s' sketches
        self._like: torch.Tensor | None = None  # an empty KV tensor [L, 2, H, 0, D] of the engine's dtype

    def sketch(self, rows: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, SKETCH] of token rows [T, F]: a fixed random projection, which keeps distances
        to a few percent at a cost that does not grow with the pool's KV width."""
        if self._projection is None:
            gen = torch.Generator().manual_seed(0)
            self._projection = (torch.randn(rows.shape[1], SKETCH, generator=gen) / math.sqrt(SKETCH)).to(rows.device)
        return rows @ self._projection

    def _sketch_of(self, base: str, tokens: list[int], rows: torch.Tensor) -> torch.Tensor:
        """The sketch of a text's base rows (behind base prefix `base`, a base_key), remembered for the next
        agents reading the same text."""
        key = (base, *tokens)
        with self._lock:
            if key in self._sketches:
                self._sketches.move_to_end(key)
                return self._sketches[key]
        sketch = self.sketch(rows)
        with self._lock:
            self._sketches[key] = sketch
            while len(self._sketches) > SKETCH_CACHE:
                self._sketches.popitem(last=False)
        return sketch

    def forget_sketches(self) -> None:
        """Forget the recent texts' sketches (kept for the next agents that read the same text)."""
        with self._lock:
            self._sketches.clear()

    # ---- pools ----------------------------------------------------------------------------------
    def pool(self, scope: str, placeholder: str, base: str) -> AnchorPool:
        """The pool of `placeholder` in `scope` for texts read against base prefix `base` (a base_key)."""
        with self._lock:
            return self.pools.setdefault((scope, placeholder, base), AnchorPool(self.config.capacity))

    def scopes(self) -> set[str]:
        """The scopes (sessions) that have pools here."""
        with self._lock:
            return {key[0] for key in self.pools}

    def drop(self, scope: str) -> int:
        """Forget every pool of `scope` (its session has gone); returns the anchors dropped."""
        with self._lock:
            gone = [key for key in self.pools if key[0] == scope]
            return sum(len(self.pools.pop(key)) for key in gone)

    def export(self, scope: str, drop: bool = False) -> dict:
        """Every pool of `scope` as plain values and CPU tensors (what `adopt` takes, on this model's replicas),
        oldest anchor first; with `drop`, the pools leave this replica (they move). Empty: no pools here."""
        with self._lock:
            keys = [key for key in self.pools if key[0] == scope]
            pools = {key: self.pools.pop(key) if drop else self.pools[key] for key in keys}
            return {"fingerprint": self.engine.fingerprint, "format": EXPORT_FORMAT, "pools": [
                {"placeholder": name, "base": base, "anchors": [
                    {"tokens": list(a.tokens), "sketch": a.sketch.cpu(), "uses": a.uses,
                     "offsets": {agent: [text.cpu(), join.cpu() if join is not None else None]
                                 for agent, (text, join) in a.offsets.items()}} for a in pool.anchors]}
                for (_, name, base), pool in pools.items()]} if keys else {}

    def adopt(self, scope: str, state: dict) -> int:
        """Pools that `export` gave on another replica, as this scope's own (anchors get ids of this replica);
        refused (PreconditionError) if another model measured them. Returns the anchors taken in."""
        if state.get("format") != EXPORT_FORMAT:
            raise PreconditionError(f"anchors exported in format {state.get('format')!r}, this replica reads format "
                                    f"{EXPORT_FORMAT} (pools read against a base prefix): they are measured again")
        if state.get("fingerprint") != self.engine.fingerprint:
            raise PreconditionError(f"anchors measured on model {state.get('fingerprint')!r} cannot serve model "
                                    f"{self.engine.fingerprint!r}")
        device, taken = self.engine.lm.device, 0
        for entry in state["pools"]:
            pool = self.pool(scope, entry["placeholder"], entry["base"])
            with self._lock:
                for a in entry["anchors"][-pool.capacity:]:
                    if pool.find(tuple(a["tokens"])) is not None:
                        continue  # (measured here meanwhile)
                    self._next_id += 1
                    anchor = Anchor(self._next_id, tuple(a["tokens"]), a["sketch"].to(device), uses=a["uses"])
                    for agent, (text, join) in a["offsets"].items():
                        anchor.measured(agent, text.to(device), join.to(device) if join is not None else None)
                    pool.add(anchor)
                    taken += 1
        return taken

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(p.nbytes for p in self.pools.values())

    def stats(self) -> dict:
        with self._lock:
            return {"pools": len(self.pools), "anchors": sum(map(len, self.pools.values())),
                    "bytes": sum(p.nbytes for p in self.pools.values()), "prepared": self.prepared,
                    "reused": self.reused, "reuse_rate": self.reused / self.prepared if self.prepared else 0.0}

    # ---- one agent's prompt -------------------------------------------------------------------------
    def decode_stream(self, prompt: AgentPrompt, scope: str) -> tuple[Prepared, DecodeStream]:
        """Prepare the prompt's context (reused or dense) and start decoding the agent's reply. The caller
        frees `prepared.parents` when done with them (the store's LRU would evict them otherwise)."""
        prep = self.prepare(prompt, scope)
        try:
            return prep, self.engine.decode_stream([DecodeCall(prep.header, parents=prep.parents,
                                                              sampling=prompt.sampling)])
        except BaseException:
            self._free(prep.owned)
            raise

    def prepare(self, prompt: AgentPrompt, scope: str) -> Prepared:
        """The prompt's prefix message and its context message (placeholders and joins but the last):
        approximated from the anchors when every placeholder is shareable, else prefilled densely, with
        the measured offsets recorded."""
        start = time.perf_counter()
        eng = self.engine
        prefix, texts, joins, names, behind = self._tokens(prompt)
        key = base_key(behind)
        bounds, at = [], 0  # (start, end) in the context of each placeholder, then of each join but the last
        for i, text in enumerate(texts):
            bounds.append((at, at + len(text)))
            at += len(text)
            if i < len(texts) - 1:
                bounds.append((at, at + len(joins[i])))
                at += len(joins[i])
        context = [t for i, text in enumerate(texts) for t in [*text, *(joins[i] if i < len(texts) - 1 else [])]]
        prefix_id = eng.prefill([PrefillCall(prefix)])[0]  # the role's prefix: a prefix-cache hit after its first
        P = len(prefix)
        # the reference agent reading one text: its context is the text's base itself, which its dense prefill
        # computes (and leaves in the prefix cache for the other agents): nothing to match, nothing to record
        reference = prefix == behind and len(texts) == 1
        try:
            matches, bases = [], []
            if self.config.enabled and not reference:
                for name, text in zip(names, texts):
                    base = self._base(behind, text)
                    bases.append(base)
                    matches.append(self.pool(scope, name, key).match(tuple(text), self._sketch_of(key, text, base),
                                                                     prompt.agent, self.config))
            held: list[str] = []
            if matches and all(m.shareable for m in matches):
                ctx_id, slots, doubt = self._approximate(prompt.agent, names, texts, joins, behind, bases, matches,
                                                         bounds, P, context, prefix_id, prefix)
                parts = [ctx_id]
                try:
                    chosen = self._recomputed(doubt)
                    # those tokens re-encoded with the prefix and the context before them in view
                    runs, made = (refresh_branches(eng, [prefix_id], [eng.message(ctx_id)], [P], chosen)
                                  if chosen.spans else (None, []))
                except BaseException:
                    self._free([ctx_id])
                    raise
                if runs is not None:
                    parts = [p for p, _, _ in runs]
                    held = [ctx_id, *(m for m in made if m not in parts)]  # (the views the runs were encoded on)
            else:
                ctx_id = eng.prefill([PrefillCall(context, parents=[prefix_id])])[0]
                parts = [ctx_id]
                try:
                    slots = (self._record(scope, prompt.agent, names, texts, joins, behind, key, bounds, P, ctx_id,
                                          bases)
                             if not reference else [SlotDecision(names[0], len(texts[0]), False)])
                except BaseException:
                    self._free([ctx_id])
                    raise
        except BaseException:
            self._free([prefix_id])
            raise
        prep = Prepared([prefix_id, *parts], joins[-1], slots, time.perf_counter() - start, held)
        with self._lock:
            self.prepared += 1
            self.reused += prep.reused
        return prep

    # ---- internals ------------------------------------------------------------------------------
    def _tokens(self, prompt: AgentPrompt):
        eng = self.engine
        tok = (lambda v: eng.tokenize(v) if isinstance(v, str) else [int(t) for t in v])
        if not prompt.slots:
            raise BraidError(f"agent {prompt.agent!r}: a KVComm prompt needs at least one placeholder")
        if len(prompt.joins) != len(prompt.slots):
            raise BraidError(f"agent {prompt.agent!r}: {len(prompt.joins)} joins for {len(prompt.slots)} "
                             "placeholders; give one join after each (the last opens the reply)")
        names = [n for n, _ in prompt.slots]
        texts, joins, prefix = [tok(t) for _, t in prompt.slots], [tok(j) for j in prompt.joins], tok(prompt.prefix)
        behind = self.base_prefix if prompt.base_prefix is None else tok(prompt.base_prefix)
        for name, text in zip(names, texts):
            if not text:
                raise BraidError(f"agent {prompt.agent!r}: placeholder {name!r} is empty")
        if not prefix or not joins[-1]:
            raise BraidError(f"agent {prompt.agent!r}: the prefix and the last join (the reply's header) must "
                             "hold at least one token")
        return prefix, texts, joins, names, behind

    def _base(self, behind: list[int], tokens: list[int]) -> torch.Tensor:
        """`tokens` encoded on their own behind the base prefix `behind`, as frame-0 token rows [T, F]. Through
        the prefix cache each text is encoded once per replica and base prefix, whichever agent asks."""
        eng = self.engine
        ids = eng.prefill([PrefillCall(behind)]) if behind else []
        try:
            mid = eng.prefill([PrefillCall(tokens, parents=ids)])[0]
            msg = eng.message(mid)
            rows = features(rotate(msg.kv.read(), -torch.arange(msg.offset, msg.end), eng.lm.inv_freq))
            self._like = msg.kv.read(0, 0)
            eng.free(mid)
        finally:
            self._free(ids)
        return rows

    def _recomputed(self, doubt: torch.Tensor) -> Runs:
        """The context tokens a reused context re-encodes: `refresh` at each end, and the `recompute` fraction
        in the windows with the most doubt (per context token; at most RECOMPUTE_WINDOWS windows a context, so
        that a long text re-encodes a few runs, each one call's worth of context, not one per token)."""
        n, cfg = doubt.shape[0], self.config
        chosen = [t for a, b in (Refresh(cfg.refresh, cfg.refresh).runs(n) if cfg.refresh else []) for t in range(a, b)]
        # (never a token of a text its own anchor measured, nor the reference agent's first text: it is exact, its
        # doubt -inf; a window scores the doubt of its other tokens)
        finite = torch.isfinite(doubt)
        k = min(math.ceil(cfg.recompute * n), int(finite.sum()))
        if k:
            w = math.ceil(n / RECOMPUTE_WINDOWS)
            pad = -n % w
            some = torch.cat([finite, finite.new_zeros(pad)]).view(-1, w).any(dim=1)  # [windows]
            score = torch.nn.functional.pad(doubt.masked_fill(~finite, 0.0), (0, pad)).view(-1, w).sum(dim=1)
            score = score.masked_fill(~some, -math.inf)
            inexact = finite.tolist()  # (read per token below: one conversion, not a tensor index each)
            for i in score.topk(min(math.ceil(k / w), int(some.sum()))).indices.tolist():
                chosen += [t for t in range(i * w, min(n, (i + 1) * w)) if inexact[t]]
        return Runs.of(chosen)

    def _approximate(self, agent, names, texts, joins, behind, bases, matches, bounds, P, context, prefix_id,
                     prefix):
        """Every placeholder and join (but the last) as base + interpolated offsets, placed after the prefix
        and stored as one message: no forward pass. Also each context token's doubt (`spread`; joins: 0; a text
        its own anchor measured, and its join: -inf, never recomputed). The first text of an agent whose prefix
        is the base prefix (the reference agent) is its base, exactly: -inf too."""
        eng, parts, slots, doubt = self.engine, [], [], []
        for i, (text, base, m) in enumerate(zip(texts, bases, matches)):
            offsets = [a.offsets[agent][0] for a in m.anchors]
            own = i == 0 and prefix == behind  # (the text right after the very prefix it was encoded behind)
            parts.append(base if own else interpolate(base, offsets, m))
            exact = len(m.anchors) == 1 and m.anchors[0].tokens == tuple(text)  # (its own measured KV)
            doubt.append(torch.full((len(text),), -math.inf) if exact or own else
                         spread([a.text_norms(agent) for a in m.anchors], m, parts[-1] - base) if self.config.recompute
                         else torch.zeros(len(text)))
            share = m.anchor_weights
            if i < len(texts) - 1 and joins[i]:  # the join after it: the same text in every anchor
                parts.append(interpolate_join(self._base(behind, joins[i]), [a.offsets[agent][1] for a in m.anchors],
                                              share))
                doubt.append(torch.full((len(joins[i]),), -math.inf if exact else 0.0))
            with self._lock:
                for a in m.anchors:
                    a.uses += 1
            slots.append(SlotDecision(names[i], len(text), True,
                                      tuple((a.id, round(float(w), 4)) for a, w in zip(m.anchors, share))))
        positions = torch.cat([torch.arange(P + s, P + e) for s, e in bounds])
        kv = rotate(unfeatures(torch.cat(parts), self._like), positions, eng.lm.inv_freq)
        return (eng.import_message(context, kv, P, eng.fingerprint, parents=[prefix_id], parent_offsets=[0],
                                   unrecorded="KVComm's reuse of a shared text's KV from another context"), slots,
                torch.cat(doubt))

    def _record(self, scope, agent, names, texts, joins, behind, key, bounds, P, ctx_id, bases
                ) -> list[SlotDecision]:
        """After a dense prefill: each placeholder's and join's measured offsets go into the anchor that holds
        its text, a new one if none does (a pool at capacity prunes first)."""
        if not self.config.enabled:
            return [SlotDecision(n, len(t), False) for n, t in zip(names, texts)]
        eng = self.engine
        kv = eng.message(ctx_id).kv
        real = lambda s, e: features(rotate(kv.read(s, e), -torch.arange(P + s, P + e), eng.lm.inv_freq))  # noqa: E731
        slots, b = [], iter(bounds)
        for i, (name, text, base) in enumerate(zip(names, texts, bases)):
            d_text = real(*next(b)) - base
            d_join = None
            if i < len(texts) - 1:
                s, e = next(b)
                d_join = real(s, e) - self._base(behind, joins[i]) if e > s else None
            pool, new, sketch = self.pool(scope, name, key), False, self._sketch_of(key, text, base)
            with self._lock:
                anchor = pool.find(tuple(text))
                if anchor is None:
                    self._next_id += 1
                    anchor, new = Anchor(self._next_id, tuple(text), sketch), True
                    pruned = pool.add(anchor)
                    if pruned is not None:
                        log.debug("kvcomm %s/%s: pruned anchor %d (%d uses)", scope, name, pruned.id, pruned.uses)
                anchor.measured(agent, d_text, d_join)
            slots.append(SlotDecision(name, len(text), False, new_anchor=new))
        return slots

    def free(self, prepared: Prepared) -> None:
        """Free what `prepare` stored (a call still using it keeps it until the call ends)."""
        self._free(prepared.owned)

    def _free(self, ids: Sequence[str]) -> None:
        self.engine.discard(ids)
