"""A planned request's KV on the engine's side: its work cache assembled over the scheduler's blocks, its messages
committed to the store when it ends.

The scheduler calls a request's `PlannedKV` (its engine.scheduler.RequestKV) from its own thread: `assemble` when
it admits the request (again after a preemption), `commit` when every call has finished, `release` once at the
end. Each goes to the engine's one `Committer`, which holds the pool, the store and the prefix cache it writes.
"""

import threading
from dataclasses import replace

import torch

from braid.engine.call import KVTransform
from braid.engine.config import EngineConfig
from braid.engine.host import to_device
from braid.engine.kv_cache import KVPool, WorkCache
from braid.engine.model import LoadedModel
from braid.engine.planner import Plan
from braid.engine.prefix_cache import PrefixCache
from braid.engine.scheduler import Request
from braid.engine.store import DenseKV, Message, MessageStore, PagedAlloc, PagedKV
from braid.kernels import rerotate_keys, rerotate_keys_

CACHED_PREFIX = "~cached-"  # ids of the prefix cache's own messages (never given to callers)


class Committer:
    """Places parents into work caches and commits finished calls' messages, for one engine. Holds the store's
    lock only to write the store."""

    def __init__(self, config: EngineConfig, lm: LoadedModel, pool: KVPool, store: MessageStore,
                 store_lock: threading.Lock, prefix_cache: PrefixCache | None, tokenizer, paged: bool):
        self.config, self.lm, self.pool, self.store, self.store_lock = config, lm, pool, store, store_lock
        self.prefix_cache, self.tokenizer = prefix_cache, tokenizer
        self.paged = paged  # stored messages' KV lives in the pool (engine.store.PagedKV)

    def encoded_by(self, adapter_id: str | None) -> str:
        """The fingerprint messages encoded on these weights are stored under."""
        return self.lm.fingerprint if adapter_id is None else f"{self.lm.fingerprint}+{adapter_id}"

    def request_kv(self, plan: Plan | None, transform: KVTransform | None, pins: list[str],
                   views: list[str]) -> "PlannedKV":
        return PlannedKV(self, plan, transform, pins, views)

    def at_home(self, msg: Message) -> bool:
        """Whether the message's KV lives in this engine's pool (engine.store.PagedKV): where it was encoded, it is
        read in place without a run of its own (`in_place`)."""
        return isinstance(msg.kv, PagedKV) and msg.kv.pool is self.pool

    def in_place(self, plan: Plan, transform: KVTransform | None, own_tokens: int) -> list[bool]:
        """Which of the call's parents it reads in place rather than copying into its own blocks: those placed where
        they were encoded and untransformed that live in the pool (kv_home paged: their own slots, no copy) or are a
        block long at least (a dense message: a run of the pool, one copy for every running call that reads it so).
        None when they are mostly copied anyway (a cache of the call's own blocks is read as a view each forward,
        where reading any parent in place gathers the whole cache each forward), nor when their runs would not fit
        the pool."""
        pool, none = self.pool, [False] * len(plan.entries)
        if transform is not None or not self.config.share_parents:
            return none
        home = [off == m.offset and self.at_home(m) for m, off in plan.entries]  # (in place: no copy, no run)
        yes = [h or off == m.offset and m.num_tokens >= pool.block_tokens for h, (m, off) in zip(home, plan.entries)]
        shared = [m.num_tokens for h, (m, _), y in zip(home, plan.entries, yes) if y and not h]
        kept = sum(m.num_tokens for (m, _), y in zip(plan.entries, yes) if y)
        copied = sum(m.num_tokens for (m, _), y in zip(plan.entries, yes) if not y)
        fits = pool.blocks_for(own_tokens + copied) + sum(map(pool.blocks_for, shared)) <= pool.work_blocks
        # (a call that copies most of its context anyway copies it all, its paged parents too: its cache is then one
        # run of its own blocks, read as a view each forward, where reading any parent in place gathers the whole
        # cache each forward, which costs more than the copy: benchmarks/results/ab_synthesis_ttft_100m_paged.json)
        return yes if fits and kept >= copied else none

    def assemble(self, plan: Plan, extra_tokens: int, transform: KVTransform | None, blocks: list[int],
                  in_place: list[bool], runs: list) -> WorkCache:
        """A work cache (over `blocks` of the pool) reading each parent in place (`runs`, in order, for the
        entries `in_place`) or holding a copy of it, re-rotated to its offset, and mapped for the decode calls'
        entries of the parents the transform maps (from the unmapped copy placed for lead calls, if any).
        With lead calls, their tokens' slots are claimed between the entries they read and the others."""
        context = sum(m.num_tokens for m, _ in plan.entries)
        cache = WorkCache(self.lm, context + sum(len(c.tokens) for c in plan.calls) + extra_tokens,
                          self.pool, blocks)
        cache.start = sum(m.num_tokens for m, _ in plan.entries[:plan.lead_only])
        unmapped: dict[tuple[str, int], torch.Tensor] = {}  # the slots of unmapped copies a mapped entry may take
        runs = iter(runs)
        for e, entry in enumerate(plan.entries + [None]):
            if plan.lead and e == plan.lead_only:
                cache.front = cache.claimed
            if plan.lead and e == plan.lead_at:
                cache.reserve_lead(to_device([len(plan.entries) + c for c in range(plan.lead)
                                              for _ in plan.calls[c].tokens], cache.index.device))
            if entry is None:
                break
            msg, off = entry
            if in_place[e]:
                if self.at_home(msg):
                    cache.reference_slots(msg.kv.index, segment=e, blocks=msg.kv.blocks)
                else:
                    cache.reference(next(runs), segment=e)
                continue
            if plan.mapped[e]:
                # (one copy at a time, read back from the pool rather than kept: no more memory held at once than
                # one message's copy, which the allocator then reuses; the engine's own, which a transform may
                # work in place on)
                slots = unmapped.pop((msg.id, off), None)
                placed = transform.apply(msg, cache.gather(slots) if slots is not None else self.placed_copy(msg, off))
                keys, values = placed[:, 0], placed[:, 1]
            else:
                keys, values = self._placed(msg, off)
                if transform is not None and msg.id in transform.ids:
                    unmapped[(msg.id, off)] = torch.arange(cache.length, cache.length + msg.num_tokens,
                                                           device=cache.index.device)
            cache.append(keys, values, segment=e)
        return cache

    def _placed(self, msg: Message, off: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The message's keys and values [L, H, T, D] at offset `off`, apart (whoever copies them into the pool
        copies each once, with no [L, 2, H, T, D] stacked in between): a dense message's own (views, no copy)
        where it was encoded there, its keys re-rotated into a new tensor elsewhere."""
        keys, values = msg.kv.keys_values()
        if off != msg.offset:
            keys = rerotate_keys(keys, self._delta(msg, off), self.lm.inv_freq)
        return keys, values

    def placed_copy(self, msg: Message, off: int) -> torch.Tensor:
        """The message's KV [L, 2, H, T, D] at offset `off` in one tensor of the caller's own (which a transform may
        work in place on): one copy, its keys re-rotated in it."""
        kv = msg.kv.copy()
        if off != msg.offset:
            rerotate_keys_(kv[:, 0], self._delta(msg, off), self.lm.inv_freq)
        return kv

    def _delta(self, msg: Message, off: int) -> torch.Tensor:
        """[T]: how far each of the message's tokens moves to be read at offset `off`."""
        return torch.full((msg.num_tokens,), off - msg.offset, dtype=torch.long, device=self.lm.device)

    def commit(self, plan: Plan, request: Request) -> list[str]:
        """Store the messages of the request's stored calls (a reused cached start put back in front); with
        prefix caching, each gets its content key, and prefills also a hidden twin over the same KV that the
        cache keeps after the caller frees its message, until the store evicts it."""
        messages, twins = [], []
        handles = self._paged_handles(request) if self.paged else {}
        for c, call in enumerate(request.calls):
            if not call.store:
                continue
            toks, offset = call.all_tokens, call.offset
            if c in handles:  # (in the blocks it was written to: nothing copied)
                kv = handles[c]
            else:
                kv = request.cache.gather(to_device(call.slots, self.lm.device))
                self.pool.copied["commit"] += kv.nbytes
                if call.prefix is not None:
                    kv = torch.cat([call.prefix.kv.read(), kv], dim=3)
                kv = DenseKV(kv)
            if call.prefix is not None:
                toks, offset = [*call.prefix.token_ids, *toks], call.prefix.offset
            seed = call.content_seed
            keys = self.prefix_cache.keys(seed, toks) if seed is not None else None  # (hashed once)
            messages.append(Message(call.message_id, tuple(toks), kv, offset, call.parents,
                                    call.parent_offsets, self.encoded_by(call.adapter), keys[-1][1] if keys else None,
                                    call.unrecorded))
            if not call.decodes and keys:
                twins.append((keys, replace(messages[-1], id=f"{CACHED_PREFIX}{messages[-1].id}")))
        try:
            with self.store_lock:
                self._store(messages, twins, plan)
        except BaseException:  # (not stored: the blocks they would have held go back with the call's)
            for h in handles.values():  # (only the allocation made here: a cached start's is not this call's)
                h.allocs[-1].release()
            raise
        return [m.id for m in messages]

    def _paged_handles(self, request: Request) -> dict[int, PagedKV]:
        """Each stored call's KV where the call wrote it, by call index: its slots in the pool, after its cached
        start's where that lives in the pool too (a start shipped in is copied as a dense message, the call
        left out here). The calls share one PagedAlloc over every block their slots touch."""
        cache = request.cache
        slots: dict[int, torch.Tensor] = {}
        blocks: set[int] = set()
        for c, call in enumerate(request.calls):
            if call.store and (call.prefix is None or self.at_home(call.prefix)):
                slots[c] = cache.index[to_device(call.slots, cache.index.device)]
                blocks |= cache.blocks_of(call.slots)
        if not slots:
            return {}
        alloc = PagedAlloc(self.pool, sorted(blocks))
        out = {}
        for c, own in slots.items():
            start = request.calls[c].prefix  # (after a cached start: its slots first, in the allocations they lie in)
            out[c] = PagedKV((alloc,), own) if start is None else \
                PagedKV((*start.kv.allocs, alloc), torch.cat([start.kv.index, own]))
        return out

    def _store(self, messages: list[Message], twins: list, plan: Plan) -> None:
        """(store lock held) The committed messages and their prefix-cache twins into the store."""
        self.store.add(messages + [t for _, t in twins])
        self.store.touch(plan.parent_ids)
        for keys, twin in twins:
            self.prefix_cache.insert(keys, twin)
        if self.prefix_cache is not None and len(self.prefix_cache) > 8 * len(self.store) + 4096:
            self.prefix_cache.prune(self.store)


class PlannedKV:
    """One request's KV on the engine's side (engine.scheduler.RequestKV): its plan, the pins on its parents,
    the cached starts lent to it; its work cache assembled over the blocks the scheduler gives it."""

    def __init__(self, committer: Committer, plan: Plan | None, transform: KVTransform | None, pins: list[str],
                 views: list[str]):
        self.committer, self.plan, self.transform, self.pins, self.views = committer, plan, transform, pins, views

    def request(self, grows: bool) -> Request:
        """The scheduler's request for the planned calls (what is left after the prefix cache)."""
        com, plan = self.committer, self.plan
        for call in plan.calls:
            call.start(com.lm.spec.eos_token_ids, com.tokenizer, com.lm.device)
        self.extra = sum(c.may_generate for c in plan.calls)
        own = sum(len(c.tokens) for c in plan.calls) + self.extra
        self.in_place = com.in_place(plan, self.transform, own)
        shared = [(m.kv, off) for (m, off), yes in zip(plan.entries, self.in_place) if yes and not com.at_home(m)]
        capacity = own + sum(m.num_tokens for (m, _), yes in zip(plan.entries, self.in_place) if not yes)
        return Request(plan.calls, to_device(plan.visible, com.lm.device, torch.bool), capacity, self, shared, grows,
                       plan.lead)

    def assemble(self, blocks: list[int], runs: list) -> WorkCache:
        return self.committer.assemble(self.plan, self.extra, self.transform, blocks, self.in_place, runs)

    def commit(self, request: Request) -> list[str]:
        return self.committer.commit(self.plan, request)

    def release(self) -> None:
        com = self.committer
        with com.store_lock:
            com.store.unpin(self.pins)
            for v in self.views:  # the cached prefixes lent to this request
                com.store.free(v)
