"""API keys on every RPC of the agent API, and TLS, over a real gRPC server, a real Redis and `braid run`."""

import contextlib
import datetime
import io
import os
import subprocess
import sys

import grpc
import pytest

from braid.api.auth import (
    ENV_CLIENT_KEY,
    ApiKeys,
    client_key,
    client_metadata,
    drop_local_key,
    local_key,
    local_key_path,
    make_local_key,
)
from braid.cli import main as braid_main
from braid.cluster.inprocess import start_in_process
from braid.engine import Engine, EngineConfig
from braid.protos import agent_pb2 as pb
from braid.protos import agent_pb2_grpc
from braid.runtime.directory import Directory, EmbeddedRedis

ALICE, BOB = "k-alice-0123456789abcdef", "k-bob-0123456789abcdef"


def self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, as PEM files."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "braid-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    keys_file = tmp / "keys"
    keys_file.write_text(f"# team keys\nalice:{ALICE}\n{BOB}\n")
    cert, key = self_signed(tmp)
    redis = EmbeddedRedis()
    engine = Engine(EngineConfig(checkpoint("llama")))
    srv = start_in_process(engine, Directory.connect(redis.url), keys=ApiKeys.load(str(keys_file), env={}),
                           tls=(cert, key))
    credentials = grpc.ssl_channel_credentials(root_certificates=open(cert, "rb").read())
    channel = grpc.secure_channel(f"127.0.0.1:{srv.port}", credentials)
    yield agent_pb2_grpc.AgentServiceStub(channel), srv, cert
    channel.close()
    srv.stop()
    redis.stop()


def status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        list(result) if hasattr(result, "__iter__") else result
    return err.value.code(), err.value.details()


def test_every_rpc_needs_a_valid_key(server):
    stub, *_ = server
    two = pb.Sampling(max_tokens=2)
    workflow = pb.WorkflowRequest(task="User: add.", branch_prompts=["Part 3."], synthesis_prompt="Synthesizer:",
                                  worker_sampling=two, synthesis_sampling=two)
    for metadata, message in [((), "this API needs a key"), ((("authorization", "Bearer wrong-key-0123456789"),),
                                                                   "not valid"),
                              ((("authorization", ALICE),), "must be 'Bearer <key>'")]:
        for call in (lambda: stub.Health(pb.HealthRequest(), metadata=metadata),
                     lambda: stub.ListSessions(pb.ListSessionsRequest(), metadata=metadata),
                     lambda: stub.RunWorkflow(workflow, metadata=metadata)):
            code, details = status(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED and message in details
    # both keys (named and unnamed) work, unary and streaming, and the server kept serving throughout
    assert stub.Health(pb.HealthRequest(), metadata=client_metadata(ALICE)).model_fingerprint
    events = list(stub.RunWorkflow(workflow, metadata=client_metadata(BOB), timeout=60))
    assert events[-1].HasField("done")


def test_braid_run_sends_its_key_over_tls(server, monkeypatch, tmp_path):
    """`braid run` sends no key unless it has one: --api-key, $BRAID_API_KEY, or the file `braid serve` leaves on
    this machine for the address's port."""
    _, srv, cert = server
    monkeypatch.setenv("HOME", str(tmp_path))  # (no key file of a real `braid serve` here)
    monkeypatch.delenv(ENV_CLIENT_KEY, raising=False)
    argv = ["run", "--address", f"127.0.0.1:{srv.port}", "--tls", "--ca-cert", cert, "--raw", "--task", "User: add.",
            "--branch", "Part 3.", "--prompt", "Synthesizer:", "--max-tokens", "2", "--transport", "text"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert braid_main(argv) == 1
    assert "UNAUTHENTICATED" in err.getvalue()
    for where in ("file", "env"):
        if where == "file":  # (as `braid serve` leaves it for its port)
            os.makedirs(os.path.dirname(local_key_path(srv.port)))
            with open(local_key_path(srv.port), "w") as f:
                f.write(f"# made by braid serve\nlocal:{ALICE}\n")
        else:
            os.unlink(local_key_path(srv.port))
            monkeypatch.setenv(ENV_CLIENT_KEY, ALICE)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert braid_main(argv) == 0, where
        assert "[done]" in out.getvalue()


def test_braid_serve_makes_a_key_for_this_machine_only(tmp_path, monkeypatch, capsys):
    """With no keys given, `braid serve` makes one (api.auth.make_local_key): in a file only its user can read,
    which is the cluster's key file too, and which clients send only to that port on this machine. Keys given and
    --open-api together, or a key file without a key, are refused before anything starts."""
    import stat

    import braid.cluster.local

    monkeypatch.setenv("HOME", str(tmp_path))
    for name in (ENV_CLIENT_KEY, "BRAID_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    key, path = make_local_key(9123)
    assert path == str(tmp_path / ".braid" / "api-key-9123") and len(key) >= 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(tmp_path / ".braid").st_mode) == 0o700
    assert ApiKeys.load(path, env={}).check(client_metadata(key)) == "local"  # (the cluster reads the same file)
    for address in ("127.0.0.1:9123", "localhost:9123", "[::1]:9123"):
        assert local_key(address) == key == client_key(None, address), address
    for address in ("10.0.0.7:9123", "braid.example.com:9123", "127.0.0.1:9124", "[::]:9123"):
        assert local_key(address) is None, address  # (another machine, or another port: never sent there)
    assert client_key(BOB, "127.0.0.1:9123") == BOB
    monkeypatch.setenv(ENV_CLIENT_KEY, BOB)
    assert client_key(None, "127.0.0.1:9123") == BOB
    again, _ = make_local_key(9123)  # (a new start: a new key, the old one gone)
    assert again != key and local_key("127.0.0.1:9123") == again and os.listdir(tmp_path / ".braid") == ["api-key-9123"]
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # (another braid serve)
    try:
        theirs = f"# the API key braid serve (pid {other.pid}) made for port 9123\nlocal:{BOB}\n"
        with open(path, "w") as f:
            f.write(theirs)
        with pytest.raises(ValueError, match=f"port 9123 is taken by another braid serve \\(pid {other.pid}\\)"):
            make_local_key(9123)
        assert open(path).read() == theirs and os.listdir(tmp_path / ".braid") == ["api-key-9123"]  # (as it was)
    finally:
        other.kill()
        other.wait()
    again, _ = make_local_key(9123)  # (its maker gone: replaced)
    assert local_key("127.0.0.1:9123") == again
    drop_local_key(9123, key)  # (not the key it holds: kept)
    assert local_key("127.0.0.1:9123") == again
    drop_local_key(9123, again)
    assert not os.path.exists(path)

    def no_start(*args, **kwargs):
        raise AssertionError("the cluster started")

    monkeypatch.setattr(braid.cluster.local, "start_local_cluster", no_start)
    empty = tmp_path / "empty"
    empty.write_text("# no key yet\n")
    monkeypatch.setenv("BRAID_API_KEYS", f"ci:{ALICE}")
    for argv, message in ((["--open-api"], "--open-api serves the agent API without keys, but keys are given "
                                           "($BRAID_API_KEYS)"),
                          (["--api-keys-file", str(empty)], "holds no key")):
        assert braid_main(["serve", *argv]) == 2
        assert message in capsys.readouterr().err
    assert os.listdir(tmp_path / ".braid") == []  # (no key made for a start refused)


def test_key_sources_and_bad_key_files(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        ApiKeys.load(str(empty), env={})
    short = tmp_path / "short"
    short.write_text("ops:tooshort\n")
    with pytest.raises(ValueError, match="entry 1: an API key must be at least 16 characters"):
        ApiKeys.load(str(short), env={})
    assert ApiKeys.load(None, env={}) is None  # nothing given: the API is open
    keys = ApiKeys.load(None, env={"BRAID_API_KEYS": f"ci:{ALICE},{BOB}"})
    assert keys.check(client_metadata(ALICE)) == "ci" and keys.check(client_metadata(BOB)) == "key-2"


def test_a_session_belongs_to_its_key_and_another_key_cannot_tell_it_exists(server):
    """Every session call with another key's session gets NOT_FOUND, worded exactly as for a session that never
    existed; the owner's session is untouched and keeps serving."""
    stub, *_ = server
    alice, bob = client_metadata(ALICE), client_metadata(BOB)
    made = stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text="User: a private note.")]), metadata=alice)
    sid, mid = made.session_id, made.message_ids[0]
    two = pb.Sampling(max_tokens=2, ignore_eos=True)
    workflow = lambda session: pb.WorkflowRequest(  # noqa: E731
        session_id=session, task="User: add.", branch_prompts=["Part 3."], synthesis_prompt="Synthesizer:",
        worker_sampling=two, synthesis_sampling=two)
    calls = {
        "Prefill": lambda s: stub.Prefill(pb.PrefillRequest(session_id=s, calls=[
            pb.PrefillCallSpec(text="more", parents=[mid])]), metadata=bob),
        "Decode": lambda s: stub.Decode(pb.DecodeRequest(session_id=s, calls=[
            pb.DecodeCallSpec(header="Answer:", parents=[mid], sampling=two)]), metadata=bob),
        "Generate": lambda s: stub.Generate(pb.GenerateRequest(session_id=s, prompt="hi", sampling=two), metadata=bob),
        "GetMessage": lambda s: stub.GetMessage(pb.GetMessageRequest(session_id=s, message_id=mid), metadata=bob),
        "CloseSession": lambda s: stub.CloseSession(pb.CloseSessionRequest(session_id=s), metadata=bob),
        "RunWorkflow": lambda s: stub.RunWorkflow(workflow(s), metadata=bob),
    }
    for name, call in calls.items():
        theirs, never = status(lambda: call(sid)), status(lambda: call("no-such-session-0123"))
        assert theirs[0] == grpc.StatusCode.NOT_FOUND, name
        assert theirs[1] == never[1].replace("no-such-session-0123", sid), name  # the same words either way
    def listed(metadata):
        return {s.session_id for s in stub.ListSessions(pb.ListSessionsRequest(), metadata=metadata).sessions}

    assert sid in listed(alice) and sid not in listed(bob)
    # alice's session is as it was, and still hers to use
    assert stub.GetMessage(pb.GetMessageRequest(session_id=sid, message_id=mid), metadata=alice).text
    assert list(stub.Decode(pb.DecodeRequest(session_id=sid, calls=[
        pb.DecodeCallSpec(header="Answer:", parents=[mid], sampling=two)]), metadata=alice))
    assert stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=alice).freed_messages >= 1


def test_per_key_limits_are_answered_with_resource_exhausted(checkpoint):
    """Each key at its limit of open sessions, of KV bytes in them, or of running workflows is refused with
    RESOURCE_EXHAUSTED and a message saying what to do; other keys are untouched, and it recovers as soon as
    it is back under the limit."""
    from braid.runtime.quotas import KeyLimits
    from braid.runtime.sessions import ServiceConfig

    redis = EmbeddedRedis()
    engine = Engine(EngineConfig(checkpoint("llama")))
    keys = ApiKeys.load(None, env={"BRAID_API_KEYS": f"alice:{ALICE},bob:{BOB}"})
    servers = []

    def serve(limits: KeyLimits):
        srv = start_in_process(engine, Directory.connect(redis.url), ServiceConfig(limits=limits), keys=keys)
        servers.append((srv, grpc.insecure_channel(f"127.0.0.1:{srv.port}")))
        return agent_pb2_grpc.AgentServiceStub(servers[-1][1])

    alice, bob = client_metadata(ALICE), client_metadata(BOB)
    prefill = lambda stub, md, session="": stub.Prefill(pb.PrefillRequest(  # noqa: E731
        session_id=session, calls=[pb.PrefillCallSpec(text="User: hello there.")]), metadata=md)

    def close_all(stub):  # (the counts live in the directory, which every server here shares)
        for md in (alice, bob):
            for s in stub.ListSessions(pb.ListSessionsRequest(), metadata=md).sessions:
                stub.CloseSession(pb.CloseSessionRequest(session_id=s.session_id), metadata=md)

    try:
        stub = serve(KeyLimits(sessions=2))
        first, _ = prefill(stub, alice), prefill(stub, alice)
        code, details = status(lambda: prefill(stub, alice))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "holds 2 open sessions" in details
        assert prefill(stub, alice, first.session_id).message_ids  # its open sessions still serve it
        assert prefill(stub, bob).session_id  # another key has its own count
        stub.CloseSession(pb.CloseSessionRequest(session_id=first.session_id), metadata=alice)
        assert prefill(stub, alice).session_id  # back under the limit
        close_all(stub)

        stub = serve(KeyLimits(store_bytes=1))
        made = prefill(stub, alice)
        code, details = status(lambda: prefill(stub, alice, made.session_id))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "bytes of KV" in details and "close sessions" in details
        assert prefill(stub, bob).session_id
        stub.CloseSession(pb.CloseSessionRequest(session_id=made.session_id), metadata=alice)
        assert prefill(stub, alice).session_id
        close_all(stub)

        stub = serve(KeyLimits(workflows=1))
        two = pb.Sampling(max_tokens=4, ignore_eos=True)
        workflow = pb.WorkflowRequest(task="User: add.", branch_prompts=["Part 3."], synthesis_prompt="Synthesizer:",
                                      worker_sampling=two, synthesis_sampling=two)
        running = stub.RunWorkflow(workflow, metadata=alice)
        assert next(running).HasField("decision")  # the first one is under way
        code, details = status(lambda: stub.RunWorkflow(workflow, metadata=alice))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "1 workflows running" in details
        assert list(stub.RunWorkflow(workflow, metadata=bob))[-1].HasField("done")
        assert list(running)[-1].HasField("done")
        assert list(stub.RunWorkflow(workflow, metadata=alice))[-1].HasField("done")  # it ended: room again
    finally:
        for srv, channel in servers:
            channel.close()
            srv.stop()
        redis.stop()
    with pytest.raises(ValueError, match="key limit sessions"):
        KeyLimits(sessions=-1)
