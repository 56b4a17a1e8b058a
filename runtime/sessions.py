"""A replica's sessions over one engine and the directory: their messages, brought here when a call names them.

Every id a call names is resolved through the directory within the call's session first, so a session can
never reach another session's messages. Free of Ray and gRPC plumbing; the RPCs over it are api.sessions.
"""

import logging
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import redis

from braid.engine import Engine, PrefillCall, Sibling
from braid.engine.errors import BraidError, DataLossError, UnavailableError, UnknownMessageError
from braid.kv.connector import TransferError
from braid.kv.export import HolderGoneError, KVExporter, fetch, fetch_anchors, hand_over, reachable
from braid.kv.grpc_transport import GRPC_LIMITS
from braid.kv.peer_auth import peer_channel
from braid.methods.dag import WaveExecutor
from braid.methods.kvcomm import KVComm, KVCommConfig
from braid.methods.staircase import StaircaseSchedule
from braid.methods.synthesis import encode_synthesis_again, read_at
from braid.runtime.directory import Directory, Lineage, MessageRecord
from braid.runtime.quotas import KeyLimits

log = logging.getLogger(__name__)


@dataclass
class ServiceConfig:
    replica: str = "local"
    pool: str = ""  # the replicas that take over each other's messages when one drains (its deployment)
    default_max_tokens: int = 128
    kvcomm: KVCommConfig = KVCommConfig()  # RunAgents' anchor pools (one set per replica, per session)
    limits: KeyLimits = KeyLimits()  # what each API key may hold at once
    # how often a replica renews its address for other replicas and frees its copies of closed or expired
    # sessions' messages
    upkeep_period_s: float = 10.0
    fetch_timeout_s: float = 60.0  # a session's message moving here from the replica that holds it
    # a draining replica's time to hand its messages over to live peers (Sessions.hand_over; 0: none), within the
    # 20 s Serve gives a replica's shutdown by default (graceful_shutdown_timeout_s)
    handover_s: float = 10.0
    staircase: StaircaseSchedule = StaircaseSchedule(strict=False)  # RunGraph's, where a request sets none

    def __post_init__(self):
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.handover_s < 0:
            raise ValueError(f"handover_s must be >= 0 (0: no hand-over), got {self.handover_s}")
        if self.upkeep_period_s <= 0 or self.fetch_timeout_s <= 0:
            raise ValueError(f"upkeep_period_s and fetch_timeout_s must be positive, got {self.upkeep_period_s} "
                             f"and {self.fetch_timeout_s}")


class Sessions:
    """A replica's side of its sessions: their messages here, checked against the directory, moved here from the
    replica that holds them or encoded again from their lineage; lent to graph waves; served to other replicas
    (KVExport); and freed when their session closes or expires (upkeep). The session RPCs (api.sessions) run
    over it."""

    def __init__(self, engine: Engine, directory: Directory, config: ServiceConfig | None = None):
        self.engine = engine
        self.directory = directory
        self.config = config or ServiceConfig()
        self.kvcomm = KVComm(engine, self.config.kvcomm)
        self.exporter: KVExporter | None = None  # (start_upkeep)
        self._held: dict[str, set[str]] = {}  # session -> the ids of its messages this replica stored
        self._held_lock, self._moving_lock, self._stopping = threading.Lock(), threading.Lock(), threading.Event()
        self._moving: dict[str, threading.Lock] = {}  # message id -> the lock of its move here, while it moves
        # RunGraph: where its plain decoding waves run, per session (None: here). Set by the deployment that owns
        # this replica when there are Worker replicas (synthesizer.waves).
        self.waves: Callable[[str], WaveExecutor] | None = None
        self._lent: Counter[tuple[str, str]] = Counter()  # (session, message) lent to a wave's workers
        # messages encoded again from their lineage (runtime.metrics reports these): how many, their tokens, the
        # seconds it took, and why (holders gone, or evictions here)
        self.recovery: Counter[str] = Counter()

    # ---- sessions and ids -----------------------------------------------------------------------
    def for_call(self, session_id: str, caller: str):
        """The call's session (a context manager): a new one for `caller`, or the one named, if it is the
        caller's (within its limits). A session the call opened is closed again if the call fails."""
        return self.directory.session_for_call(session_id, caller, self.config.limits)

    def resolve(self, session_id: str, ids: Iterable[str]) -> None:
        """Every id must be a message of the session (NOT_FOUND otherwise). One held by another replica moves
        here first, under the same id, so a session call works on whichever replica it reaches; one whose holder
        has gone (or evicted it) is encoded again here from its lineage, parents first."""
        for mid in ids:
            rec = self.directory.lookup(session_id, mid)  # (the session's, or NOT_FOUND)
            if mid not in self.engine.store:
                self._bring_here([rec])
            elif rec.replica != self.config.replica and self.directory.replica_address(rec.replica) is None:
                # a copy here, and the holder has gone: this replica holds it now (fenced, as a rebuild is)
                self.directory.take_over(session_id, mid, rec.replica, self.config.replica)

    def _bring_here(self, recs: list[MessageRecord]) -> None:
        """Bring these messages (of one session; none a parent of another) here: each fetched from its holder, and
        those whose holder has gone or lost them encoded again from their lineages, together."""
        with self._moving_here([r.message_id for r in recs]):
            lost = [(rec, why) for rec in recs if rec.message_id not in self.engine.store
                    for why in [self._fetch(rec)] if why]
            if lost:
                self._rebuild(lost)

    @contextmanager
    def _moving_here(self, ids: Iterable[str]):
        """While it lasts, these messages are being brought here by this thread alone (two calls naming the same
        message bring it once; other messages move in parallel)."""
        ids = sorted(set(ids))
        with self._moving_lock:
            locks = [self._moving.setdefault(mid, threading.Lock()) for mid in ids]
        for lock in locks:  # (in one order: two calls bringing overlapping sets never wait on each other)
            lock.acquire()
        try:
            yield
        finally:
            for lock in reversed(locks):
                lock.release()
            with self._moving_lock:
                for mid in ids:
                    self._moving.pop(mid, None)

    def _fetch(self, rec: MessageRecord) -> str:
        """Fetch the message from its holder; where the holder has gone (its address expired, or it refuses
        connections) or lost it, say why it must be encoded again instead ("": it is here now). A slow holder is
        waited for (`fetch_timeout_s`), then the call fails with UNAVAILABLE: it may answer a retry."""
        if rec.replica == self.config.replica:
            return "this replica's store evicted it"
        address = self.directory.replica_address(rec.replica)
        if address is None:
            return f"replica {rec.replica}, which held it, has gone"
        try:
            got = fetch(address, rec.session_id, rec.message_id, rec.fingerprint, self.config.fetch_timeout_s)
        except HolderGoneError as e:
            return f"replica {rec.replica}, which held it, refuses connections ({e})"
        except UnknownMessageError:
            return f"replica {rec.replica}, which held it, no longer has it"
        self.engine.import_message(got.token_ids, got.kv, got.offset, got.fingerprint, got.parents,
                                   got.parent_offsets, message_id=got.message_id)
        self._hold(rec.session_id, [rec.message_id])
        log.info("message %s of session %s moved here from replica %s (%d tokens)", rec.message_id,
                 rec.session_id, rec.replica, rec.tokens)
        try:
            self.directory.relocate(rec.session_id, rec.message_id, self.config.replica)
        except redis.RedisError as e:  # the holder still has it: later moves fetch from there
            log.warning("could not record that %s moved here: %s", rec.message_id, e)
        return ""

    def _cannot(self, rec: MessageRecord, lineage: Lineage | None) -> str:
        """Why the message cannot be encoded again here from its lineage ("": it can)."""
        model, _, adapter = rec.fingerprint.partition("+")
        attached = self.engine.calibration
        digest = attached.record.digest if attached is not None else ""
        if lineage is None or not lineage.token_ids and not lineage.unrecorded:
            return "its lineage was not recorded"
        if lineage.unrecorded:
            return f"its record lacks {lineage.unrecorded}"
        if model != self.engine.fingerprint:
            return f"it was encoded by model {model}, and this replica runs {self.engine.fingerprint}"
        if adapter and adapter not in self.engine.adapters:
            return f"it was encoded with adapter {adapter!r}, which this replica does not load"
        if lineage.synthesis is not None and lineage.synthesis.calibration not in ("", digest):
            return (f"its branches were read through calibration {lineage.synthesis.calibration}, and this "
                    f"replica runs {digest or 'none'}")
        for parent in lineage.parents:
            try:
                self.directory.lookup(rec.session_id, parent)
            except UnknownMessageError:  # (a message another replica's call read that the session never held)
                return f"its parent {parent!r} is not a message of the session"
        return ""

    def _rebuild(self, lost: list[tuple[MessageRecord, str]]) -> None:
        """Encode messages of a session again from their lineages (each with why it was lost; one may be another's
        parent, when its holder seemed alive until the fetch failed), under their own ids, their parents brought
        here first (fetched, or encoded again in turn, a level of the family at a time), and take over as their
        holder from the one that lost each (fenced in the directory: two replicas never both become a message's
        holder; one that loses the race keeps its copy as a moved message). The plain ones, a worker's branch with
        its prompt before it among them, are one prefill on each set of weights; a cache-path answer replays its
        synthesis. DATA_LOSS where a lineage cannot give one again."""
        session_id, why = lost[0][0].session_id, {rec.message_id: why for rec, why in lost}
        lineages = {}
        for rec, _ in lost:
            lineage = self.directory.lineage(session_id, rec.message_id)
            self.recovery["holder_losses" if rec.replica != self.config.replica else "evictions"] += 1
            cannot = self._cannot(rec, lineage)
            if cannot:
                raise DataLossError(f"message {rec.message_id!r} of session {session_id!r} is lost "
                                    f"({why[rec.message_id]}) and "
                                    f"cannot be encoded again: {cannot}. Run the call that made it again")
            lineages[rec.message_id] = lineage
        # (a message whose holder seemed alive was lost with its parents: those among `lost` are encoded first)
        parents = list(dict.fromkeys(p for lin in lineages.values() for p in lin.parents if p not in lineages))
        for attempt in range(3):  # (parents first: moved here, or encoded again; then kept until the prefill runs)
            for level in self._missing_in_levels(session_id, parents):
                self._bring_here(level)
            self.resolve(session_id, parents)
            try:
                held = self.engine.hold(parents)
                break
            except UnknownMessageError:  # (one evicted while another was brought: bring it again)
                if attempt == 2:
                    raise UnavailableError(f"messages {sorted(lineages)}: their parents could not all be kept in "
                                           "this replica's store at once (it is full); retry the call") from None
        start = time.perf_counter()
        # (one brought here meanwhile by a call that did not wait for this one is left as it is)
        todo = [(rec, lineages[rec.message_id]) for rec, _ in lost if rec.message_id not in self.engine.store]
        left = dict.fromkeys(rec.message_id for rec, _ in todo)
        try:
            while left:  # a level at a time: the messages none of whose parents is still to be encoded
                ready = [(rec, lin) for rec, lin in todo if rec.message_id in left and not set(lin.parents) & set(left)]
                if not ready:  # (lineages that read each other in a circle: no record the engine wrote)
                    raise DataLossError(f"messages {sorted(left)} of session {session_id!r} name each other as "
                                        "parents: they cannot be encoded again. Run the calls that made them again")
                self._encode_again([(rec, lin) for rec, lin in ready if lin.synthesis is None])
                for rec, lin in ready:
                    if lin.synthesis is not None:
                        self._replay(rec, lin)
                held += self.engine.hold([rec.message_id for rec, _ in ready])  # (read by the next level)
                for rec, _ in ready:
                    del left[rec.message_id]
        finally:
            self.engine.release(held)
        self.recovery["seconds"] += time.perf_counter() - start
        for rec, lin in todo:
            self._hold(session_id, [rec.message_id])
            self.recovery["messages"] += 1
            self.recovery["tokens"] += len(lin.token_ids) + len(lin.context)
            took = rec.replica == self.config.replica or self.directory.take_over(
                session_id, rec.message_id, rec.replica, self.config.replica)
            log.info("message %s of session %s encoded again here (%s; %d tokens)%s", rec.message_id, session_id,
                     why[rec.message_id], len(lin.token_ids), "" if took else ", a copy: another replica took it over "
                     "first")

    def _encode_again(self, todo: list[tuple[MessageRecord, Lineage]]) -> None:
        """Plain messages encoded again from their lineages: one prefill per set of weights (as many calls at once as
        the engine takes), a message's unkept context as an unstored call before it that it reads."""
        by_adapter: dict[str, list[tuple[MessageRecord, Lineage]]] = {}
        for rec, lin in todo:
            by_adapter.setdefault(rec.fingerprint.partition("+")[2], []).append((rec, lin))
        step = max(1, self.engine.config.max_parallel_calls // 2)  # (a message and its context: two calls)
        for adapter, group in by_adapter.items():
            for i in range(0, len(group), step):
                contexts, calls = [], []
                for rec, lin in group[i:i + step]:
                    parents, offsets = list(lin.parents), list(lin.parent_offsets)
                    if lin.context:
                        contexts.append(PrefillCall(list(lin.context), parents=list(parents), offsets=list(offsets),
                                                    new_offset=lin.offset - len(lin.context), store=False))
                        parents, offsets = [*parents, Sibling(len(contexts) - 1)], [*offsets, None]
                    calls.append(PrefillCall(list(lin.token_ids), parents=parents, offsets=offsets,
                                             new_offset=lin.offset, adapter=adapter or None, id=rec.message_id))
                self.engine.prefill(contexts + calls)

    def _replay(self, rec: MessageRecord, lineage: Lineage) -> None:
        """A cache-path answer encoded again: its synthesis replayed over its prefix and branches (here now), through
        the calibration its record names (checked: this replica's)."""
        record = lineage.synthesis
        placed = read_at(self.engine, record.prefix, record.branches, record.placement)
        if tuple(placed) != tuple(lineage.parent_offsets):
            raise DataLossError(f"message {rec.message_id!r} of session {rec.session_id!r} read its branches at "
                                f"offsets {list(lineage.parent_offsets)}, and encoding it again would read them at "
                                f"{placed}: it cannot be encoded again. Run the call that made it again")
        hooks = self.engine.calibration.hooks if record.calibration else None
        encode_synthesis_again(self.engine, record, lineage.token_ids, rec.message_id, hooks)

    def _missing_in_levels(self, session_id: str, ids: Iterable[str]) -> list[list[MessageRecord]]:
        """Of `ids` and their ancestors, those missing here (a moved message's ancestors only where its holder has
        gone: it is encoded again here), in levels: each level's messages read only messages here or in the levels
        before it, so each level is brought here together. Walked with a stack of its own, so that a long chain of
        turns is brought back one message at a time without a recursion as deep as the chain."""
        order: list[MessageRecord] = []
        seen, reads = set(), {}
        stack = [(mid, None) for mid in reversed(list(ids))]  # (id, its record once its parents are pushed)
        while stack:
            mid, ready = stack.pop()
            if ready is not None:
                order.append(ready)
                continue
            if mid in seen or mid in self.engine.store:
                continue
            seen.add(mid)
            try:
                rec = self.directory.lookup(session_id, mid)
            except UnknownMessageError:  # (not the session's: its child's rebuild says DATA_LOSS)
                continue
            stack.append((mid, rec))
            reads[mid] = []
            if rec.replica == self.config.replica or self.directory.replica_address(rec.replica) is None:
                lineage = self.directory.lineage(session_id, mid)
                reads[mid] = list(lineage.parents if lineage else ())
                stack += [(p, None) for p in reversed(reads[mid])]
        level: dict[str, int] = {}
        for rec in order:
            level[rec.message_id] = 1 + max((level[p] for p in reads[rec.message_id] if p in level), default=-1)
        levels: list[list[MessageRecord]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
        for rec in order:
            levels[level[rec.message_id]].append(rec)
        return levels

    def _hold(self, session_id: str, ids: Iterable[str]) -> None:
        with self._held_lock:
            self._held.setdefault(session_id, set()).update(ids)

    # ---- between replicas: serving this replica's messages, freeing those of sessions gone ---------
    @contextmanager
    def lend(self, session_id: str, ids: Iterable[str]):
        """While it lasts, KVExport serves these messages to callers naming `session_id`, though the directory
        does not list them (a graph's outputs and re-encoded copies, which its workers read), and they are kept
        from eviction (the workers fetch them while it lasts)."""
        ids = set(ids)
        keys = [(session_id, mid) for mid in ids]
        held = self.engine.hold(ids)  # (NOT_FOUND if one has gone already)
        with self._held_lock:
            self._lent.update(keys)
        try:
            yield
        finally:
            with self._held_lock:
                self._lent.subtract(keys)
                self._lent += Counter()
            self.engine.release(held)

    def hand_over(self, budget_s: float | None = None) -> dict[str, int]:
        """The replica drains (a scale-down, a rolling update): its session messages go to live peers before it does,
        within `budget_s` (ServiceConfig.handover_s): each peer fetches its share from here (KVExport) and becomes its
        holder, a session's messages to one peer. What is not handed over in time stays to be encoded again where a
        call needs it. Called by the deployment that owns this replica, before stop_upkeep. Returns the counts."""
        budget = self.config.handover_s if budget_s is None else budget_s
        start = time.monotonic()
        with self._held_lock:
            held = {sid: sorted(ids) for sid, ids in self._held.items()}
        report = {"held": 0, "handed_over": 0, "left": 0}
        if self.exporter is None or budget <= 0 or not held:
            return report
        try:
            alive = self.directory.open_sessions(held)
            here = [(sid, mid, self._holder(sid, mid)) for sid in sorted(alive) for mid in held[sid]
                    if mid in self.engine.store]
            gone = {h for h in {h for _, _, h in here} - {"", self.config.replica} if not self._answers(h)}
            # (a copy whose holder has gone, crashed with its address still announced, is this replica's first)
            mine = [(sid, mid) for sid, mid, h in here if h == self.config.replica
                    or h in gone and self.directory.take_over(sid, mid, h, self.config.replica)]
            announced = self.directory.replicas(self.config.pool)
        except redis.RedisError as e:
            log.warning("no hand-over, the control plane is unavailable: %s", e)
            return report
        # (live ones only: a crashed replica's address stays announced until it expires)
        peers = sorted(a for r, a in announced.items() if r != self.config.replica and reachable(a))
        report.update(held=len(mine), left=len(mine))
        if not mine or not peers:
            log.info("draining: %d session messages held here, %s", len(mine),
                     "no live replica to hand them to" if mine else "nothing to hand over")
            return report
        shares: dict[str, list[tuple[str, str]]] = {}
        for sid, mid in mine:
            shares.setdefault(peers[zlib.crc32(sid.encode()) % len(peers)], []).append((sid, mid))

        def give(peer: str) -> int:  # (to the next live peer where one fails, while the budget lasts)
            for to in peers[peers.index(peer):] + peers[:peers.index(peer)]:
                left = budget - (time.monotonic() - start)
                if left <= 0:
                    return 0
                try:
                    adopted, skipped = hand_over(to, self.config.replica, self.exporter.address, shares[peer], left)
                except TransferError as e:
                    log.warning("draining: %s", e)
                    continue
                if skipped:
                    log.info("draining: %d messages not taken by %s (%s)", len(skipped), to, "; ".join(skipped[:3]))
                return len(adopted)
            return 0

        with ThreadPoolExecutor(len(shares), thread_name_prefix="hand-over") as pool:
            report["handed_over"] = sum(pool.map(give, shares))
        report["left"] = report["held"] - report["handed_over"]
        log.info("draining: handed %d of %d session messages over to %d replicas in %.2f s", report["handed_over"],
                 report["held"], len(shares), time.monotonic() - start)
        return report

    def _answers(self, replica: str) -> bool:
        """Whether `replica` is announced and takes a connection where it serves its messages."""
        address = self.directory.replica_address(replica)
        return address is not None and reachable(address)

    def _holder(self, session_id: str, message_id: str) -> str:
        try:
            return self.directory.lookup(session_id, message_id).replica
        except UnknownMessageError:
            return ""

    def adopt(self, holder: str, holder_address: str, messages: list[tuple[str, str]],
              deadline: float) -> tuple[list[str], list[str]]:
        """KVExport's Adopt: a draining replica's messages, fetched from it by the monotonic `deadline` and held
        here from now on; the directory's holder changes from it to this replica (fenced: a message another
        replica took over meanwhile is skipped). Returns the ids taken and the skipped ones ("id: why")."""
        adopted, skipped = [], []
        with peer_channel(holder_address, options=GRPC_LIMITS) as channel:
            for sid, mid in messages:
                left = deadline - time.monotonic()
                if left <= 0:
                    skipped.append(f"{mid}: out of time")
                    continue
                try:
                    with self._moving_here([mid]):
                        rec = self.directory.lookup(sid, mid)
                        if rec.replica != holder:
                            skipped.append(f"{mid}: held by {rec.replica}")
                            continue
                        if mid not in self.engine.store:
                            got = fetch(holder_address, sid, mid, rec.fingerprint, left, channel)
                            self.engine.import_message(got.token_ids, got.kv, got.offset, got.fingerprint,
                                                       got.parents, got.parent_offsets, message_id=mid)
                        self._hold(sid, [mid])
                        if not self.directory.take_over(sid, mid, holder, self.config.replica):
                            skipped.append(f"{mid}: another replica took it over first")
                            continue
                except (BraidError, redis.RedisError) as e:
                    skipped.append(f"{mid}: {type(e).__name__}: {e}")
                    continue
                adopted.append(mid)
                self.recovery["adopted"] += 1
        log.info("took %d messages over from draining replica %s (%d skipped)", len(adopted), holder, len(skipped))
        return adopted, skipped

    def _export_anchors(self, session_id: str) -> dict:
        """KVExport's FetchAnchors: an open session's anchor pools, leaving this replica for the caller's."""
        self.directory.session(session_id)  # (NOT_FOUND once closed or expired)
        state = self.kvcomm.export(session_id, drop=True)
        if not state:
            raise UnknownMessageError(f"replica {self.config.replica} holds no anchors of session {session_id!r}")
        log.info("anchors of session %s leave for another replica (%d pools)", session_id, len(state["pools"]))
        return state

    def anchors_here(self, session_id: str) -> None:
        """Before a RunAgents call: the session's anchor pools move here from the replica that holds them (the
        directory says which), so a session keeps its reuse on whichever replica a call reaches. Anchors are a
        cache: when they cannot move, they are measured again here."""
        holder = self.directory.anchors(session_id)
        if holder is None or holder == self.config.replica or session_id in self.kvcomm.scopes():
            return
        address = self.directory.replica_address(holder)
        try:
            if address is None:
                raise UnknownMessageError(f"replica {holder} has gone")
            taken = self.kvcomm.adopt(session_id, fetch_anchors(address, session_id, self.config.fetch_timeout_s))
            log.info("anchors of session %s moved here from replica %s (%d)", session_id, holder, taken)
            self.directory.set_anchors(session_id, self.config.replica)  # (at once: the holder let go of them)
        except Exception as e:  # noqa: BLE001 - a cache: whatever failed, the call goes on without it
            log.warning("the anchors of session %s stay behind (%s); they are measured again here", session_id, e)

    def _exportable(self, session_id: str, message_id: str) -> None:
        """KVExport's check: the message is the session's (the directory says so), or lent to it."""
        with self._held_lock:
            if self._lent[(session_id, message_id)]:
                return
        self.directory.lookup(session_id, message_id)

    def start_upkeep(self, host: str = "127.0.0.1") -> str:
        """Serve this replica's session messages to the other replicas (KVExport), announce where, and every
        `upkeep_period_s` renew that and free the messages held here of sessions closed (on any replica) or
        expired. Returns the address. Called once by the deployment that owns this replica."""
        if self.exporter is not None:
            return self.exporter.address
        self.exporter = KVExporter(self.engine, self._exportable, host, anchors=self._export_anchors,
                                   adopt=self.adopt)
        self._upkeep_round()
        threading.Thread(target=self._upkeep_loop, daemon=True, name="session-upkeep").start()
        return self.exporter.address

    def stop_upkeep(self) -> None:
        """The replica is going away (drained, replaced by an update): nothing more is served from it, and its
        address goes at once, so a call that needs one of its messages encodes it again from its lineage without
        waiting for the address to expire."""
        self._stopping.set()
        if self.exporter is not None:
            self.exporter.stop()
            try:
                self.directory.forget_replica(self.config.replica, self.config.pool)
            except redis.RedisError as e:  # it expires anyway, in 3 upkeep periods
                log.warning("could not withdraw replica %s's address: %s", self.config.replica, e)

    def _upkeep_loop(self) -> None:
        while not self._stopping.wait(self.config.upkeep_period_s):
            self._upkeep_round()

    def _upkeep_round(self) -> None:
        try:
            self.upkeep()
        except redis.RedisError as e:  # the next round tries again
            log.warning("session upkeep skipped, control plane unavailable: %s", e)

    def upkeep(self) -> int:
        """One round: renew the announcement, free what this replica holds of sessions gone. Returns the
        number of messages freed."""
        if self.exporter is not None and not self._stopping.is_set():  # (a draining replica stays withdrawn)
            self.directory.announce_replica(self.config.replica, self.exporter.address,
                                            int(3 * self.config.upkeep_period_s) + 1, self.config.pool)
        with self._held_lock:
            sessions = list(set(self._held) | self.kvcomm.scopes())
        gone = set(sessions) - self.directory.open_sessions(sessions)
        freed = 0
        for sid in gone:
            self.kvcomm.drop(sid)  # (RunAgents' anchors: this session's alone)
            with self._held_lock:
                ids = self._held.pop(sid, set())
            freed += self.engine.discard(ids)  # (gone already: freed by CloseSession here, or evicted)
        if freed:
            log.info("freed %d messages of %d closed or expired sessions", freed, len(gone))
        return freed

    def register(self, session_id: str, ids: list[str], lineages: dict[str, Lineage] | None = None) -> bool:
        """Record new messages in the directory, each with its lineage: as its message records it, or as the
        caller knows it more fully (`lineages`: a synthesis's branches and answer). Best effort: losing Redis must
        not lose a running request, so a failure is logged and reported (False); the messages stay in the store. A
        session gone while the call ran (closed, or lost with a restarted Redis) gets none: they are freed, and
        that is reported the same way; the call still returns what it made."""
        self._hold(session_id, ids)
        try:
            for mid in ids:
                try:
                    m = self.engine.message(mid)
                except UnknownMessageError:  # evicted already (store pressure): nothing to record
                    log.warning("message %s of session %s was evicted before it was registered", mid, session_id)
                    continue
                self.directory.register(MessageRecord(
                    mid, session_id, self.config.replica, m.fingerprint, m.num_tokens, m.nbytes,
                    (lineages or {}).get(mid) or Lineage(m.token_ids, m.offset, m.parents, m.parent_offsets,
                                                         m.unrecorded)))
            return True
        except UnknownMessageError as e:
            log.warning("%s", e)
            self.engine.discard(ids)
            return False
        except redis.RedisError as e:
            log.warning("control plane unavailable, %d messages of session %s not registered: %s",
                        len(ids), session_id, e)
            return False
