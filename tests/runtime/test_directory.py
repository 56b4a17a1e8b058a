"""The Redis control plane, against a real redis-server."""

import pytest

from braid.engine.errors import UnknownMessageError
from braid.runtime.directory import Directory, EmbeddedRedis, MessageRecord


@pytest.fixture(scope="module")
def redis_url():
    server = EmbeddedRedis()
    yield server.url
    server.stop()


@pytest.fixture
def directory(redis_url):
    d = Directory.connect(redis_url)
    d.r.flushdb()
    return d


def rec(sid, mid, nbytes=100):
    return MessageRecord(mid, sid, "worker-0", "fp", 7, nbytes)


def test_sessions_and_messages(directory):
    a, b = directory.create_session(), directory.create_session()
    assert a != b and len(a) >= 20  # unguessable
    directory.register(rec(a, "m1"))
    directory.register(rec(a, "m2", 50))
    assert directory.lookup(a, "m1") == rec(a, "m1")
    info = directory.session(a)
    assert (info.messages, info.kv_bytes) == (2, 150)
    assert [s.session_id for s in directory.list_sessions()] == [a, b]


def test_ids_are_scoped_to_their_session(directory):
    a, b = directory.create_session(), directory.create_session()
    directory.register(rec(a, "secret"))
    with pytest.raises(UnknownMessageError, match="not in session"):
        directory.lookup(b, "secret")


def test_close_session_returns_messages_and_forgets_them(directory):
    a, b = directory.create_session(), directory.create_session()
    directory.register(rec(a, "m1"))
    directory.register(rec(b, "keep"))
    closed = directory.close_session(a)
    assert [r.message_id for r in closed] == ["m1"]
    with pytest.raises(UnknownMessageError, match="unknown session"):
        directory.session(a)
    with pytest.raises(UnknownMessageError):
        directory.lookup(a, "m1")
    assert directory.lookup(b, "keep").message_id == "keep"


def test_keys_expire_with_the_session_ttl(redis_url):
    d = Directory.connect(redis_url, session_ttl_s=60)
    sid = d.create_session()
    d.register(rec(sid, "m"))
    for key in (f"braid:session:{sid}", f"braid:session:{sid}:messages", f"braid:msg:{sid}:m"):
        assert 0 < d.r.ttl(key) <= 60


def test_a_message_of_a_closed_session_is_refused_and_does_not_bring_it_back(directory):
    """Found by the fuzz script: a call finishing after its session was closed used to re-create the session
    hash half-made (no owner, no creation time), and every later call on it failed with INTERNAL."""
    a = directory.create_session()
    directory.close_session(a)
    with pytest.raises(UnknownMessageError, match="closed or expired while the call ran"):
        directory.register(rec(a, "late"))
    assert not directory.r.exists(f"braid:session:{a}") and not directory.r.exists(f"braid:msg:{a}:late")
    with pytest.raises(UnknownMessageError, match="unknown session"):
        directory.session(a)


def test_a_failed_first_call_closes_the_session_it_opened(directory):
    with pytest.raises(RuntimeError):
        with directory.session_for_call("", "key") as sid:
            raise RuntimeError("the call failed")
    with pytest.raises(UnknownMessageError):
        directory.session(sid)
    kept = directory.create_session("key")
    with pytest.raises(RuntimeError):
        with directory.session_for_call(kept, "key"):
            raise RuntimeError("a later call failed")
    assert directory.session(kept, "key").session_id == kept  # a session named by the call stays


def test_a_running_count_lost_with_redis_is_not_driven_below_zero(directory):
    with directory.running("key", limit=2):
        directory.r.delete("braid:owner:key:running")  # (as a Redis restart without persistence would)
    assert directory.r.get("braid:owner:key:running") is None  # not -1: the limit still holds


def test_a_retried_registration_counts_once(directory):
    a = directory.create_session()
    directory.register(rec(a, "m", 100))
    directory.register(rec(a, "m", 100))  # (a retry after a lost reply)
    assert (directory.session(a).messages, directory.session(a).kv_bytes) == (1, 100)
