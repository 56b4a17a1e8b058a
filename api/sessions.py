"""The agent API's session-level RPCs (every one but RunWorkflow, which api.workflow drives) over a replica's sessions.

Every method takes a request proto and returns or yields response protos; errors are BraidErrors carrying the
gRPC status code to send. `caller` is the API key's name the server checked ("" on an open API); the sessions a
call names are its own. The Synthesizer deployment hosts one per replica (cluster: behind the ingress), the
in-process server one for its engine.
"""

import logging
import time
from collections.abc import Iterator

import redis

from braid.engine import DecodeCall
from braid.engine.errors import BraidError
from braid.methods.dag import NodeRound, NodeToken, run_dag
from braid.methods.kvcomm_agents import Agent, AgentGraph, AgentStarted, run_agent_graph
from braid.models.chat import chat_renderer
from braid.protos import agent_pb2 as pb
from braid.runtime import convert
from braid.runtime.sessions import Sessions

log = logging.getLogger(__name__)


class SessionAPI:
    def __init__(self, sessions: Sessions):
        self.sessions, self.engine = sessions, sessions.engine
        self.directory, self.config = sessions.directory, sessions.config
        # (the chat messages of Generate, the choreography calls and graph nodes)
        self.renderer = chat_renderer(self.engine.lm.tokenizer, self.engine.config.model_path)

    def _stream(self, session_id: str, stream) -> Iterator[pb.TokenEvent]:
        """Token events (each call's last one names its message); registers the messages at the end."""
        for event in stream:
            yield convert.token_event(event)
        self.sessions.register(session_id, stream.ids)

    def Health(self, request: pb.HealthRequest, caller: str = "") -> pb.HealthResponse:
        self.directory.r.ping()
        return pb.HealthResponse(status="SERVING", model_fingerprint=self.engine.fingerprint)

    def Prefill(self, request: pb.PrefillRequest, caller: str = "") -> pb.PrefillResponse:
        with self.sessions.for_call(request.session_id, caller) as sid:
            calls = [convert.prefill_call(c, self.renderer, f"calls[{i}]") for i, c in enumerate(request.calls)]
            self.sessions.resolve(sid, {p for c in calls for p in c.parents})
            ids = self.engine.prefill(calls)  # (parents freed since are refused with NOT_FOUND; running, pinned)
            self.sessions.register(sid, ids)
            return pb.PrefillResponse(session_id=sid, message_ids=ids)

    def Decode(self, request: pb.DecodeRequest, caller: str = "") -> Iterator[pb.TokenEvent]:
        with self.sessions.for_call(request.session_id, caller) as sid:
            calls = [convert.decode_call(c, self.config.default_max_tokens, self.renderer, f"calls[{i}]")
                     for i, c in enumerate(request.calls)]
            self.sessions.resolve(sid, {p for c in calls for p in c.parents})
            yield from self._stream(sid, self.engine.decode_stream(calls))

    def Generate(self, request: pb.GenerateRequest, caller: str = "") -> Iterator[pb.TokenEvent]:
        if request.prompt and request.messages:
            raise BraidError("a Generate request sends a prompt or chat messages, not both")
        prompt = (convert.chat_text(self.renderer, request.messages, then="synthesizer") if request.messages
                  else request.prompt)
        with self.sessions.for_call(request.session_id, caller) as sid:
            call = DecodeCall(prompt, sampling=convert.sampling(request.sampling, self.config.default_max_tokens))
            yield from self._stream(sid, self.engine.decode_stream([call]))

    def GetMessage(self, request: pb.GetMessageRequest, caller: str = "") -> pb.MessageInfo:
        self.directory.session(request.session_id, caller)
        self.sessions.resolve(request.session_id, [request.message_id])
        m = self.engine.message(request.message_id)
        return pb.MessageInfo(message_id=m.id, text=self.engine.text(m.id), token_ids=m.token_ids, offset=m.offset,
                              parents=m.parents, fingerprint=m.fingerprint, kv_bytes=m.nbytes)

    def ListSessions(self, request: pb.ListSessionsRequest, caller: str = "") -> pb.ListSessionsResponse:
        return pb.ListSessionsResponse(sessions=[
            pb.SessionInfo(session_id=s.session_id, messages=s.messages, kv_bytes=s.kv_bytes,
                           created_unix=s.created_unix) for s in self.directory.list_sessions(caller)])

    def CloseSession(self, request: pb.CloseSessionRequest, caller: str = "") -> pb.CloseSessionResponse:
        with self.engine.lock:
            records = self.directory.close_session(request.session_id, caller)
            freed = self.engine.discard([rec.message_id for rec in records])
        self.sessions.kvcomm.drop(request.session_id)  # (reached only by the session's owner: close_session checks)
        return pb.CloseSessionResponse(freed_messages=freed)

    def RunAgents(self, request: pb.AgentsRequest, caller: str = "") -> Iterator[pb.AgentsEvent]:
        """A fully connected agent graph (methods.kvcomm_agents); its anchors are this session's alone."""
        with self.sessions.for_call(request.session_id, caller) as sid, \
                self.directory.running(caller, self.config.limits.workflows):
            if request.kvcomm:
                self.sessions.anchors_here(sid)
            yield from self._agents(sid, request)
            if request.kvcomm and sid in self.sessions.kvcomm.scopes():
                try:
                    self.directory.set_anchors(sid, self.config.replica)
                except redis.RedisError as e:  # (its anchors stay here; a call elsewhere measures its own)
                    log.warning("could not record where the anchors of session %s are: %s", sid, e)

    def RunGraph(self, request: pb.GraphRequest, caller: str = "") -> Iterator[pb.GraphEvent]:
        """Any DAG of agent calls (methods.dag), validated whole and its session messages resolved before
        anything runs. Node outputs stay in the session, except those that are private or were encoded with a
        private node in view: a later call could read them from any role, so they go when the graph ends (their
        node-done event names no message). A graph that fails or is left midway keeps nothing."""
        graph = convert.graph(request, self.config.default_max_tokens, self.config.staircase, self.renderer)
        with self.sessions.for_call(request.session_id, caller) as sid, \
                self.directory.running(caller, self.config.limits.workflows):
            self.sessions.resolve(sid, graph.messages)
            start = time.perf_counter()
            dag = run_dag(self.engine, graph, self.sessions.waves(sid) if self.sessions.waves is not None else None)
            registered: list[str] = []  # what the session keeps; the rest goes when the run is freed
            try:
                for event in dag:
                    if isinstance(event, NodeToken):
                        yield pb.GraphEvent(token=pb.GraphToken(node=event.node, token_id=event.token_id,
                                                                text=event.text,
                                                                finish_reason=event.finish_reason or ""))
                    elif isinstance(event, NodeRound):
                        chunks = [pb.GraphChunk(parent=p, start=a, end=b) for p, (a, b) in event.chunks.items()]
                        yield pb.GraphEvent(round=pb.GraphRound(node=event.node, round=event.round, chunks=chunks))
                    else:
                        shown = event.message_id if dag.shareable(event.node) else ""
                        yield pb.GraphEvent(node_done=pb.GraphNodeDone(node=event.node, message_id=shown,
                                                                       text=event.text, reencoded=event.reencoded,
                                                                       replica=event.replica))
                shareable = [mid for name, mid in dag.outputs.items() if dag.shareable(name)]
                self.sessions.register(sid, shareable)  # (while the run still holds them against eviction)
                registered = shareable
            finally:
                dag.free(keep=registered)
            yield pb.GraphEvent(done=pb.GraphDone(session_id=sid, seconds=time.perf_counter() - start))

    def _agents(self, sid: str, request: pb.AgentsRequest) -> Iterator[pb.AgentsEvent]:
        graph = AgentGraph([Agent(a.name, a.prefix) for a in request.agents], request.user_text,
                           request.rounds or 1, request.kvcomm,
                           request.peer_join or AgentGraph.peer_join, request.reply_header or AgentGraph.reply_header,
                           convert.sampling(request.sampling, self.config.default_max_tokens))
        reused = prompts = 0
        events = run_agent_graph(self.sessions.kvcomm, graph, scope=sid)
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
