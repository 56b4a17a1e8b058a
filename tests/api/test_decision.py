"""The transport: one type for the API's enum (kv.connector.Transport), decided once at the ingress (api.decision)."""

import contextlib
import io
import pickle

import pytest

from braid.api.decision import DecisionInput, decide
from braid.api.workflow import TRANSPORTS, WorkflowConfig
from braid.cli import main as braid_main
from braid.engine.errors import PreconditionError
from braid.kv.connector import Transport
from braid.protos import agent_pb2 as pb
from braid.runtime.convert import requested_transport
from braid.runtime.messages import SynthesizerInfo

INFO = SynthesizerInfo("fp", 4096, 100, kv_bytes_per_token=1000, prefill_tokens_per_s=1e4, link_bytes_per_s=None,
                       calibration="cal", placement="mixed", verified_branches=8, verified_tokens=18,
                       verified_placement="mixed")


def ask(requested=None, configured=None, colocated=False, branches=4, branch_limit=18, placement="mixed",
        staircase=False, **info):
    return decide(DecisionInput(requested, configured, colocated, branches, branch_limit, placement, staircase,
                                SynthesizerInfo(**{**INFO.__dict__, **info})))


def test_the_transport_type_is_the_api_enum():
    """One member per value of agent.proto's Transport but UNSPECIFIED, with its number; its word is what configs,
    metrics and logs say; it survives pickling (Serve carries it between replicas)."""
    assert {f"TRANSPORT_{t.name}": int(t) for t in Transport} == {
        name: number for name, number in pb.Transport.items() if number != pb.TRANSPORT_UNSPECIFIED}
    assert [str(t) for t in Transport] == ["text", "grpc", "collective", "local"] and f"{Transport.GRPC:>5}" == " grpc"
    assert pickle.loads(pickle.dumps(Transport.COLLECTIVE)) is Transport.COLLECTIVE
    assert pb.Decision(transport=Transport.LOCAL).transport == pb.TRANSPORT_LOCAL
    assert [t for t in Transport if t.ships] == [Transport.GRPC, Transport.COLLECTIVE, Transport.LOCAL]
    assert [t for t in Transport if t.remote] == [Transport.GRPC, Transport.COLLECTIVE]
    assert requested_transport(pb.TRANSPORT_UNSPECIFIED) is None and requested_transport(2) is Transport.GRPC
    with pytest.raises(Exception, match="transport 9 is not a Transport value .*TRANSPORT_GRPC") as e:
        requested_transport(9)
    assert e.value.code == "INVALID_ARGUMENT"
    assert TRANSPORTS == ("auto", "text", "grpc", "collective")  # (the cluster's settings: local is colocation's)
    assert WorkflowConfig(kv_transport="collective").configured is Transport.COLLECTIVE
    assert WorkflowConfig().configured is None
    with pytest.raises(ValueError, match="kv_transport 'local' is not one of"):
        WorkflowConfig(kv_transport="local")
    for argv, words in ((["serve", "--kv-transport"], TRANSPORTS),  # (the CLI's choices: the same lists)
                        (["run", "--task", "t", "--transport"], ("unspecified", *(str(t) for t in Transport)))):
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
            braid_main([*argv, "pigeon"])
        assert f"invalid choice: 'pigeon' (choose from {', '.join(map(repr, words))})" in err.getvalue(), argv


def test_the_client_s_ask_and_the_cluster_s_setting_come_first():
    d = ask(requested=Transport.TEXT)
    assert (d.transport, d.reason, d.text_over) == (Transport.TEXT, "requested by the client", 0)
    d = ask(configured=Transport.COLLECTIVE, branch_limit=40)
    assert d.transport is Transport.COLLECTIVE and d.reason.startswith("configured: kv_transport=collective")
    assert d.text_over == 0  # (the client or the cluster chose KV: every branch is read from it)
    d = ask(colocated=True)
    assert d.transport is Transport.LOCAL and "calibration cal" in d.reason


@pytest.mark.parametrize("why, kw", [
    ("no calibration is loaded", {"calibration": ""}),
    ("verified to answer as text does only up to 8 branches; this request has 9", {"branches": 9}),
    ("not verified to answer as text does", {"verified_branches": 0}),
    ("verified at placement mixed; this request asks for sequential", {"placement": "sequential"}),
    ("verified at placement mixed; this request asks for branch_point", {"placement": "branch_point"}),
])
def test_auto_reads_kv_only_inside_the_verified_envelope(why, kw):
    d = ask(**kw)
    assert d.transport is Transport.TEXT and why in d.reason, d.reason


def test_auto_weighs_shipping_against_re_prefill_and_reads_long_branches_from_text():
    d = ask(branch_limit=40)  # (longer than verified: KV shipped, branches over 18 tokens read from their text)
    assert d.transport is Transport.GRPC and d.text_over == 18 and "longer than the 18 tokens" in d.reason
    assert "no link measured yet" in d.reason
    fast, slow = ask(link_bytes_per_s=1e12), ask(link_bytes_per_s=1e3)
    assert fast.transport is Transport.GRPC and "beats re-prefill" in fast.reason
    assert slow.transport is Transport.TEXT and slow.reason.startswith("re-prefill of up to 72 tokens")


def test_a_staircase_gets_kv_or_a_precondition_error():
    """A staircase answers while its branches grow, so no branch can fall back to text at synthesis: past the
    verified length `auto` re-prefills text, and a staircase that would get text is refused."""
    assert ask(staircase=True).text_over == 0 and ask(staircase=True).transport is Transport.GRPC
    with pytest.raises(PreconditionError, match="verified on branches of up to 18 tokens; this request's may reach 40"):
        ask(staircase=True, branch_limit=40)
    assert ask(staircase=True, branch_limit=40, requested=Transport.GRPC).transport is Transport.GRPC
