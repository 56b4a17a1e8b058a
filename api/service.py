"""The agent API's logic over one engine and the directory, free of Ray and gRPC plumbing.

Every method takes a request proto and returns or yields response protos; errors are
BraidErrors carrying the gRPC status code to send. Every id a request names is
resolved through the directory within the request's session first, so a session can
never reach another session's messages.
"""

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import redis

from braid.api import convert
from braid.api.directory import Directory, MessageRecord
from braid.engine import DecodeCall, Engine, PrefillCall
from braid.engine.errors import BraidError, UnknownMessageError
from braid.engine.synthesis import synthesize_stream, synthesize_text_stream
from braid.protos import agent_pb2 as pb
from braid.models.chat import WORKER_HEADER

log = logging.getLogger(__name__)


class SessionElsewhereError(BraidError):
    code = "FAILED_PRECONDITION"


@dataclass
class ServiceConfig:
    replica: str = "local"
    default_max_tokens: int = 128
    max_branches: int = 16
    worker_header: str = WORKER_HEADER  # opens each worker's answer (the reference model's chat role)

    def __post_init__(self):
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if not self.worker_header:
            raise ValueError("worker_header must be non-empty")


class AgentLogic:
    def __init__(self, engine: Engine, directory: Directory, config: ServiceConfig | None = None):
        self.engine = engine
        self.directory = directory
        self.config = config or ServiceConfig()
        self.lock = threading.Lock()  # one engine call at a time; streams hold it while they run

    # ---- sessions and ids -----------------------------------------------------------------------
    def _session(self, session_id: str) -> str:
        if not session_id:
            return self.directory.create_session()
        self.directory.session(session_id)
        return session_id

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

    # ---- RPCs -----------------------------------------------------------------------------------
    def Health(self, request: pb.HealthRequest) -> pb.HealthResponse:
        self.directory.r.ping()
        return pb.HealthResponse(status="SERVING", model_fingerprint=self.engine.fingerprint)

    def Prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        sid = self._session(request.session_id)
        calls = [convert.prefill_call(c) for c in request.calls]
        with self.lock:
            self._resolve(sid, {p for c in calls for p in c.parents})
            ids = self.engine.prefill(calls)
            self.register(sid, ids)
        return pb.PrefillResponse(session_id=sid, message_ids=ids)

    def Decode(self, request: pb.DecodeRequest) -> Iterator[pb.TokenEvent]:
        sid = self._session(request.session_id)
        calls = [convert.decode_call(c, self.config.default_max_tokens) for c in request.calls]
        with self.lock:
            self._resolve(sid, {p for c in calls for p in c.parents})
            yield from self._stream(sid, self.engine.decode_stream(calls))

    def Generate(self, request: pb.GenerateRequest) -> Iterator[pb.TokenEvent]:
        sid = self._session(request.session_id)
        call = DecodeCall(request.prompt, sampling=convert.sampling(request.sampling, self.config.default_max_tokens))
        with self.lock:
            yield from self._stream(sid, self.engine.decode_stream([call]))

    def GetMessage(self, request: pb.GetMessageRequest) -> pb.MessageInfo:
        self._resolve(request.session_id, [request.message_id])
        m = self.engine.message(request.message_id)
        return pb.MessageInfo(message_id=m.id, text=self.engine.text(m.id), token_ids=m.token_ids, offset=m.offset,
                              parents=m.parents, fingerprint=m.fingerprint, kv_bytes=m.nbytes)

    def ListSessions(self, request: pb.ListSessionsRequest) -> pb.ListSessionsResponse:
        return pb.ListSessionsResponse(sessions=[
            pb.SessionInfo(session_id=s.session_id, messages=s.messages, kv_bytes=s.kv_bytes,
                           created_unix=s.created_unix) for s in self.directory.list_sessions()])

    def CloseSession(self, request: pb.CloseSessionRequest) -> pb.CloseSessionResponse:
        freed = 0
        with self.lock:
            for rec in self.directory.close_session(request.session_id):
                if rec.message_id in self.engine.store:
                    self.engine.free(rec.message_id)
                    freed += 1
        return pb.CloseSessionResponse(freed_messages=freed)

    def RunWorkflow(self, request: pb.WorkflowRequest) -> Iterator[pb.WorkflowEvent]:
        """Workers and synthesizer on this one engine: KV moves without a copy, or as text."""
        start = time.perf_counter()
        params = convert.workflow_params(request, self.config.default_max_tokens, self.config.max_branches)
        if request.transport not in (pb.TRANSPORT_UNSPECIFIED, pb.TRANSPORT_LOCAL, pb.TRANSPORT_TEXT):
            raise BraidError(f"transport {pb.Transport.Name(request.transport)} needs separate worker and "
                             "synthesizer engines; this server runs one engine (use TRANSPORT_LOCAL or TEXT)")
        sid = self._session(request.session_id)
        with self.lock:
            prefix = self.engine.prefill([PrefillCall(request.task or " ")])
            contexts = self.engine.prefill([PrefillCall(p, parents=prefix) for p in request.branch_prompts])
            workers = self.engine.decode_stream([DecodeCall(self.config.worker_header, parents=[*prefix, c],
                                                            sampling=params.worker_sampling) for c in contexts])
            for e in workers:
                yield pb.WorkflowEvent(branch_token=pb.BranchToken(branch=e.call, token_id=e.token_id, text=e.text,
                                                                   finish_reason=e.finish_reason or ""))
            branches_done = time.perf_counter()
            self.register(sid, prefix + contexts + workers.ids)
            text_mode = request.transport == pb.TRANSPORT_TEXT
            yield pb.WorkflowEvent(decision=pb.Decision(
                transport=pb.TRANSPORT_TEXT if text_mode else pb.TRANSPORT_LOCAL,
                reason="requested" if request.transport else "colocated engines: KV is reused in place"))
            if text_mode:
                synth = synthesize_text_stream(self.engine, workers.ids, request.synthesis_prompt, prefix=prefix,
                                               sampling=params.answer_sampling)
            else:
                synth = synthesize_stream(self.engine, workers.ids, request.synthesis_prompt, prefix=prefix,
                                          placement=params.placement, sampling=params.answer_sampling)
            first = None
            for event in self._stream(sid, synth):
                if first is None:
                    first = time.perf_counter()
                yield pb.WorkflowEvent(synthesis_token=event)
            yield pb.WorkflowEvent(timings=pb.Timings(ttft_ms=1e3 * (first - start),
                                                      last_branch_to_first_token_ms=1e3 * (first - branches_done)))
            yield pb.WorkflowEvent(done=pb.WorkflowDone(session_id=sid, branch_message_ids=workers.ids,
                                                        answer_message_id=synth.ids[0],
                                                        answer_text=self.engine.text(synth.ids[0])))
