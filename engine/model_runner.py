"""Forward passes over transformers' modules with paged, segment-tagged KV caches.

One engine call gets one WorkCache (a block table in the engine's KVPool): the placed
context entries first, then the tokens of every parallel call, appended as they are encoded.
An entry placed where its message was encoded is read in place from a SharedRun, the message's
KV copied into the pool once for every running call that places it so; any other entry is a
copy of its message in the call's own blocks, re-rotated to its offset. Each slot carries a segment
id: context entry e has segment e, call c's own tokens have segment E + c. A query of call
c may attend slot s iff visible[c, segment[s]] and s <= its own slot, which gives the
choreography masks of parallel prefill (each message contiguous) and parallel decode
(tokens interleaved) from one rule.

A decode request whose first calls are prefill calls its decode calls read (lead calls) orders its cache so that
each side reads one run of slots: the entries only the lead calls read, those both read, the lead calls' tokens
(their slots claimed ahead), then the entries only the decode calls read and the decode calls' tokens. Lead rows
attend [0, end of their tokens); the other rows [start, length), so they never pay for the first part,
whose blocks go back to the pool once the lead rows are encoded.
"""

import bisect
import contextlib
import logging
import threading
from collections import Counter
from dataclasses import dataclass

import torch

from braid.engine.attention import IN_GRAPH, forward_ran, forward_step, mask_needed, paged_mask
from braid.engine.host import to_device
from braid.engine.model import LoadedModel
from braid.engine.store import DenseKV

log = logging.getLogger(__name__)
# what torch.compile raises when it cannot compile (a graph break under fullgraph, a failed backend, a guard that
# would recompile past the limit): the compiled forward then never started
COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException,
                  *((torch._dynamo.exc.FailOnRecompileLimitHit,)
                    if hasattr(torch._dynamo.exc, "FailOnRecompileLimitHit") else ()))


@dataclass(eq=False)
class SharedRun:
    """A parent message's KV in the pool, at the positions it was encoded at, read in place by every running call
    that places it there. Made by the first such call, freed when the last one ends."""

    key: tuple  # KVPool.share_key: its KV's address, shape, strides, type, device, and its offset
    blocks: list[int]
    index: torch.Tensor  # [T]: its tokens' slots in the pool
    source: DenseKV  # the message's KV: kept alive, so that its address (the key) is not reused meanwhile
    refs: int = 0


class KVPool:
    """An engine's work KV, paged: one tensor [L, 2, H, blocks * block_tokens, D] cut into fixed-size blocks.
    Every running call's WorkCache holds a block table; one forward writes and reads the KV of all its calls
    with one indexed op per layer. Any free blocks serve any call (no fragmentation); the memory is touched
    only as it is used. Parents placed where they were encoded are kept once, as SharedRuns,
    whatever the number of running calls that read them."""

    def __init__(self, lm: LoadedModel, blocks: int, block_tokens: int = 16, work_blocks: int | None = None,
                 zeroed: bool = False):
        """`work_blocks`: the most blocks running calls hold at once (default: all of them); the rest are for
        stored messages (engine.store.PagedKV), which hold blocks calls wrote. `zeroed`: every slot is zero when
        its block is first handed out (attention in place reads the slots it masks within the blocks handed out so
        far, engine.attention.paged_attention, and a masked NaN would still spread); blocks never handed out stay
        untouched, as without it."""
        s = lm.spec
        self.block_tokens = block_tokens
        self.blocks = blocks
        self.work_blocks = blocks if work_blocks is None else min(work_blocks, blocks)
        # one block more than it hands out: its first slot is where the padding rows of a static forward write
        # their KV, which nothing reads (engine.cuda_graphs)
        self.kv = torch.empty(s.num_layers, 2, s.num_kv_heads, (blocks + 1) * block_tokens, s.head_dim,
                              dtype=lm.dtype, device=lm.device)
        self.zeroed = zeroed
        self.trash = blocks * block_tokens
        self.kv[:, :, :, self.trash:].zero_()  # (padding keys read it, masked: it must hold no NaN)
        self.slot_bytes = s.num_layers * 2 * s.num_kv_heads * s.head_dim * self.kv.element_size()
        self.free: list[int] = []  # blocks handed back, a stack (the last handed back is taken first)
        self._fresh = 0  # blocks [_fresh, blocks) were never handed out: taken in order after the stack
        self.shared: dict[tuple, SharedRun] = {}
        # Blocks stored messages hold (engine.store.PagedAlloc), by how many allocations hold each: a block a call
        # hands back stays out of the free list while held, and one let go by its last holder is freed once no
        # call has it. The store lets go from callers' threads, the scheduler allocates from its own: one lock.
        self.holds: Counter[int] = Counter()
        self.in_use: set[int] = set()  # blocks handed to running calls (and not handed back)
        self._lock = threading.Lock()
        # KV bytes copied since the engine started: "reuse", parents copied into the pool for the calls that read
        # them (a copy re-rotated to another offset, or a shared run's one copy); "commit", a finished call's KV
        # copied out into its stored message. A parent read in place from a run already there copies nothing.
        self.copied = {"reuse": 0, "commit": 0}

    @staticmethod
    def share_key(kv: DenseKV, offset: int) -> tuple:
        """What identifies a parent's placed KV: a message's KV never changes, and while a run holds it its
        memory is its own (its address, layout and type say which KV it is: DenseKV.key)."""
        return *kv.key, offset

    def blocks_to_share(self, parents: list[tuple[DenseKV, int]]) -> int:
        """Blocks that sharing these (KV, offset) parents would take: those not in the pool already."""
        keys = {self.share_key(kv, off): kv.num_tokens for kv, off in parents}
        return sum(self.blocks_for(n) for key, n in keys.items() if key not in self.shared)

    def share(self, kv: DenseKV, offset: int) -> SharedRun:
        """The parent's run, copied into the pool if no running call has it (its blocks must be free: see
        `blocks_to_share`); one more reader until `unshare`."""
        key = self.share_key(kv, offset)
        run = self.shared.get(key)
        if run is None:
            blocks = self.allocate(kv.num_tokens)
            if blocks is None:
                raise RuntimeError(f"no room in the KV pool to share a {kv.num_tokens}-token parent")
            index = _slots(blocks, self.block_tokens, self.kv.device)[:kv.num_tokens]
            self.kv.index_copy_(3, index, kv.read().to(self.kv.dtype))
            self.copied["reuse"] += kv.nbytes
            run = self.shared[key] = SharedRun(key, blocks, index, kv)
        run.refs += 1
        return run

    def unshare(self, run: SharedRun) -> None:
        """One reader fewer; the last one hands its blocks back."""
        run.refs -= 1
        if run.refs == 0:
            del self.shared[run.key]
            self.release(run.blocks)

    @property
    def free_blocks(self) -> int:
        return len(self.free) + self.blocks - self._fresh

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def allocate(self, tokens: int, also: int = 0) -> list[int] | None:
        """Blocks enough for `tokens`, or None when fewer are free (and `also` more must stay free)."""
        n = self.blocks_for(tokens)
        with self._lock:
            if n + also > self.free_blocks or len(self.in_use) + n + also > self.work_blocks:
                return None
            k = min(n, len(self.free))
            taken = self.free[len(self.free) - k:][::-1] + list(range(self._fresh, self._fresh + n - k))
            if self.zeroed and n > k:  # (fresh blocks come in order: one run)
                self.kv[:, :, :, self._fresh * self.block_tokens:(self._fresh + n - k) * self.block_tokens].zero_()
            self.free, self._fresh = self.free[:len(self.free) - k], self._fresh + n - k
            self.in_use.update(taken)
        return taken

    def release(self, blocks: list[int]) -> None:
        """A call's blocks back: free, but for those stored messages hold."""
        with self._lock:
            self.in_use.difference_update(blocks)
            self.free.extend(b for b in reversed(blocks) if not self.holds[b])

    def hold(self, blocks: list[int]) -> None:
        """Keep these blocks (a call's, still in use) from the free list until `unhold`."""
        with self._lock:
            self.holds.update(blocks)

    def unhold(self, blocks: list[int]) -> None:
        with self._lock:
            self.holds.subtract(blocks)
            gone = [b for b in blocks if self.holds[b] <= 0]
            for b in gone:
                del self.holds[b]
            self.free.extend(b for b in reversed(gone) if b not in self.in_use)

    @property
    def held_blocks(self) -> int:
        """Blocks stored messages hold."""
        return len(self.holds)


def _slots(blocks: list[int], block_tokens: int, device) -> torch.Tensor:
    """The pool slots of `blocks`, in order: [len(blocks) * block_tokens]."""
    table = to_device(blocks, device)
    return (table[:, None] * block_tokens + torch.arange(block_tokens, device=device)[None, :]).flatten()


class WorkCache:
    """KV for one engine call: logical slots 0..capacity-1, each a slot of the engine's pool: in its own blocks,
    or, for a parent it reads in place, in that parent's SharedRun."""

    def __init__(self, lm: LoadedModel, capacity: int, pool: KVPool, blocks: list[int]):
        self.pool, self.blocks, self.capacity = pool, blocks, capacity
        b = pool.block_tokens
        self._own = _slots(blocks, b, lm.device)  # its own blocks' slots, claimed in order
        self._claimed = 0
        self._blocks = list(blocks)  # (the host's copy of its block table, as it grows)
        # every pool block its slots lie in, its own and its in-place parents', each once (attention in place,
        # engine.attention.paged_mask, reads these; blocks it has handed back may stay: their slots are masked)
        self.pages = dict.fromkeys(blocks)
        self._claims: list[tuple[int, int, int]] = []  # (logical start, own slot position, length), in order
        self.index = torch.empty(capacity, dtype=torch.long, device=lm.device)  # each logical slot's place in the pool
        # own blocks in one ascending run, and no parent read in place (the usual case): read as a view, no gather
        ascending = bool(blocks) and blocks == list(range(blocks[0], blocks[0] + len(blocks)))
        self.run_start = blocks[0] * b if ascending else None
        self.segment = torch.empty(capacity, dtype=torch.long, device=lm.device)
        self.length = 0
        # With lead calls (a decode request's prefill calls, engine.call): the context only they read comes first, slots
        # [0, start), which no other row attends; their own tokens' slots are claimed ahead, as `lead`.
        self.start = 0
        self.lead_slots = slice(0, 0)
        self._lead_next = 0
        self.front = 0  # slots of its own blocks that hold context only leading prefill calls read (the first ones)

    @property
    def claimed(self) -> int:
        """Slots of its own blocks claimed so far."""
        return self._claimed

    @property
    def free_slots(self) -> int:
        """Slots of its own blocks not claimed yet."""
        return self._own.numel() - self._claimed

    def grow(self, blocks: list[int]) -> None:
        """More blocks of its own, claimed after the ones it has (still one run if they extend it)."""
        b = self.pool.block_tokens
        if self.run_start is not None and blocks[0] * b != self.run_start + self._own.numel() or any(
                y != x + 1 for x, y in zip(blocks, blocks[1:])):
            self.run_start = None
        self._own = torch.cat([self._own, _slots(blocks, b, self._own.device)])
        self._blocks += blocks
        self.pages.update(dict.fromkeys(blocks))

    def _claim(self, start: int, end: int) -> torch.Tensor:
        """Logical slots [start, end) onto the next of its own slots."""
        own = self._own[self._claimed:self._claimed + end - start]
        if own.numel() < end - start:
            raise RuntimeError(f"work cache overflow: {end - start} more slots, {self._own.numel() - self._claimed} "
                               "of its own left")
        self.index[start:end] = own
        if self._claimed != start:  # (its own slots, one run from run_start, no longer line up with its logical ones)
            self.run_start = None
        self._claims.append((start, self._claimed, end - start))
        self._claimed += end - start
        return own

    def blocks_of(self, slots: list[int]) -> set[int]:
        """The pool blocks that hold these logical slots of its own (computed on the host: no device read)."""
        b, out, starts = self.pool.block_tokens, set(), [c[0] for c in self._claims]
        for slot in slots:
            start, own, n = self._claims[bisect.bisect_right(starts, slot) - 1]
            if not start <= slot < start + n:
                raise ValueError(f"slot {slot} is not one of its own")
            out.add(self._blocks[(own + slot - start) // b])
        return out

    def append(self, keys: torch.Tensor, values: torch.Tensor, segment: int) -> None:
        """Copy already-encoded (and placed) keys and values [L, H, T, D] in as one segment."""
        start, end = self.length, self.length + keys.shape[2]
        own = self._claim(start, end)
        for half, x in enumerate((keys, values)):
            self.pool.kv[:, half].index_copy_(2, own, x.to(self.pool.kv.dtype))
        self.pool.copied["reuse"] += 2 * keys.numel() * self.pool.kv.element_size()
        self.segment[start:end] = segment
        self.length = end

    def reference(self, run: SharedRun, segment: int) -> None:
        """A parent read in place (its run in the pool) as one segment: nothing copied."""
        self.reference_slots(run.index, segment, run.blocks)

    def reference_slots(self, index: torch.Tensor, segment: int, blocks: list[int]) -> None:
        """Pool slots [T] read in place as one segment (a shared run's, or a stored message's where it lives in the
        pool, engine.store.PagedKV), `blocks` the pool blocks they lie in: nothing copied."""
        self.pages.update(dict.fromkeys(blocks))
        start, end = self.length, self.length + index.numel()
        self.index[start:end] = index
        self.segment[start:end] = segment
        self.length = end
        self.run_start = None

    def reserve(self, segments: torch.Tensor) -> slice:
        """Claim slots for the next forward's tokens; returns their (logical, contiguous) range."""
        start, end = self.length, self.length + segments.numel()
        self._claim(start, end)
        self.segment[start:end] = segments
        self.length = end
        return slice(start, end)

    def reserve_lead(self, segments: torch.Tensor) -> None:
        """Claim the slots of the leading prefill calls' tokens (in the order they are encoded) here, ahead of the
        entries that only the decode calls read, so that each side attends one run of slots."""
        start = self.length
        self.reserve(segments)
        self.lead_slots = slice(start, self.length)
        self._lead_next = start

    def next_lead(self, n: int) -> range:
        """The claimed slots of the next `n` leading prefill tokens (one run, known on the host)."""
        at, self._lead_next = self._lead_next, self._lead_next + n
        if self._lead_next > self.lead_slots.stop:
            claimed = self.lead_slots.stop - self.lead_slots.start
            raise RuntimeError(f"{n} leading prefill tokens past the {claimed} claimed")
        return range(at, at + n)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The KV of the given logical slots as a contiguous block [L, 2, H, T, D]."""
        return self.pool.kv.index_select(3, self.index[slots])

    def layer_kv(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Keys and values of slots [start, end) in one layer: [2, H, end - start, D]."""
        if self.run_start is not None:
            return self.pool.kv[layer, :, :, self.run_start + start:self.run_start + end]
        return self.pool.kv[layer].index_select(2, self.index[start:end])


@dataclass
class RequestInput:
    """One engine call's rows in a forward: its own work cache, masks and tokens.

    visible: bool [calls, segments]; row r belongs to call call_of_row[r]; logit_rows: which of its rows
    need next-token logits (None: none)."""

    cache: WorkCache
    visible: torch.Tensor
    input_ids: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]
    call_of_row: torch.Tensor  # [rows]
    logit_rows: list[int] | None  # (host indices: one copy for all the groups of a forward)
    lead_rows: int = 0  # how many of the rows (the first) are leading prefill calls' tokens
    slots: torch.Tensor | None = None  # (set by the forward) each row's slot in the cache
    lead_slots: range = range(0)  # (set by the forward) the leading prefill rows' slots, on the host
    own_slots: range = range(0)  # (set by the forward) the other rows' slots, on the host
    # one call that sees every entry of its cache (visible all true): a single row of it attends every key before
    # it, so its mask need not be built (Request.plain)
    plain: bool = False


@dataclass
class _Part:
    """A group's place in one forward, for the cache writes and the attention (engine.attention). Its first
    `lead` rows (leading prefill calls' tokens) attend slots [0, lead_end); the others [start, length)."""

    cache: WorkCache
    rows: slice  # its rows among the forward's
    write_index: torch.Tensor  # where its rows' KV go in the pool: [rows]
    mask: torch.Tensor | None  # bool [1, 1, rows, keys]: keys [0, length) with lead rows, else [start, length)
    lead: int = 0  # its first rows that are leading prefill calls' tokens
    lead_end: int = 0  # one past the last of those rows' slots: they attend [0, lead_end), all written
    full: bool = False  # one row that attends every key [start, length): `mask` is None and not needed

    @property
    def masked(self) -> bool:
        """It has a mask, or needs none because it sees every key (`full`): what the shared attention takes."""
        return self.mask is not None or self.full

    @property
    def start(self) -> int:
        return self.cache.start

    def layer_kv(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values of its cache's slots [start, end), new rows included: [1, H, T, D] each."""
        kv = self.cache.layer_kv(layer, start, end)
        return kv[0][None], kv[1][None]


def padded_keys(parts: list[_Part], t: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool slots of each part's keys [start, length), padded to t with slot `pad`: ([len(parts) * t] long,
    bool [len(parts), t] where a key is a real one). A few ops for all the parts, none per part, and no read back
    to the host (where the keys go is computed from host lengths)."""
    device = parts[0].cache.index.device
    lengths = [p.cache.length - p.start for p in parts]
    firsts = [0]
    for n in lengths[:-1]:
        firsts.append(firsts[-1] + n)
    # key k of part i (k < its length) goes to i * t + k; it is key firsts[i] + k of the parts' keys laid end to end
    host = to_device([lengths, [i * t - f for i, f in enumerate(firsts)]], device)
    total = firsts[-1] + lengths[-1]
    where = torch.arange(total, device=device) + torch.repeat_interleave(host[1], host[0], output_size=total)
    index = torch.full((len(parts) * t,), pad, dtype=torch.long, device=device)
    index.index_copy_(0, where, torch.cat([p.cache.index[p.start:p.cache.length] for p in parts]))
    return index, torch.arange(t, device=device)[None, :] < host[0][:, None]


def fill_masks(mask: torch.Tensor, parts: list[_Part], inside: torch.Tensor) -> None:
    """The padded masks of the shared decode attention, bool [>= len(parts), 1, R, T]: every row of part i sees
    its keys (`inside` [len(parts), T], from padded_keys), so padding rows, which are dropped, stay finite and a
    `full` part's row needs nothing more; the real rows of a part with a mask of its own take it."""
    mask[:len(parts)] = inside[:, None, None, :]
    for i, p in enumerate(parts):
        if not p.full:
            mask[i, 0, :p.rows.stop - p.rows.start, :p.cache.length - p.start] = p.mask[0, 0]


SHARED_ATTENTION_ROWS = 8  # groups with at most this many rows in a forward (decoding) share one attention call


class _Step:
    """One forward's groups, as the cache writes and the attention use them. Every new row's KV goes to its
    group's blocks in the pool in one indexed write per layer. Groups with many rows (prefill chunks)
    attend their own cache one by one; the others (decode steps) share one padded attention call, their
    caches read from the pool in one indexed gather per layer, padded to the longest and masked. `in_place`
    (attention: flex): nothing is gathered; each group's attention reads the pool where its keys lie, through a
    block mask built here from its page table, once for all the layers (`paged`)."""

    padded = False  # (engine.cuda_graphs.PaddedStep: every row of the forward is a padded row of the shared call)
    paged = None  # list[engine.attention.PagedMask]: one per large group, then one for the shared ones (in_place)

    def __init__(self, parts: list[_Part], in_place: bool = False):
        self.parts = parts
        self.pool = parts[0].cache.pool  # (every call's cache is in the engine's one pool)
        device = self.pool.kv.device
        self.write_index = torch.cat([p.write_index for p in parts])  # where each row's KV goes: [rows]
        small = [p for p in parts if p.rows.stop - p.rows.start <= SHARED_ATTENTION_ROWS and p.masked
                 and not p.lead]
        self.small = small if len(small) > 1 else []
        self.large = [p for p in parts if not any(p is q for q in self.small)]
        for p in self.large:
            if p.full:  # (one group alone: its explicit mask, every key, as SDPA was always given)
                p.mask = torch.ones(1, 1, 1, p.cache.length - p.start, dtype=torch.bool, device=device)
        b = self.pool.block_tokens
        if in_place:  # (each large group's keys: [0, length) with leading prefill rows, else [start, length))
            keys = [p.cache.index[0 if p.lead else p.start:p.cache.length][None] for p in self.large]
            self.paged = [paged_mask([list(p.cache.pages)], k, None, p.mask[:, 0], b) for p, k in zip(self.large, keys)]
        if not self.small:
            return
        counts = [p.rows.stop - p.rows.start for p in small]
        g, r, t = len(small), max(counts), max(p.cache.length - p.start for p in small)
        # the padded query rows, built on the host and copied once: group i's n rows at [i * r, i * r + n)
        row_index, valid, rows = [0] * (g * r), [], []
        for i, (p, n) in enumerate(zip(small, counts)):
            row_index[i * r:i * r + n] = range(p.rows.start, p.rows.stop)
            valid.extend(range(i * r, i * r + n))
            rows.extend(range(p.rows.start, p.rows.stop))
        self.shape = (g, r, t)
        self.row_index = to_device(row_index, device)  # [g * r]: each padded query row's row in the forward
        self.valid = to_device(valid, device)  # which padded rows are real
        self.rows = to_device(rows, device)  # and their rows in the forward, in the same order
        self.read_index, inside = padded_keys(small, t, self.pool.trash)  # [g * t]; bool [g, t]
        self.mask = torch.empty(g, 1, r, t, dtype=torch.bool, device=device)
        fill_masks(self.mask, small, inside)
        if in_place:
            self.paged.append(paged_mask([list(p.cache.pages) for p in small], self.read_index.view(g, t), inside,
                                         self.mask[:, 0], b))

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        """transformers' cache seam: this forward's new K/V rows ([1, H, rows, D] each) go to their groups'
        caches; attention then reads each group's own cache (engine.attention)."""
        self.pool.kv[layer_idx, 0].index_copy_(1, self.write_index, key_states[0])
        self.pool.kv[layer_idx, 1].index_copy_(1, self.write_index, value_states[0])
        return key_states, value_states

    def shared_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the shared-attention groups, padded: [groups, H, longest cache, D] each."""
        g, _, t = self.shape
        kv = self.pool.kv[layer].index_select(2, self.read_index)  # [2, H, g * t, D]
        kv = kv.view(2, kv.shape[1], g, t, kv.shape[3]).transpose(1, 2)  # [2, g, H, t, D]
        return kv[0], kv[1]


RECOMPILE_LIMIT = 64  # graphs torch.compile keeps for the decoder's code: each engine's weights add one or two


@contextlib.contextmanager
def _compiling():
    """torch.compile's settings for a compiled forward, as this thread's own (torch keeps a patch per thread):
    - a debug check off, which runs a compiled graph's first call under a dispatch mode of its own, in which
      FlexAttention's eager mask, inside the attention op, cannot be built;
    - more graphs kept per code object: the decoder's code is every engine's in the process, and each engine's weights
      are graphs of their own (torch's default, 8, would leave a process's ninth one uncompiled)."""
    with torch._functorch.config.patch(check_custom_op_aliasing=False), \
            torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        yield


class ModelRunner:
    def __init__(self, lm: LoadedModel, attention: str = "sdpa", compile: bool = False):
        """`attention`: "sdpa" (keys gathered out of the pool) or "flex" (read in place: _Step's `in_place`).
        `compile`: base-weight forwards run the decoder through torch.compile (EngineConfig.compile)."""
        self.lm = lm
        self.in_place = attention == "flex"
        self.decoder = lm.model.model
        self.lm_head = lm.model.lm_head
        self.graphs = None  # engine.cuda_graphs.DecodeGraphs (set by the engine), or None: every forward as it comes
        self.compiled = self.compiled_decoder() if compile else None
        self.compiled_forwards = 0  # forwards that ran compiled

    def compiled_decoder(self):
        """The decoder through torch.compile (compiled at its first forward): one graph for every forward's rows
        (dynamic), attention an opaque op per layer (attention.step_attention); fullgraph, so that a model whose
        graph would break runs as it comes instead (`forward`)."""
        return torch.compile(self.decoder, dynamic=True, fullgraph=True)

    @torch.inference_mode()
    def step(self, groups: list[RequestInput], weights=None) -> list[torch.Tensor | None]:
        """Encode every group's rows in one forward (linear layers batched over all rows, attention per group
        over its own cache); returns each group's fp32 logits of its `logit_rows`. A forward of decode-sized
        groups runs at a static shape when the runner has graphs (engine.cuda_graphs). `weights` names the weights
        in place for this forward when they are not the base ones (the scheduler's adapter; in a static
        forward, which has no leading prefill rows, it is in place over every row): a graph replays the weights it
        was captured with, so each has its own."""
        graphs = self.graphs  # (read once)
        shape = graphs.shape(groups) if graphs is not None else None
        parts, start = [], 0
        for g in groups:
            part = self._part(g, start, masked=shape is not None or len(groups) > 1 or self.in_place)
            parts.append(part)
            start = part.rows.stop
        if shape is not None:
            hidden = graphs.run(groups, parts, shape, weights)  # [G * R, hidden]: group i's rows from i * R
            if hidden is not None:
                r = shape[1]
                return self._logits(groups, hidden, [slice(i * r, i * r + len(g.input_ids))
                                                     for i, g in enumerate(groups)])
        input_ids = torch.cat([g.input_ids for g in groups])[None]
        positions = torch.cat([g.positions for g in groups])[None]
        hidden = self.forward(input_ids, positions, _Step(parts, self.in_place), weights)
        return self._logits(groups, hidden, [p.rows for p in parts])

    def _logits(self, groups: list[RequestInput], hidden: torch.Tensor, rows: list[slice]) -> list[torch.Tensor | None]:
        """Each group's fp32 logits of its `logit_rows`, its rows being `rows[i]` of `hidden`: one lm_head over
        every group's rows (its weight read once a forward, not once a group)."""
        wanted = [g.logit_rows for g in groups if g.logit_rows is not None]
        if not wanted:
            return [None] * len(groups)
        index = to_device([i + r.start for g, r in zip(groups, rows) if g.logit_rows is not None
                           for i in g.logit_rows], hidden.device)
        logits = iter(self.lm_head(hidden.index_select(0, index)).float().split([len(w) for w in wanted]))
        return [None if g.logit_rows is None else next(logits) for g in groups]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: "_Step", weights=None) -> torch.Tensor:
        """The decoder over one forward's rows ([1, rows] ids and positions): last hidden states [rows, hidden].
        Compiled where the runner compiles and the base weights are in place (`weights` None: an adapter's swap
        would be another graph's worth of guards)."""
        placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=input_ids.device)  # (masks are per part)
        if self.compiled is not None and weights is None:
            if not self.compiled_forwards:
                log.info("compiling the decoder: its first forwards take seconds to minutes")
            try:
                with forward_step(step), _compiling():
                    out = self.compiled(input_ids=input_ids, position_ids=positions, attention_mask=placeholder,
                                        use_cache=False, braid_step=IN_GRAPH)
                self.compiled_forwards += 1
                return out.last_hidden_state[0]
            except COMPILE_ERRORS:
                if forward_ran():  # (it compiled, and failed as it ran: a forward's failure, its requests' to hear)
                    raise
                log.exception("compiling the decoder failed; its forwards run as they come")
                self.compiled = None
        out = self.decoder(input_ids=input_ids, position_ids=positions, attention_mask=placeholder,
                           past_key_values=step, use_cache=True, braid_step=step)
        return out.last_hidden_state[0]

    def _part(self, g: RequestInput, start: int, masked: bool) -> _Part:
        """Claim the group's slots in its cache (setting g.slots) and build its mask, unless it needs none (one
        plain-causal group on flash-attn, and `masked` false; or one row of a `plain` group, which sees every
        key: `full`): its place in a forward whose rows so far end at `start`."""
        num_entries = g.visible.shape[1] - g.visible.shape[0]
        r, cache = g.lead_rows, g.cache
        rest = cache.reserve(g.call_of_row[r:] + num_entries)  # (leading prefill rows: their slots claimed ahead)
        g.slots = torch.arange(rest.start, rest.stop, device=cache.index.device)
        g.own_slots = range(rest.start, rest.stop)
        write = cache.index[rest]  # (a view: its rows' slots are one run of its cache)
        if r:
            g.lead_slots = lead = cache.next_lead(r)
            g.slots = torch.cat([torch.arange(lead.start, lead.stop, device=cache.index.device), g.slots])
            write = torch.cat([cache.index[lead.start:lead.stop], write])
        mask, full = None, False
        if masked or mask_needed(self.lm.device, self.lm.dtype, g.plain):
            if g.plain and not r and len(g.input_ids) == 1:
                full = True
            else:
                lo = 0 if r else cache.start
                keys = torch.arange(lo, cache.length, device=g.visible.device)
                mask = g.visible[g.call_of_row][:, cache.segment[lo:cache.length]] & (keys[None, :] <= g.slots[:, None])
                mask = mask[None, None]
        rows = slice(start, start + len(g.input_ids))
        return _Part(cache, rows, write, mask, r, g.lead_slots.stop if r else 0, full)
