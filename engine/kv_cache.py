"""The engine's work KV: the paged pool, and each engine call's work cache over it, whose slots the scheduler
claims for a step's rows before the forward (RowSlots) so that the runner only reads where they go.

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
import threading
from collections import Counter
from dataclasses import dataclass

import torch

from braid.engine.host import to_device
from braid.engine.model import LoadedModel
from braid.engine.store import DenseKV


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
        self.slot_bytes = lm.kv_bytes_per_token
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


@dataclass(frozen=True)
class RowSlots:
    """Where one request's rows of a step go in its work cache: claimed by the scheduler as it builds the step
    (WorkCache.claim), read by the runner, which writes the rows' KV to `write` and masks by `logical`."""

    logical: torch.Tensor  # [rows] each row's slot in the cache, the leading prefill rows' first
    write: torch.Tensor  # [rows] each row's slot in the pool: where its KV goes
    lead: range  # the leading prefill rows' logical slots (host)
    own: range  # the other rows' logical slots (host)
    length: int  # the cache's length with these rows: the keys they attend end here


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

    def claim(self, call_of_row: torch.Tensor, entries: int, lead_rows: int = 0) -> RowSlots:
        """(The scheduler, building a step) Slots for a request's next rows, `call_of_row` [rows] each row's call
        and `entries` the number of context entries (call c's tokens are segment entries + c). Its first
        `lead_rows` rows are leading prefill calls' tokens, whose slots were claimed ahead (reserve_lead); the
        others claim the slots after the cache's length, in order."""
        rest = self.reserve(call_of_row[lead_rows:] + entries)
        logical = torch.arange(rest.start, rest.stop, device=self.index.device)
        write = self.index[rest]  # (a view: its rows' slots are one run of its cache)
        lead = range(0)
        if lead_rows:
            lead = self.next_lead(lead_rows)
            logical = torch.cat([torch.arange(lead.start, lead.stop, device=self.index.device), logical])
            write = torch.cat([self.index[lead.start:lead.stop], write])
        return RowSlots(logical, write, lead, range(rest.start, rest.stop), self.length)

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
