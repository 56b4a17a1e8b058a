"""The session-level agent API over one engine and the directory, free of Ray and gRPC plumbing.

Every method takes a request proto and returns or yields response protos; errors are
BraidErrors carrying the gRPC status code to send. Every id a request names is
resolved through the directory within the request's session first, so a session can
never reach another session's messages.
"""

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import redis

from braid.api import convert
from braid.api.auth import KeyLimits
from braid.api.directory import Directory, MessageRecord
from braid.engine import DecodeCall, Engine
from braid.engine.agent_graph import Agent, AgentGraph, AgentStarted, run_agent_graph
from braid.engine.errors import BraidError, UnknownMessageError
from braid.engine.kvcomm import KVComm, KVCommConfig
from braid.protos import agent_pb2 as pb

log = logging.getLogger(__name__)


class SessionElsewhereError(BraidError):
    code = "FAILED_PRECONDITION"


@dataclass
class ServiceConfig:
    replica: str = "local"
    default_max_tokens: int = 128
    kvcomm: KVCommConfig = KVCommConfig()  # RunAgents' anchor pools (one set per replica, per session)
    limits: KeyLimits = KeyLimits()  # what each API key may hold at once

    def __post_init__(self):
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")


class AgentLogic:
    def __init__(self, engine: Engine, directory: Directory, config: ServiceConfig | None = None):
        self.engine = engine
        self.directory = directory
        self.config = config or ServiceConfig()
        self.kvcomm = KVComm(engine, self.config.kvcomm)

    # ---- sessions and ids -----------------------------------------------------------------------
    def _session(self, session_id: str, caller: str) -> str:
        """The call's session: a new one for `caller`, or the one named, if it is the caller's (within its
        limits)."""
        return self.directory.open_session(session_id, caller, self.config.limits)

    def _resolve(self, session_id: str, ids) -> None:
        for mid in ids:
            rec = self.directory.lookup(session_id, mid)
            if rec.replica != self.config.replica:
                raise SessionElsewhereError(
                    f"message {mid!r} is held by synthesizer replica {rec.replica}, but this call reached "
                    f"{self.config.replica}; run session calls with one synthesizer replica "
                    "(synthesizer_replicas=1) until session-affine routing lands")
            if mid not in self.engine.store:
                raise UnknownMessageError(f"message {mid!r} was evicted from {self.config.replica}'s store")

    def register(self, session_id: str, ids: list[str]) -> bool:
        """Record new messages in the directory. Best effort: losing Redis must not lose a running
        request, so a failure is logged and reported (False); the messages stay in the store."""
        try:
            for mid in ids:
                m = self.engine.message(mid)
                self.directory.register(MessageRecord(mid, session_id, self.config.replica, m.fingerprint,
                                                      m.num_tokens, m.nbytes))
            return True
        except redis.RedisError as e:
            log.warning("control plane unavailable, %d messages of session %s not registered: %s",
                        len(ids), session_id, e)
            return False

    def _stream(self, session_id: str, stream) -> Iterator[pb.TokenEvent]:
        """Token events (each call's last one names its message); registers the messages at the end."""
        for event in stream:
            yield convert.token_event(event)
        self.register(session_id, stream.ids)

    # ---- RPCs: `caller` is the API key's name the server checked ("" on an open API); sessions are its own ----
    def Health(self, request: pb.HealthRequest, caller: str = "") -> pb.HealthResponse:
        self.directory.r.ping()
        return pb.HealthResponse(status="SERVING", model_fingerprint=self.engine.fingerprint)

    def Prefill(self, request: pb.PrefillRequest, caller: str = "") -> pb.PrefillResponse:
        sid = self._session(request.session_id, caller)
        calls = [convert.prefill_call(c) for c in request.calls]
        self._resolve(sid, {p for c in calls for p in c.parents})
        ids = self.engine.prefill(calls)  # (parents freed since are refused with NOT_FOUND; running, pinned)
        self.register(sid, ids)
        return pb.PrefillResponse(session_id=sid, message_ids=ids)

    def Decode(self, request: pb.DecodeRequest, caller: str = "") -> Iterator[pb.TokenEvent]:
        sid = self._session(request.session_id, caller)
        calls = [convert.decode_call(c, self.config.default_max_tokens) for c in request.calls]
        self._resolve(sid, {p for c in calls for p in c.parents})
        yield from self._stream(sid, self.engine.decode_stream(calls))

    def Generate(self, request: pb.GenerateRequest, caller: str = "") -> Iterator[pb.TokenEvent]:
        sid = self._session(request.session_id, caller)
        call = DecodeCall(request.prompt, sampling=convert.sampling(request.sampling, self.config.default_max_tokens))
        yield from self._stream(sid, self.engine.decode_stream([call]))

    def GetMessage(self, request: pb.GetMessageRequest, caller: str = "") -> pb.MessageInfo:
        self.directory.session(request.session_id, caller)
        self._resolve(request.session_id, [request.message_id])
        m = self.engine.message(request.message_id)
        return pb.MessageInfo(message_id=m.id, text=self.engine.text(m.id), token_ids=m.token_ids, offset=m.offset,
                              parents=m.parents, fingerprint=m.fingerprint, kv_bytes=m.nbytes)

    def ListSessions(self, request: pb.ListSessionsRequest, caller: str = "") -> pb.ListSessionsResponse:
        return pb.ListSessionsResponse(sessions=[
            pb.SessionInfo(session_id=s.session_id, messages=s.messages, kv_bytes=s.kv_bytes,
                           created_unix=s.created_unix) for s in self.directory.list_sessions(caller)])

    def CloseSession(self, request: pb.CloseSessionRequest, caller: str = "") -> pb.CloseSessionResponse:
        freed = 0
        with self.engine.lock:
            for rec in self.directory.close_session(request.session_id, caller):
                try:  # (one a running call uses goes when the call ends)
                    self.engine.free(rec.message_id, when_unpinned=True)
                    freed += 1
                except UnknownMessageError:  # evicted already
                    pass
        return pb.CloseSessionResponse(freed_messages=freed)

    def RunAgents(self, request: pb.AgentsRequest, caller: str = "") -> Iterator[pb.AgentsEvent]:
        """A fully connected agent graph (engine.agent_graph); its anchors are this session's alone."""
        sid = self._session(request.session_id, caller)
        with self.directory.running(caller, self.config.limits.workflows):
            yield from self._agents(sid, request)

    def _agents(self, sid: str, request: pb.AgentsRequest) -> Iterator[pb.AgentsEvent]:
        graph = AgentGraph([Agent(a.name, a.prefix) for a in request.agents], request.user_text,
                           request.rounds or 1, request.kvcomm,
                           request.peer_join or AgentGraph.peer_join, request.reply_header or AgentGraph.reply_header,
                           convert.sampling(request.sampling, self.config.default_max_tokens))
        reused = prompts = 0
        events = run_agent_graph(self.kvcomm, graph, scope=sid)
        try:
            while True:
                item = next(events)
                if isinstance(item, AgentStarted):
                    p = item.prepared
                    prompts += 1
                    reused += p.reused
                    yield pb.AgentsEvent(report=pb.AgentReport(
                        round=item.round, agent=item.agent, reused=p.reused, prepare_ms=1e3 * p.seconds,
                        placeholders=[pb.PlaceholderReport(name=s.placeholder, tokens=s.tokens, reused=s.reused,
                                                           anchor_ids=[a for a, _ in s.anchors],
                                                           anchor_weights=[w for _, w in s.anchors],
                                                           new_anchor=s.new_anchor) for s in p.slots]))
                else:
                    token = convert.token_event(item.event)
                    token.message_id = ""  # (the graph frees its messages when it ends)
                    yield pb.AgentsEvent(token=pb.AgentToken(round=item.round, agent=item.agent, token=token))
        except StopIteration as done:
            yield pb.AgentsEvent(done=pb.AgentsDone(session_id=sid, replies=done.value, reused=reused,
                                                    prompts=prompts))
        finally:
            events.close()
