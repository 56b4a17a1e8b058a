"""The internal KV ports take calls from the cluster's own replicas only: the cluster token, checked on every RPC."""

import grpc
import pytest

from braid.engine import PrefillCall
from braid.engine.errors import UnknownMessageError
from braid.kv import peer_auth
from braid.kv.collective import open_link
from braid.kv.export import KVExporter, fetch
from braid.kv.grpc_transport import GrpcSender
from braid.kv.receiver import KVReceiver
from braid.protos import kv_pb2, kv_pb2_grpc
from test_kv_grpc import ship_two_branches


def owned_by(session: str):
    def check(session_id: str, message_id: str) -> None:
        if session_id != session:
            raise UnknownMessageError(f"message {message_id!r} is not in session {session_id!r}")
    return check


def test_internal_ports_refuse_calls_without_the_cluster_token(llama_engine, monkeypatch):
    """With $BRAID_CLUSTER_TOKEN set, every RPC kind of KVExport and KVTransfer (unary, server-streaming,
    client-streaming) refuses a call without the token, or with another, with UNAUTHENTICATED and a message
    that names the variable; the cluster's own clients (which attach it) are served as before."""
    monkeypatch.setenv(peer_auth.ENV, "s3cret-token")
    eng = llama_engine
    (mid,) = eng.prefill([PrefillCall("User: a message to fetch.")])
    exporter, receiver = KVExporter(eng, owned_by("s1")), KVReceiver(eng.fingerprint)
    try:
        # the cluster's clients: served
        got = fetch(exporter.address, "s1", mid, eng.fingerprint)
        assert got.token_ids == list(eng.message(mid).token_ids)
        messages, _ = ship_two_branches(eng, receiver, GrpcSender(receiver.address, eng.fingerprint))
        assert receiver.wait("wf:0", idle_timeout=10).token_ids == list(messages[0].token_ids)
        with peer_auth.peer_channel(receiver.address) as channel:  # (unary: answered, not refused)
            assert kv_pb2_grpc.KVTransferStub(channel).Abandon(
                kv_pb2.AbandonRequest(stream_ids=["nothing"], reason="test"), timeout=10) == kv_pb2.PushAck()
        # anyone else: refused, whatever the RPC's kind
        for metadata in (None, [(peer_auth.HEADER, "guess")]):
            with grpc.insecure_channel(exporter.address) as channel:
                with pytest.raises(grpc.RpcError) as e:
                    list(kv_pb2_grpc.KVExportStub(channel).Fetch(
                        kv_pb2.FetchRequest(session_id="s1", message_id=mid), metadata=metadata, timeout=10))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and peer_auth.ENV in e.value.details()
            with grpc.insecure_channel(receiver.address) as channel:
                stub = kv_pb2_grpc.KVTransferStub(channel)
                with pytest.raises(grpc.RpcError) as e:
                    stub.Push(iter([kv_pb2.KVChunk(stream_id="x", fingerprint=eng.fingerprint, open=True)]),
                              metadata=metadata, timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as e:
                    stub.OpenLink(kv_pb2.LinkRequest(link_id="l", backend="gloo"), metadata=metadata, timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # a server of another cluster (another token) is refused by this one's clients, and says so
        monkeypatch.setenv(peer_auth.ENV, "another-cluster")
        with pytest.raises(Exception, match="UNAUTHENTICATED"):
            fetch(exporter.address, "s1", mid, eng.fingerprint)
        with pytest.raises(grpc.RpcError, match="UNAUTHENTICATED"):
            open_link(receiver.address, "l", "gloo")
    finally:
        exporter.stop()
        receiver.stop()
        eng.free(mid)


def test_without_a_token_nothing_is_checked(llama_engine, monkeypatch, caplog):
    """With no $BRAID_CLUSTER_TOKEN (a process of its own, the in-process server), an internal port serves a call
    that carries no token, and says so in the log when it is not on loopback only; ensure_cluster_token makes one."""
    monkeypatch.setenv(peer_auth.ENV, "")  # (unset, and put back as it was after the test)
    eng = llama_engine
    (mid,) = eng.prefill([PrefillCall("User: anyone may fetch this.")])
    exporter = KVExporter(eng, owned_by("s1"))
    try:
        with grpc.insecure_channel(exporter.address) as channel:  # (no metadata at all)
            chunks = list(kv_pb2_grpc.KVExportStub(channel).Fetch(kv_pb2.FetchRequest(session_id="s1", message_id=mid),
                                                                  timeout=10))
        assert [t for c in chunks for t in c.token_ids] == list(eng.message(mid).token_ids)
    finally:
        exporter.stop()
        eng.free(mid)
    with caplog.at_level("WARNING", logger=peer_auth.log.name):
        peer_auth.peer_check("127.0.0.1")
        assert caplog.records == []
        assert peer_auth.peer_check("0.0.0.0") == []
    assert "takes calls from anyone" in caplog.text and peer_auth.ENV in caplog.text
    assert peer_auth.ensure_cluster_token() == peer_auth.cluster_token() and len(peer_auth.cluster_token()) >= 32
    monkeypatch.setenv(peer_auth.ENV, "from-a-file\n")  # (a Secret made with --from-file ends in a newline)
    assert peer_auth.cluster_token() == "from-a-file"
    monkeypatch.setenv(peer_auth.ENV, "tab\tinside")
    with pytest.raises(ValueError, match="printable ASCII"):
        peer_auth.cluster_token()
