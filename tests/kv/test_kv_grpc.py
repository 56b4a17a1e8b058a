"""Shipping decoding branches' KV over a real gRPC stream, with payloads inline or on a gloo link."""

import threading
import time
import zlib

import pytest

from braid.engine import DecodeCall, PrefillCall, SamplingParams
from braid.kv.chunks import tensor_bytes
from braid.kv.collective import CollectiveSender, open_link
from braid.kv.connector import BranchChunk, TransferError, Transport, chain_digest
from braid.kv.grpc_transport import GrpcSender, abandon
from braid.kv.receiver import KVReceiver
from braid.models.chat import WORKER_HEADER


def ship_two_branches(eng, receiver, sender):
    """Decode two branches in parallel, shipping every 4 encoded tokens; returns their messages."""
    p, = eng.prefill([PrefillCall("User: add these.")])
    stream = eng.decode_stream([DecodeCall(WORKER_HEADER, parents=[p], sampling=SamplingParams(
        max_tokens=n, ignore_eos=True)) for n in (20, 13)], readable=True)
    offset = eng.message(p).end
    shipped = [0, 0]
    sender.open(["wf:0", "wf:1"])
    for event in stream:
        c = event.call
        # (it grows while we look: the scheduler runs ahead of this loop); the last encoded token waits for
        # the closing chunk, which then always has one
        end = stream.encoded(c) - 1
        if end - shipped[c] >= 4:
            toks, kv = stream.partial_kv(c, shipped[c], end)
            sender.send(BranchChunk(f"wf:{c}", f"b{c}", offset, shipped[c], toks, kv))
            shipped[c] = end
    messages = [eng.message(m) for m in stream.ids]
    for c, msg in enumerate(messages):
        toks, kv = stream.partial_kv(c, shipped[c], msg.num_tokens)
        sender.send(BranchChunk(f"wf:{c}", f"b{c}", offset, shipped[c], toks, kv, total_tokens=msg.num_tokens))
    return messages, sender.finish()


@pytest.mark.parametrize("collective", [False, True], ids=["grpc", "gloo"])
def test_branch_kv_arrives_bit_identical_while_decoding(llama_engine, collective):
    eng = llama_engine
    receiver = KVReceiver(eng.fingerprint)
    try:
        if collective:
            sender = CollectiveSender(receiver.address, eng.fingerprint, open_link(receiver.address, "worker-1", "gloo"),
                                      "worker-1", max_chunk_bytes=700)
        else:
            sender = GrpcSender(receiver.address, eng.fingerprint, max_chunk_bytes=700)
        messages, sent = ship_two_branches(eng, receiver, sender)
        assert sum(s.bytes for s in sent.values()) == sum(m.nbytes for m in messages)
        assert sum(s.chunks for s in sent.values()) > 6
        for c, msg in enumerate(messages):
            got = receiver.wait(f"wf:{c}", idle_timeout=10)
            assert got.bytes == msg.nbytes and 0 < got.tail_bytes < got.bytes and got.tail_seconds >= 0
            assert got.token_ids == list(msg.token_ids) and got.offset == msg.offset
            assert got.transport is (Transport.COLLECTIVE if collective else Transport.GRPC)
            assert got.digest == sent[f"wf:{c}"].digest != 0  # the chunks the worker sent are the ones checked here
            assert zlib.crc32(tensor_bytes(got.kv)) == zlib.crc32(tensor_bytes(msg.kv.read()))
    finally:
        receiver.stop()


def test_incomplete_or_foreign_streams_fail_cleanly(llama_engine):
    eng = llama_engine
    receiver = KVReceiver(eng.fingerprint)
    try:
        kv = eng.message(eng.prefill([PrefillCall("one two three")])[0]).kv.read()
        half = GrpcSender(receiver.address, eng.fingerprint)
        half.send(BranchChunk("s1", "m", 0, 0, [1, 2], kv[:, :, :, :2]))  # total never announced
        with pytest.raises(TransferError, match="DATA_LOSS.*incomplete"):
            half.finish()
        foreign = GrpcSender(receiver.address, "another-model")
        foreign.send(BranchChunk("s2", "m", 0, 0, [1], kv[:, :, :, :1], total_tokens=1))
        with pytest.raises(TransferError, match="FAILED_PRECONDITION"):
            foreign.finish()
        unknown_link = GrpcSender(receiver.address, eng.fingerprint)
        unknown_link.link_id = "never-opened"
        unknown_link.send(BranchChunk("s3", "m", 0, 0, [1], kv[:, :, :, :1], total_tokens=1))
        with pytest.raises(TransferError, match="never opened"):
            unknown_link.finish()
        with pytest.raises(TransferError, match="no worker started"):
            receiver.wait("never", idle_timeout=0.1, queue_timeout=0.1)
        assert "never" not in receiver._streams  # a timed-out stream is not kept
        # a call that fails on a collective link: the link goes on both sides (its sender drops it)
        linked = CollectiveSender(receiver.address, eng.fingerprint, open_link(receiver.address, "l1", "gloo"), "l1")
        linked.send(BranchChunk("s4", "m", 0, 0, [1, 2], kv[:, :, :, :2]))  # total never announced
        with pytest.raises(TransferError, match="DATA_LOSS.*incomplete"):
            linked.finish()
        assert "l1" not in receiver._links
    finally:
        receiver.stop()


@pytest.mark.parametrize("transport,tamper", [("grpc", "chunk"), ("grpc", "closing digest"), ("gloo", "closing digest"),
                                              ("grpc", "older sender")])
def test_a_stream_unlike_what_its_sender_sent_fails_at_the_receiver(llama_engine, transport, tamper):
    """The receiver checks a copied stream against the digest and byte count its sender put on the stream's last
    chunk. A chunk changed in flight together with its CRC-32 (so that only the stream's digest can notice), or a
    closing digest unlike what arrived, fails the stream with both digests named: the sender's call fails, `wait`
    raises, and nothing reaches the engine. A sender that puts no closing digest (older than the check) is let in."""
    eng = llama_engine
    p, = eng.prefill([PrefillCall("User: add these.")])
    msg = eng.message(p)
    receiver = KVReceiver(eng.fingerprint)
    try:
        if transport == "gloo":
            sender = CollectiveSender(receiver.address, eng.fingerprint, open_link(receiver.address, "t1", "gloo"),
                                      "t1", max_chunk_bytes=700)
        else:
            sender = GrpcSender(receiver.address, eng.fingerprint, max_chunk_bytes=700)
        put, seen = sender._queue.put, []

        def in_flight(chunk):  # between the sender's own accounting and the wire
            if chunk is not None and not chunk.open:
                seen.append(chunk)
                if tamper == "chunk" and len(seen) == 2:
                    data = bytearray(chunk.data)
                    data[0] ^= 1
                    chunk.data, chunk.crc32 = bytes(data), zlib.crc32(data)
                elif tamper == "closing digest" and chunk.HasField("stream_digest"):
                    chunk.stream_digest ^= 1
                elif tamper == "older sender":
                    chunk.ClearField("stream_digest")
                    chunk.ClearField("stream_bytes")
            put(chunk)

        sender._queue.put = in_flight
        stored = set(eng.store.ids())
        sender.open(["wf:0"])
        sender.send(BranchChunk("wf:0", p, msg.offset, 0, list(msg.token_ids[:3]), msg.kv.read(0, 3).clone()))
        sender.send(BranchChunk("wf:0", p, msg.offset, 3, list(msg.token_ids[3:]), msg.kv.read(3).clone(),
                                total_tokens=msg.num_tokens))
        if tamper == "older sender":
            sent = sender.finish()["wf:0"]
            got = receiver.wait("wf:0", idle_timeout=5)
            assert got.digest == sent.digest and got.bytes == sent.bytes == msg.nbytes
            assert not any(c.HasField("stream_digest") for c in seen)
            mid = receiver.import_message(eng, got)
            assert zlib.crc32(tensor_bytes(eng.message(mid).kv.read())) == zlib.crc32(tensor_bytes(msg.kv.read()))
            # (its record lacks the worker's context: a session that loses it cannot encode it again, and says so)
            assert "worker's context" in eng.message(mid).unrecorded
            eng.free(mid)
            return
        with pytest.raises(TransferError, match="arrived corrupted"):
            sender.finish()
        sent = sender.sent["wf:0"]
        assert len(seen) >= 3 and [c.HasField("stream_digest") for c in seen] == [False] * (len(seen) - 1) + [True]
        arrived, closing = 0, seen[-1].stream_digest  # over the chunks as they went on the wire; as it came
        for c in seen:
            arrived = chain_digest(arrived, c.crc32)
        if tamper == "chunk":  # an honest closing digest, and a chunk that passes its own CRC-32 check
            assert closing == sent.digest != arrived
        else:  # the chunks as sent, a closing digest that is not theirs
            assert arrived == sent.digest != closing
        with pytest.raises(TransferError, match="arrived corrupted") as failed:
            got = receiver.wait("wf:0", idle_timeout=5)
            receiver.import_message(eng, got)  # (never reached)
        assert f"digest {arrived:#010x} over {sent.bytes} bytes" in str(failed.value)
        assert f"its sender sent digest {closing:#010x} over {sent.bytes} bytes" in str(failed.value)
        assert set(eng.store.ids()) == stored and receiver._streams == {}  # nothing was imported, nothing kept
    finally:
        receiver.stop()


def test_wait_clock_starts_when_the_worker_starts_and_abandon_ends_it(llama_engine):
    """Queued time is not counted against the idle limit; an opened stream that goes quiet fails; Abandon
    (from whoever gave the workflow up) wakes the waiter at once."""
    eng = llama_engine
    receiver = KVReceiver(eng.fingerprint)
    try:
        kv = eng.message(eng.prefill([PrefillCall("one two three")])[0]).kv.read()
        sender = GrpcSender(receiver.address, eng.fingerprint)

        def late_worker():
            time.sleep(0.6)  # queued for longer than the idle limit
            sender.open(["q"])
            sender.send(BranchChunk("q", "m", 0, 0, [1], kv[:, :, :, :1], total_tokens=1))
            sender.finish()

        threading.Thread(target=late_worker).start()
        assert receiver.wait("q", idle_timeout=0.3).token_ids == [1]

        quiet = GrpcSender(receiver.address, eng.fingerprint)
        quiet.open(["idle"])
        with pytest.raises(TransferError, match="stopped arriving"):
            receiver.wait("idle", idle_timeout=0.3)
        quiet.abort("test over")

        threading.Timer(0.2, abandon, args=(receiver.address, ["gone"], "a worker failed")).start()
        start = time.monotonic()
        with pytest.raises(TransferError, match="abandoned: a worker failed"):
            receiver.wait("gone", idle_timeout=30)
        assert time.monotonic() - start < 5
    finally:
        receiver.stop()


def test_a_staircase_reads_a_stream_while_it_arrives_with_its_two_clocks(llama_engine):
    """A branch read while it arrives (KVReceiver.watch): its tokens received whole from the start are readable,
    bit for bit; the feed's queued clock runs until any branch has sent a chunk, the idle clock after."""
    import torch

    from braid.engine.errors import UnavailableError
    from braid.methods.staircase import BranchFeed

    eng = llama_engine
    p, = eng.prefill([PrefillCall("User: add these.")])
    branch, = eng.decode([DecodeCall(WORKER_HEADER, parents=[p], sampling=SamplingParams(max_tokens=9,
                                                                                          ignore_eos=True))])
    msg = eng.message(branch)
    receiver = KVReceiver(eng.fingerprint)
    try:
        arrivals = receiver.watch("wf:0")
        start = time.monotonic()  # (before the feed: its queued clock starts when it is made)
        feed = BranchFeed([], pump=False, branches=[(arrivals, 0)])
        arrivals.listen(lambda: feed.arrived(arrivals))
        with pytest.raises(UnavailableError, match="no branch started for 0.4 s"):
            feed.wait(lambda: False, idle_s=0.05, queued_s=0.4)  # (the idle clock does not run yet)
        assert time.monotonic() - start >= 0.4
        sender = GrpcSender(receiver.address, eng.fingerprint)
        sender.open(["wf:0"])
        sender.send(BranchChunk("wf:0", branch, msg.offset, 0, list(msg.token_ids[:6]), msg.kv.read(0, 6).clone()))
        feed.wait(lambda: arrivals.encoded() >= 6, idle_s=5)
        tokens, kv = arrivals.partial_kv(0, 2, 6)
        assert tokens == list(msg.token_ids[2:6]) and torch.equal(kv, msg.kv.read(2, 6))
        assert feed.ended == [False]
        with pytest.raises(UnavailableError, match="no branch made progress for 0.1 s"):
            feed.wait(lambda: False, idle_s=0.1, queued_s=30)
        sender.send(BranchChunk("wf:0", branch, msg.offset, 6, list(msg.token_ids[6:]), msg.kv.read(6).clone(),
                                total_tokens=msg.num_tokens))
        sender.finish()
        feed.wait(lambda: feed.settled(0), idle_s=5)
        assert feed.length == [msg.num_tokens]
        got = receiver.wait("wf:0", idle_timeout=5)
        assert torch.equal(got.kv, msg.kv.read()) and receiver._streams == {}
    finally:
        receiver.stop()


def test_a_given_up_stream_is_not_started_over_by_late_chunks(llama_engine):
    eng = llama_engine
    p, = eng.prefill([PrefillCall("User: add these.")])
    msg = eng.message(p)
    receiver = KVReceiver(eng.fingerprint)
    try:
        receiver.watch("wf:late")  # (a reader is there, then gives up)
        receiver.forget(["wf:late"])
        abandon(receiver.address, ["wf:gone"], "the client left")
        for sid in ("wf:late", "wf:gone"):
            sender = GrpcSender(receiver.address, eng.fingerprint)
            sender.open([sid])
            sender.send(BranchChunk(sid, p, msg.offset, 0, list(msg.token_ids), msg.kv.read().clone(),
                                    total_tokens=msg.num_tokens))
            with pytest.raises(TransferError):
                sender.finish()
            with pytest.raises(TransferError, match="gave up|abandoned"):
                receiver.wait(sid, idle_timeout=5)
        assert receiver._streams == {}
        with pytest.raises(TransferError, match="no worker started"):
            receiver.wait("wf:never", idle_timeout=5, queue_timeout=0.1)
        assert receiver._streams == {} and "wf:never" in receiver._gone
    finally:
        receiver.stop()


def test_concurrent_worker_calls_each_take_their_own_collective_link(checkpoint):
    """A worker's calls to one synthesizer run at once (the scheduler batches them); over the collective
    transport each takes a link no other call is using (payloads on a link are matched to receives in order),
    opened the first time and reused after; past IDLE_LINKS idle ones, a link is closed on both sides. Every
    branch arrives bit-identical to what the worker stored."""
    from braid.engine import Engine, EngineConfig
    from braid.runtime.messages import BranchDone, BranchRequest
    from braid.workers.runner import BranchRunner, WorkerConfig

    eng = Engine(EngineConfig(checkpoint("llama")))
    receiver = KVReceiver(eng.fingerprint)
    runner = BranchRunner(eng, WorkerConfig(kv_schedule=(2, 3)), "w")
    runner.IDLE_LINKS = 2
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)

    def call(wf: str) -> list[BranchDone]:
        req = BranchRequest(wf, "User: a task.", [0, 1], ["First part.", "Second, longer part."], greedy,
                            Transport.COLLECTIVE, receiver.address)
        return [ev for ev in runner.run(req) if isinstance(ev, BranchDone)]

    try:
        for round_ in range(2):
            results = {}
            threads = [threading.Thread(target=lambda w=w: results.__setitem__(w, call(w)))
                       for w in (f"a{round_}", f"b{round_}", f"c{round_}")]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert sorted(results) == sorted(f"{x}{round_}" for x in "abc")
            for wf, done in results.items():
                assert len(done) == 2
                for d in done:
                    got = receiver.wait(f"{wf}:{d.branch}", idle_timeout=10)
                    assert got.transport is Transport.COLLECTIVE and got.token_ids == d.token_ids
                    assert got.digest == d.digest != 0
            idle = runner.links[receiver.address]
            assert len(idle) == len({link_id for link_id, _ in idle}) <= 2  # one per call at once, none shared
            assert set(receiver._links) == {link_id for link_id, _ in idle}  # the rest closed there too
        assert runner._links_opened <= 4  # (at most 3 at once, then at most one more: the idle ones were reused)
    finally:
        receiver.stop()
