"""Planning a request in the caller's thread: its calls checked, their parents placed, the prefix cache's hits reused.

The engine plans every request before it reaches the scheduler (engine.engine.Engine), holding the store's lock
around `plan` and `reuse` so that the parents it places stay what it read. What comes out is a `Plan`: the
calls as the scheduler runs them (engine.call.Call) and the context they read, placed; engine.committer then
assembles its work cache and commits its messages.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from braid.engine.call import Adapter, Call, DecodeCall, PrefillCall, Sibling, Tokens
from braid.engine.config import EngineConfig
from braid.engine.errors import (
    BraidError,
    ContextOverflowError,
    EmptyHeaderError,
    FingerprintMismatchError,
    InvalidOffsetError,
    PreconditionError,
)
from braid.engine.model import ModelSpec
from braid.engine.prefix_cache import PrefixCache, content_seed
from braid.engine.store import Message, MessageStore, new_message_id


@dataclass
class Plan:
    """A request as planned: its calls (engine.call.Call, each what it encodes, where, and what it read) and
    the context they read, placed."""

    entries: list[tuple[Message, int]]  # placed context: (parent, offset), deduplicated
    visible: torch.Tensor  # bool [calls, entries + calls], on the host (the committer's request takes it to the device)
    calls: list[Call]
    lead: int = 0  # the first calls are unstored prefill calls the calls after them read
    # With lead calls, entries are ordered: those only lead calls read (`lead_only` of them), those both sides
    # read, then (after the lead tokens' slots) those only decode calls read: each side's one run.
    lead_only: int = 0
    lead_at: int = 0  # the entry before which the lead tokens' slots go
    mapped: list[bool] = field(default_factory=list)  # per entry: a decode call's copy through the transform

    @property
    def parent_ids(self) -> set[str]:
        return {m.id for m, _ in self.entries}

    def narrowed(self, kept: list[int]) -> "Plan":
        """This plan (no lead calls) with only the calls `kept`, and the entries they read: each call's own
        entries, then its lent cached start (`Call.prefix`, at the offset its message starts), when it has one."""
        assert not self.lead, "a plan with lead calls reads no prefix cache"
        n = len(self.entries)
        visible = self.visible
        used = visible[kept, :n].any(0).nonzero().flatten().tolist()
        entries, mapped = [self.entries[e] for e in used], [self.mapped[e] for e in used]
        columns = [visible[kept][:, used]]
        calls = [self.calls[c] for c in kept]
        for i, call in enumerate(calls):
            if call.prefix is not None:
                entries.append((call.prefix, call.prefix.offset))
                mapped.append(False)
                columns.append(torch.arange(len(calls))[:, None] == i)
        columns.append(torch.eye(len(calls), dtype=torch.bool))  # (each call sees its own rows; no siblings)
        return Plan(entries, torch.cat(columns, dim=1), calls, mapped=mapped)


class Planner:
    """Plans requests for one engine: reads its store (under the store's lock, held by the caller), its prefix
    cache and its adapters; never the scheduler."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, fingerprint: str, tokenize,
                 store: MessageStore, prefix_cache: PrefixCache | None, adapters: dict[str, Adapter]):
        self.config, self.spec, self.fingerprint = config, spec, fingerprint
        self.tokenize = tokenize
        self.store, self.prefix_cache, self.adapters = store, prefix_cache, adapters

    def _as_tokens(self, value: Tokens, what: str, call: int) -> list[int]:
        tokens = self.tokenize(value) if isinstance(value, str) else [int(t) for t in value]
        if not tokens:
            err = EmptyHeaderError if what == "header" else BraidError
            raise err(f"call {call}: {what} is empty; it must hold at least one token")
        bad = [t for t in tokens if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise BraidError(f"call {call}: token id {bad[0]} is outside the vocabulary [0, {self.spec.vocab_size})")
        return tokens

    def check(self, calls: Sequence[PrefillCall | DecodeCall]) -> int:
        """The calls' options, checked: returns how many prefill calls lead the others (unstored, read by the calls
        after them as `Sibling`s): those before a decode request's decode calls, or a prefill request's leading
        unstored calls."""
        if not calls:
            raise BraidError("no calls given")
        decodes = [isinstance(c, DecodeCall) for c in calls]
        lead = decodes.index(True) if any(decodes) else next((i for i, c in enumerate(calls) if c.store), len(calls))
        if any(decodes) and not all(decodes[lead:]):
            raise BraidError(f"call {decodes.index(False, lead)}: a request's prefill calls come before its decode "
                             "calls")
        if not any(decodes) and (lead == len(calls) or not all(c.store for c in calls[lead:])):
            bad = next((i for i in range(lead, len(calls)) if not calls[i].store), lead)
            raise BraidError(f"call {bad}: a prefill call that is not stored is read by the calls after it only: put "
                             "it first, before at least one stored call")
        adapters = {c.adapter for c in calls} - {None}
        for a in adapters:
            if a not in self.adapters:
                raise PreconditionError(f"adapter {a!r} is not loaded on this engine (loaded: "
                                        f"{sorted(self.adapters) or 'none'})")
        if len(adapters) > 1:
            raise BraidError(f"one request runs on one adapter besides the base weights; these calls name "
                             f"{sorted(adapters)}")
        # (a step of short rows may replay a graph captured under one set of weights, over every row:
        # engine.cuda_graphs; only lead calls' rows, never such a step, may run on the base weights beside them)
        if len({c.adapter for c in calls[lead:]}) > 1 or any(c.adapter not in (None, calls[lead].adapter)
                                                             for c in calls[:lead]):
            raise BraidError("a request's calls run on the same weights (its lead prefill calls may run on the base "
                             "ones): name one adapter on all of them, or on none")
        stored = [i for i, c in enumerate(calls[:lead]) if c.store]
        if stored:
            raise BraidError(f"call {stored[0]}: a prefill call ahead of decode calls is read by them only; give "
                             "it store=False (prefill it on its own to store it)")
        named = [c.id for c in calls if isinstance(c, PrefillCall) and c.id is not None]
        taken = [i for i in named if i in self.store or named.count(i) > 1]
        if taken:
            raise BraidError(f"message id {taken[0]!r} is taken: a prefill call's id must be new to the store")
        return lead

    def reuse(self, plan: Plan):
        """Look every call of `plan` (no lead calls, no transform) up in the prefix cache (store lock held). A
        prefill call found whole becomes a message sharing the cached KV at once and leaves the plan; a call
        whose start is cached reads that start as a lent parent (a view, no copy) placed where the call began,
        and encodes only the rest. The plan is amended, not made again. Returns (the plan of what is left or
        None, ready ids by call index, lent view ids)."""
        cache = self.prefix_cache
        for call in plan.calls:
            call.content_seed = content_seed(self.fingerprint, [(self.store.get(p).content_key, off) for p, off in
                                                        zip(call.parents, call.parent_offsets)], call.offset)
        hits = [cache.lookup(c.content_seed, c.tokens, len(c.tokens) - c.decodes, self.store) for c in plan.calls]
        if not any(hits):
            return plan, {}, []
        ready, views, kept = {}, [], []
        for c, (call, hit) in enumerate(zip(plan.calls, hits)):
            if hit is not None:
                msg, n = hit
                kv = msg.kv.part(0, n)  # the same memory (itself when whole)
                self.store.touch([msg.id])
                if n == len(call.tokens):  # a prefill found whole
                    mine = Message(call.message_id, tuple(call.tokens), kv, call.offset, call.parents,
                                   call.parent_offsets, msg.fingerprint, msg.content_key if n == msg.num_tokens else
                                   cache.content_key(call.content_seed, call.tokens))
                    self.store.add([mine])
                    ready[c] = mine.id
                    continue
                call.prefix = Message(f"~prefix-{new_message_id()}", tuple(call.tokens[:n]), kv, call.offset, (),
                                      (), msg.fingerprint)
                self.store.add([call.prefix])
                views.append(call.prefix.id)
                call.tokens, call.offset = call.tokens[n:], call.offset + n
            kept.append(c)
        return (plan.narrowed(kept) if kept else None), ready, views

    def plan(self, calls: Sequence[PrefillCall | DecodeCall], lead: int, mapped_ids=()) -> Plan:
        """Validate the calls and place their parents. The first `lead` calls are prefill calls that the
        others may name as `Sibling(i)` parents. The parents in `mapped_ids` are read mapped by the decode calls
        and unmapped by the lead calls: an entry for each."""
        n = len(calls)
        if n > self.config.max_parallel_calls:
            raise BraidError(f"{n} parallel calls exceed max_parallel_calls={self.config.max_parallel_calls}")
        limit = self.spec.max_positions
        index: dict[tuple[str, int, bool], int] = {}
        entries: list[tuple[Message, int]] = []
        mapped: list[bool] = []
        call_entries, call_siblings, tokens, new_offsets, parent_offsets, unrecorded = [], [], [], [], [], []
        for c, call in enumerate(calls):
            decodes = isinstance(call, DecodeCall)
            toks = self._as_tokens(call.header if decodes else call.message, "header" if decodes else "message", c)
            extra = call.sampling.max_tokens if decodes else 0
            parents = list(call.parents)
            offsets = call.offsets
            if offsets is not None and len(offsets) != len(parents):
                raise InvalidOffsetError(f"call {c}: {len(offsets)} offsets given for {len(parents)} parents")
            end, mine, reads, placed = 0, [], [], []
            for i, pid in enumerate(parents):
                if isinstance(pid, Sibling):
                    if c < lead or not 0 <= pid.index < lead:
                        raise BraidError(f"call {c}: {pid} is not a prefill call of this request that it can read")
                    off = new_offsets[pid.index]
                    if offsets is not None and offsets[i] not in (None, off):
                        raise InvalidOffsetError(f"call {c}: prefill call {pid.index} is encoded at offset {off}, "
                                                 f"not {offsets[i]}")
                    reads.append(pid.index)
                    placed.append(off)
                    end = off + len(tokens[pid.index])
                    continue
                msg = self.store.get(pid)
                if msg.fingerprint != self.fingerprint:
                    raise FingerprintMismatchError(
                        f"call {c}: parent {pid!r} was encoded by model {msg.fingerprint}, this engine runs "
                        f"{self.fingerprint}; re-encode its text with this model")
                off = end if offsets is None or offsets[i] is None else offsets[i]
                if not isinstance(off, int) or off < 0 or off + msg.num_tokens > limit:
                    raise InvalidOffsetError(
                        f"call {c}: offset {off!r} for parent {pid!r} ({msg.num_tokens} tokens) is out of range; "
                        f"it must be an int with 0 <= offset and offset + length <= {limit}")
                key = (pid, off, c >= lead and pid in mapped_ids)  # (mapped: an entry of its own)
                mine.append(index.setdefault(key, len(entries)))
                if mine[-1] == len(entries):
                    entries.append((msg, off))
                    mapped.append(key[2])
                placed.append(off)
                end = off + msg.num_tokens
            new_off = end if call.new_offset is None else call.new_offset
            if not isinstance(new_off, int) or new_off < 0:
                raise InvalidOffsetError(f"call {c}: new_offset {new_off!r} must be a non-negative int")
            if new_off + len(toks) + extra > limit:
                what = "header" if decodes else "message"
                raise ContextOverflowError(
                    f"call {c}: new_offset {new_off} + {len(toks)} {what} tokens + {extra} max new "
                    f"tokens = {new_off + len(toks) + extra} exceeds the context of {limit} positions")
            call_entries.append(mine)
            call_siblings.append(reads)
            # what shaped its KV that its message will not record (a reader of its record cannot encode it again)
            unrecorded.append("a KV transform's copies of its parents" if c >= lead and set(parents) & set(mapped_ids)
                              else "unstored prefill calls of its request" if reads else "")
            tokens.append(toks)
            new_offsets.append(new_off)
            parent_offsets.append(tuple(placed))
        visible = torch.zeros(n, len(entries) + n, dtype=torch.bool)
        for c, mine in enumerate(call_entries):
            visible[c, mine] = True
            visible[c, len(entries) + c] = True
            visible[c, [len(entries) + i for i in call_siblings[c]]] = True
        side = [0] * len(entries)  # 0: only lead calls read it, 1: both sides, 2: only decode calls
        if lead:
            by_lead, by_decode = visible[:lead, :len(entries)].any(0), visible[lead:, :len(entries)].any(0)
            side = (by_decode.long() + (~by_lead).long()).tolist()
            order = sorted(range(len(entries)), key=side.__getitem__)
            entries, mapped = [entries[e] for e in order], [mapped[e] for e in order]
            visible = torch.cat([visible[:, order], visible[:, len(entries):]], dim=1)
            side = sorted(side)
        planned = []
        for call, toks, off, offs, gap in zip(calls, tokens, new_offsets, parent_offsets, unrecorded):
            read = [(p, o) for p, o in zip(call.parents, offs) if not isinstance(p, Sibling)]
            decodes = isinstance(call, DecodeCall)
            planned.append(Call(toks, off, (None if decodes else call.id) or new_message_id(),
                                call.sampling if decodes else None, decodes or call.store, call.adapter,
                                tuple(p for p, _ in read), tuple(o for _, o in read), unrecorded=gap))
        return Plan(entries, visible, planned, lead=lead, mapped=mapped,
                     lead_only=side.count(0) if lead else 0, lead_at=side.count(0) + side.count(1) if lead else 0)
