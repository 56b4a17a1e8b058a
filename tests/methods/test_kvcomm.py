"""KVComm (methods.kvcomm): gamma=0 / V=0 are dense prefill exactly, an anchor reproduces the KV it was
measured on, the pool never exceeds V, and anchors stay within their scope and their engine's model."""

import pytest
import torch

from braid.engine import DecodeCall, Engine, EngineConfig, PrefillCall, SamplingParams
from braid.engine.errors import BraidError
from braid.methods.kvcomm import (
    AgentPrompt,
    AnchorPool,
    KVComm,
    KVCommConfig,
    base_key,
    features,
    interpolate,
    rotate,
    spread,
    unfeatures,
)

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
ROLES = {"critic": "System: you are the critic. Be brief.", "solver": "System: you solve it step by step, then stop."}
TEXTS = ["User: what is two plus three?", "User: name a city by the sea.", "User: is seven a prime number?",
         "User: what colour is the sky?", "User: count to four.", "User: spell the word cat."]


def prompt(agent: str, text: str, second: str | None = None) -> AgentPrompt:
    if second is None:
        return AgentPrompt(agent, ROLES[agent], [("user", text)], [" Answer:"], GREEDY)
    return AgentPrompt(agent, ROLES[agent], [("user", text), ("peer", second)], [" Peer said:", " Answer:"], GREEDY)


def dense_tokens(engine: Engine, p: AgentPrompt) -> tuple[list[int], torch.Tensor]:
    """The reply and the context's KV from a plain dense prefill of the same token segments."""
    tok = engine.tokenize
    context = [t for i, (_, text) in enumerate(p.slots) for t in
               [*tok(text), *(tok(p.joins[i]) if i < len(p.slots) - 1 else [])]]
    pre = engine.prefill([PrefillCall(tok(p.prefix))])
    ctx = engine.prefill([PrefillCall(context, parents=pre)])
    ids = engine.decode([DecodeCall(tok(p.joins[-1]), parents=pre + ctx, sampling=p.sampling)])
    return list(engine.message(ids[0]).token_ids), engine.message(ctx[0]).kv.read()


def pool_of(comm: KVComm, scope: str = "tenant", base: str | None = None) -> AnchorPool:
    """The "user" placeholder's pool of `scope`, for texts read behind `base` (default: the KVComm's own)."""
    behind = comm.base_prefix if base is None else comm.engine.tokenize(base)
    return comm.pools[(scope, "user", base_key(behind))]


def run(comm: KVComm, p: AgentPrompt, scope: str = "tenant"):
    prep, stream = comm.decode_stream(p, scope)
    for _ in stream:
        pass
    return prep, list(comm.engine.message(stream.ids[0]).token_ids), comm.engine.message(prep.parents[1]).kv.read()


@pytest.mark.parametrize("config", [KVCommConfig(gamma=0.0), KVCommConfig(capacity=0)])
def test_gamma_zero_or_no_capacity_is_dense_prefill(llama_engine, config):
    comm = KVComm(llama_engine, config)
    for text in TEXTS[:3]:
        for agent in ROLES:
            p = prompt(agent, text, TEXTS[-1])
            prep, tokens, kv = run(comm, p)
            want_tokens, want_kv = dense_tokens(llama_engine, p)
            assert not prep.reused and tokens == want_tokens
            assert torch.equal(kv, want_kv)
    assert comm.stats()["anchors"] == 0 and comm.stats()["reused"] == 0


def test_an_anchor_reproduces_the_kv_it_was_measured_on(fresh_engine):
    comm = KVComm(fresh_engine, KVCommConfig(gamma=0.3, recompute=0.0), base_prefix="Text:")  # (the paper's method)
    p = prompt("solver", TEXTS[0], TEXTS[1])
    first, dense_reply, dense_kv = run(comm, p)  # no anchors: dense, and the offsets are recorded
    assert not first.reused and [s.new_anchor for s in first.slots] == [True, True]
    again, reply, kv = run(comm, p)  # the same texts: each interpolated from its own anchor alone
    assert again.reused and all(len(s.anchors) == 1 and s.anchors[0][1] == 1.0 for s in again.slots)
    torch.testing.assert_close(kv, dense_kv, rtol=0, atol=2e-5)  # (two fp32 rotations apart)
    assert reply == dense_reply
    other, _, _ = run(comm, prompt("critic", TEXTS[0], TEXTS[1]))  # a text is an anchor per agent: dense first
    assert not other.reused and not any(s.new_anchor for s in other.slots)


def test_a_refreshed_reuse_re_encodes_both_ends_and_frees_everything(fresh_engine):
    """With refresh, a reused context's first and last tokens are re-encoded after the agent's prefix: over an
    anchor measured on the very text (an exact approximation) that is dense prefill's answer again; what
    prepare stored (the approximated context, its middle's view, the two refreshed runs) all goes."""
    eng = fresh_engine
    comm = KVComm(eng, KVCommConfig(gamma=0.3, refresh=1, recompute=0.0), base_prefix="Text:")
    p = prompt("solver", TEXTS[0])
    _, dense_reply, _ = run(comm, p)
    own = lambda: sorted(m for m in eng.store.ids() if not m.startswith("~"))  # noqa: E731 (not the cache's)
    before = own()
    prep, stream = comm.decode_stream(p, "tenant")
    reply = [e.token_id for e in stream]
    assert prep.reused and len(prep.parents) == 4  # prefix, head, middle, tail
    assert [eng.message(m).num_tokens for m in prep.parents[1:]] == [1, len(eng.tokenize(TEXTS[0])) - 2, 1]
    assert reply == dense_reply[-GREEDY.max_tokens:]
    comm.free(prep)
    eng.free(stream.ids[0])
    assert own() == before
    with pytest.raises(ValueError, match="kvcomm refresh"):
        KVCommConfig(refresh=-1)


def test_recompute_re_encodes_the_least_certain_tokens(fresh_engine):
    """`recompute`: that fraction of a reused context's tokens, those with the most doubt, is re-encoded with
    the prefix and the context before it in view. All of them is dense prefill again (its KV, its reply) over
    an inexact approximation; a quarter re-encodes that many tokens; `free` takes everything prepare stored."""
    from braid.methods.synthesis import Runs

    assert Runs.of([5, 1, 2, 3, 9, 9]).spans == ((1, 4), (5, 6), (9, 10))
    eng = fresh_engine
    own = lambda: set(m for m in eng.store.ids() if not m.startswith("~"))  # noqa: E731 (not the cache's)
    longer, text = TEXTS[0] + " " + TEXTS[1], TEXTS[2]  # (an anchor at least as long as the text)
    n = len(eng.tokenize(text))
    for fraction in (1.0, 0.25):
        comm = KVComm(eng, KVCommConfig(gamma=1.0, recompute=fraction), base_prefix="Text:")
        run(comm, prompt("solver", longer))  # dense: the anchor
        p = prompt("solver", text)
        want_reply, want_kv = dense_tokens(eng, p)
        before = own()
        prep, stream = comm.decode_stream(p, "tenant")
        reply = [e.token_id for e in stream]
        approximated = prep.held[0]  # (the whole approximated context; the parents read views of it, and runs)
        recomputed = sum(eng.message(m).num_tokens for m in prep.parents[1:]
                         if eng.message(m).parents != (approximated,))
        assert prep.reused and recomputed == (n if fraction == 1.0 else -(-n // 4))
        if fraction == 1.0:
            assert reply == want_reply[-GREEDY.max_tokens:]
            torch.testing.assert_close(eng.message(prep.parents[1]).kv.read(), want_kv, rtol=0, atol=1e-5)
        comm.free(prep)
        eng.free(stream.ids[0])
        assert own() <= before
    with pytest.raises(ValueError, match="kvcomm recompute"):
        KVCommConfig(recompute=1.5)
    # a long context: whole windows (at most 64 of them) with the most doubt; none of an exact text (-inf)
    comm = KVComm(eng, KVCommConfig(gamma=1.0, recompute=0.04, refresh=1))  # (8 tokens: two windows of 4)
    doubt = torch.zeros(200)
    doubt[[10, 11, 150]] = 1.0  # windows of 4 tokens: [8, 12) and [148, 152) hold them
    assert comm._recomputed(doubt).spans == ((0, 1), (8, 12), (148, 152), (199, 200))  # (and the refresh's ends)
    assert comm._recomputed(torch.full((200,), -float("inf"))).spans == ((0, 1), (199, 200))
    # a window holding exact tokens (-inf) scores its other tokens and re-encodes only them
    doubt[:6] = -float("inf")
    doubt[6] = 5.0
    assert comm._recomputed(doubt).spans == ((0, 1), (6, 12), (199, 200))  # windows [4, 8) less 4-5, and [8, 12)


def test_the_reference_agent_reads_its_own_base_exactly_and_recomputes_nothing(fresh_engine):
    """Texts read behind the solver's own prefix. The solver reading one text: its dense prefill is the text's
    base (no match, no anchor). Reading two, over anchors of other texts: its first text is its base (two fp32
    rotations from dense prefill's KV) and never recomputed; the critic, read against that base, is approximated
    and its doubtful tokens re-encoded. Anchors read behind another base are pooled apart."""
    eng = fresh_engine
    comm = KVComm(eng, KVCommConfig(gamma=1.0, recompute=0.2))
    solver = ROLES["solver"]

    def with_base(agent, text, second=None):
        slots, joins = [("user", text)], [" Answer:"]
        if second is not None:
            slots, joins = [("user", text), ("peer", second)], [" Peer said:", " Answer:"]
        return AgentPrompt(agent, ROLES[agent], slots, joins, GREEDY, base_prefix=solver)

    p = with_base("solver", TEXTS[0])
    want_reply, want_kv = dense_tokens(eng, p)
    prep, reply, kv = run(comm, p)
    assert not prep.reused and not prep.slots[0].new_anchor and torch.equal(kv, want_kv) and reply == want_reply
    assert comm.stats()["anchors"] == 0
    for text in TEXTS[:4]:
        for agent in ROLES:
            run(comm, with_base(agent, text, TEXTS[5]))
    p = with_base("solver", TEXTS[4], TEXTS[5])
    _, want_kv = dense_tokens(eng, p)
    chosen = []
    recomputed = comm._recomputed
    comm._recomputed = lambda doubt: chosen.append((doubt, recomputed(doubt))) or chosen[-1][1]
    prep, _, kv = run(comm, p)
    n = len(eng.tokenize(TEXTS[4]))
    assert prep.reused and len({a for a, _ in prep.slots[0].anchors}) > 1
    assert torch.isinf(chosen[-1][0][:n]).all()  # (the peer's text is in every anchor: exact too)
    assert all(a >= n for a, _ in chosen[-1][1].spans)  # (only the join between them may be re-encoded)
    first = eng.message(prep.held[0] if prep.held else prep.parents[1]).kv.read(0, n)
    torch.testing.assert_close(first, want_kv[:, :, :, :n], rtol=0, atol=2e-5)
    other = run(comm, with_base("critic", TEXTS[4], TEXTS[5]))[0]
    assert other.reused and torch.isfinite(chosen[-1][0][:n]).all() and len(other.parents) > 2
    # anchors are pooled per base prefix: the same text behind the KVComm's own base starts a pool of its own
    assert ("tenant", "user", base_key([])) not in comm.pools
    prep, _, _ = run(comm, prompt("solver", TEXTS[0]))
    assert not prep.reused and prep.slots[0].new_anchor and len(pool_of(comm)) == 1
    assert len(pool_of(comm, base=solver)) > 1


def test_interpolation_is_the_weighted_sum_of_anchor_token_offsets(llama_engine):
    comm = KVComm(llama_engine, KVCommConfig(gamma=1.0, temperature=0.5, recompute=0.0))
    for text in TEXTS[:4]:
        run(comm, prompt("solver", text))
    pool = pool_of(comm)
    text = llama_engine.tokenize(TEXTS[4])
    base = comm._base(comm.base_prefix, text)
    m = pool.match(tuple(text), comm.sketch(base), "solver", comm.config)
    assert m.shareable and torch.allclose(m.weight.sum(dim=1), torch.ones(len(text)))
    got = interpolate(base, [a.offsets["solver"][0] for a in m.anchors], m)
    want = base.clone()  # token rows [T, F]
    for j in range(len(text)):
        for a, t, w in zip(m.anchor[j].tolist(), m.token[j].tolist(), m.weight[j].tolist()):
            want[j] += w * m.anchors[a].offsets["solver"][0][t]
    torch.testing.assert_close(got, want)
    # each token's doubt: the weighted variance of the anchor-token offsets it interpolates (several anchors)
    offsets = [a.offsets["solver"][0] for a in m.anchors]
    assert len({int(a) for a in m.anchor.flatten()}) > 1
    scale = torch.cat([(d ** 2).sum(dim=1) for d in offsets]).mean()
    var = torch.stack([sum(w * ((m.anchors[a].offsets["solver"][0][t] - (got[j] - base[j])) ** 2).sum()
                           for a, t, w in zip(m.anchor[j].tolist(), m.token[j].tolist(), m.weight[j].tolist()))
                       for j in range(len(text))]) / scale
    norms = [a.text_norms("solver") for a in m.anchors]
    torch.testing.assert_close(spread(norms, m, got - base), var, rtol=1e-3, atol=1e-5)
    kv = torch.randn(2, 2, 2, 3, 4)
    assert torch.equal(unfeatures(features(kv), kv), kv)
    prep, _, kv = run(comm, prompt("solver", TEXTS[4]))  # and the reply runs on it, no prefill of the text
    assert prep.reused and kv.shape[3] == len(text)


def test_rotation_to_frame_zero_and_back_is_exact_to_fp32_rounding(llama_engine):
    kv = torch.randn(2, 2, 2, 5, 2 * llama_engine.lm.inv_freq.numel())
    positions = torch.arange(7, 12)
    torch.testing.assert_close(rotate(rotate(kv, -positions, llama_engine.lm.inv_freq), positions,
                                      llama_engine.lm.inv_freq), kv, rtol=0, atol=1e-5)


def test_the_pool_never_exceeds_capacity_and_prunes_the_least_used_of_the_earliest(llama_engine):
    comm = KVComm(llama_engine, KVCommConfig(gamma=0.3, capacity=3))
    for i, text in enumerate(TEXTS):
        run(comm, prompt("solver", text))
        pool = pool_of(comm)
        assert len(pool) <= 3
        if i == 2:  # the pool is full: make the oldest anchor the most used
            pool.anchors[0].uses, pool.anchors[1].uses, kept = 5, 1, pool.anchors[0].id
    assert kept in [a.id for a in pool.anchors]  # the least used of the earliest went, not the oldest
    bare = AnchorPool(0)
    assert bare.capacity == 0 and len(bare) == 0


def test_scopes_never_read_each_others_texts(llama_engine):
    comm = KVComm(llama_engine, KVCommConfig(gamma=1.0))
    for text in TEXTS[:3]:
        run(comm, prompt("solver", text), scope="alice")
    prep, _, _ = run(comm, prompt("solver", TEXTS[0]), scope="bob")  # alice's very text: bob still prefills
    assert not prep.reused and prep.slots[0].new_anchor
    bob = pool_of(comm, "bob")
    alice = {a.id for a in pool_of(comm, "alice").anchors}
    assert len(bob) == 1 and bob.anchors[0].id not in alice
    prep, _, _ = run(comm, prompt("solver", TEXTS[3]), scope="bob")  # bob's match reads bob's anchors alone
    assert prep.reused and {a for a, _ in prep.slots[0].anchors} <= {a.id for a in bob.anchors}


def test_anchors_belong_to_their_engines_model(checkpoint, llama_engine):
    other = Engine(EngineConfig(checkpoint("llama", seed=1)))
    assert other.fingerprint != llama_engine.fingerprint
    mine, theirs = KVComm(llama_engine, KVCommConfig(gamma=1.0)), KVComm(other, KVCommConfig(gamma=1.0))
    run(mine, prompt("solver", TEXTS[0]))
    prep, _, _ = run(theirs, prompt("solver", TEXTS[0]))
    assert not prep.reused and not pool_of(theirs).anchors[0] in pool_of(mine).anchors
    ctx = llama_engine.message(run(mine, prompt("solver", TEXTS[0]))[0].parents[1])
    assert ctx.fingerprint == llama_engine.fingerprint  # an approximated context is this model's message


def test_anchors_of_another_export_format_are_refused(llama_engine):
    from braid.engine.errors import PreconditionError

    comm = KVComm(llama_engine)
    with pytest.raises(PreconditionError, match="format"):  # (pools keyed by placeholder alone, before the base)
        comm.adopt("s", {"fingerprint": llama_engine.fingerprint, "pools": {"user": []}})
    assert comm.export("s") == {} and not comm.pools


def test_bad_prompts_are_refused_with_what_to_fix(llama_engine):
    comm = KVComm(llama_engine)
    with pytest.raises(BraidError, match="at least one placeholder"):
        comm.prepare(AgentPrompt("a", "System:", [], []), "t")
    with pytest.raises(BraidError, match="1 joins for 2 placeholders"):
        comm.prepare(AgentPrompt("a", "System:", [("x", "hi"), ("y", "yo")], [" A:"]), "t")
    with pytest.raises(BraidError, match="placeholder 'x' is empty"):
        comm.prepare(AgentPrompt("a", "System:", [("x", "")], [" A:"]), "t")
    with pytest.raises(BraidError, match="reply's header"):
        comm.prepare(AgentPrompt("a", "System:", [("x", "hi")], [""]), "t")
    for bad in [dict(gamma=-0.1), dict(gamma=1.5), dict(capacity=-1), dict(temperature=0)]:
        with pytest.raises(ValueError, match="kvcomm"):
            KVCommConfig(**bad)


# ---- the agent graph over the gRPC agent API -------------------------------------------------------------
@pytest.fixture(scope="module")
def api(checkpoint):
    import grpc

    from braid.cluster.inprocess import start_in_process
    from braid.protos import agent_pb2_grpc
    from braid.runtime.directory import Directory, EmbeddedRedis

    redis_server = EmbeddedRedis()
    server = start_in_process(Engine(EngineConfig(checkpoint("llama"))), Directory.connect(redis_server.url))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield agent_pb2_grpc.AgentServiceStub(channel), server.sessions
    channel.close()
    server.stop()
    redis_server.stop()


def agents_request(session_id="", kvcomm=True, rounds=2, user=TEXTS[0], **kw):
    from braid.protos import agent_pb2 as pb

    return pb.AgentsRequest(session_id=session_id, user_text=user, rounds=rounds, kvcomm=kvcomm,
                            agents=[pb.AgentSpec(name=n, prefix=p) for n, p in ROLES.items()],
                            sampling=pb.Sampling(max_tokens=4, ignore_eos=True), **kw)


def test_run_agents_reports_every_agent_and_streams_its_tokens(api):
    stub, logic = api
    events = list(stub.RunAgents(agents_request(kvcomm=False)))
    reports = [e.report for e in events if e.HasField("report")]
    tokens = [e.token for e in events if e.HasField("token")]
    done = events[-1].done
    assert [(r.round, r.agent) for r in reports] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [p.name for p in reports[2].placeholders] == ["user", "reply:solver"]  # round 2 reads the peer
    assert not any(r.reused for r in reports) and done.reused == 0 and done.prompts == 4
    assert len(tokens) == 2 * 2 * 4 and len(done.replies) == 2
    for agent in (0, 1):  # the last round's replies are its streamed tokens
        assert done.replies[agent] == "".join(t.token.text for t in tokens if t.round == 1 and t.agent == agent)


def test_run_agents_with_kvcomm_reuses_within_a_session_only(api):
    stub, logic = api
    first = list(stub.RunAgents(agents_request()))
    sid = first[-1].done.session_id
    again = list(stub.RunAgents(agents_request(session_id=sid)))  # the same texts: every anchor is its own
    # (but the first agent's first prompt: it reads the user's text as its base, a prefill the others reuse)
    assert again[-1].done.reused == again[-1].done.prompts - 1 == 3
    dense = list(stub.RunAgents(agents_request(session_id=sid, kvcomm=False)))
    assert [e.token.token.token_id for e in again if e.HasField("token")] == \
        [e.token.token.token_id for e in dense if e.HasField("token")]
    other = list(stub.RunAgents(agents_request()))  # another session: nothing of the first one's anchors
    assert other[-1].done.reused == 0 and other[-1].done.session_id != sid
    # a session's anchors go with it: at once when it is closed here, at the next upkeep when it expired
    from braid.protos import agent_pb2 as pb

    assert {sid, other[-1].done.session_id} <= logic.kvcomm.scopes()
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    assert sid not in logic.kvcomm.scopes() and other[-1].done.session_id in logic.kvcomm.scopes()
    logic.directory.r.delete(f"braid:session:{other[-1].done.session_id}")  # (as its TTL would)
    logic.upkeep()
    assert other[-1].done.session_id not in logic.kvcomm.scopes()


def test_run_agents_refuses_bad_graphs_and_keeps_serving(api):
    import grpc

    from braid.protos import agent_pb2 as pb

    stub, _ = api
    bad = [agents_request(user=""), agents_request(rounds=9),
           pb.AgentsRequest(user_text="hi", agents=[pb.AgentSpec(name="a", prefix="x"), pb.AgentSpec(name="a", prefix="y")]),
           pb.AgentsRequest(user_text="hi", agents=[pb.AgentSpec(name="a", prefix="")])]
    for request in bad:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.RunAgents(request))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details()
    assert list(stub.RunAgents(agents_request(rounds=1)))[-1].done.prompts == 2


def test_a_sessions_anchors_move_to_the_replica_its_call_reaches(checkpoint):
    """Two replicas on one Redis: RunAgents on A measures the session's anchors; the session's next call reaches
    B, which takes them over (KVExport.FetchAnchors, checksummed) and reuses every text at once, as A would have;
    A lets go of them, and the directory names B. Another session, or a closed one, gets none."""
    import grpc

    from braid.cluster.inprocess import start_in_process
    from braid.engine.errors import UnknownMessageError
    from braid.kv.export import fetch_anchors
    from braid.protos import agent_pb2 as pb
    from braid.protos import agent_pb2_grpc
    from braid.runtime.directory import Directory, EmbeddedRedis
    from braid.runtime.sessions import ServiceConfig

    redis_server = EmbeddedRedis()
    servers = [start_in_process(Engine(EngineConfig(checkpoint("llama"))), Directory.connect(redis_server.url),
                                ServiceConfig(replica=name)) for name in ("A", "B")]
    channels = [grpc.insecure_channel(f"127.0.0.1:{s.port}") for s in servers]
    try:
        (a, b) = [agent_pb2_grpc.AgentServiceStub(c) for c in channels]
        logic_a, logic_b = [s.sessions for s in servers]
        first = list(a.RunAgents(agents_request()))
        sid = first[-1].done.session_id
        assert logic_a.directory.anchors(sid) == "A" and sid in logic_a.kvcomm.scopes()
        on_b = list(b.RunAgents(agents_request(session_id=sid)))  # the same texts: each its own anchor, moved
        assert on_b[-1].done.reused == on_b[-1].done.prompts - 1 == 3  # (all but the first agent's first)
        assert sid not in logic_a.kvcomm.scopes() and sid in logic_b.kvcomm.scopes()
        assert logic_a.directory.anchors(sid) == "B"
        dense = list(a.RunAgents(agents_request(session_id=sid, kvcomm=False)))  # (kvcomm off: nothing moves)
        assert [e.token.token.token_id for e in on_b if e.HasField("token")] == \
            [e.token.token.token_id for e in dense if e.HasField("token")]
        assert sid in logic_b.kvcomm.scopes()
        other_done = list(a.RunAgents(agents_request()))[-1].done
        other = other_done.session_id
        assert other_done.reused == 0  # (another session: none of sid's anchors, wherever they are)
        with pytest.raises(UnknownMessageError):  # A holds no anchors of sid any more
            fetch_anchors(logic_a.exporter.address, sid)
        b.CloseSession(pb.CloseSessionRequest(session_id=sid))
        assert sid not in logic_b.kvcomm.scopes()  # closed: B let go of them, and serves none
        with pytest.raises(UnknownMessageError):
            fetch_anchors(logic_b.exporter.address, sid)
        assert other in logic_a.kvcomm.scopes()
    finally:
        for c, s in zip(channels, servers):
            c.close()
            s.stop()
        redis_server.stop()
