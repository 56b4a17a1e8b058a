"""Recorded workflows (runtime.traces): what a cluster serves, recorded off the request path without secrets, read
back with errors that name the file and line, and replayed by `braid loadtest --traces`."""

import json
import os
import time

import grpc
import pytest

from braid.api.auth import ApiKeys, client_metadata
from braid.cluster.inprocess import start_in_process
from braid.engine import Engine, EngineConfig
from braid.loadtest.run import main as loadtest_main
from braid.models.traces import TraceError, read_traces
from braid.protos import agent_pb2 as pb
from braid.protos import agent_pb2_grpc
from braid.runtime.directory import Directory, EmbeddedRedis
from braid.runtime.traces import TraceRecorder, trace_request

KEY = "tracing-key-0123456789abcdef"
GREEDY = pb.Sampling(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def recording(checkpoint, tmp_path_factory):
    """An in-process server (with an API key) recording what it serves."""
    folder = tmp_path_factory.mktemp("traces")
    redis = EmbeddedRedis()
    server = start_in_process(Engine(EngineConfig(checkpoint("llama"))), Directory.connect(redis.url),
                              keys=ApiKeys.parse([f"tracer:{KEY}"], "test"), record_dir=str(folder))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield agent_pb2_grpc.AgentServiceStub(channel), server, folder
    channel.close()
    server.stop()
    redis.stop()


def lines(folder):
    path = folder / "traces-in-process.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def wait_for(folder, n, timeout=10):
    deadline = time.monotonic() + timeout
    while len(lines(folder)) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return lines(folder)


def test_a_served_workflow_is_recorded_as_its_client_saw_it_without_secrets(recording):
    stub, server, folder = recording
    before = len(lines(folder))
    events = list(stub.RunWorkflow(pb.WorkflowRequest(
        task="add:", branch_prompts=["1 2", "3 4"], synthesis_prompt="sum:", worker_sampling=GREEDY,
        synthesis_sampling=GREEDY, transport=pb.TRANSPORT_LOCAL), metadata=client_metadata(KEY)))
    (line,) = wait_for(folder, before + 1)[before:]
    replies = ["", ""]
    for e in events:
        if e.HasField("branch_token"):
            replies[e.branch_token.branch] += e.branch_token.text
    assert [b["reply"] for b in line["branches"]] == replies and all(replies)
    assert [b["prompt"] for b in line["branches"]] == ["1 2", "3 4"] and line["task"] == "add:"
    assert line["answer"] == events[-1].done.answer_text and line["synthesis"]["prompt"] == "sum:"
    assert line["model"] == server.sessions.engine.fingerprint and line["transport"] == "TRANSPORT_LOCAL"
    assert line["text_branches"] == []  # (every branch read from its KV)
    assert line["worker_header"] == "<|worker|>"  # (what opened the replies: a reader lays them out with it)
    text = json.dumps(line)
    assert KEY not in text and events[-1].done.session_id not in text  # (no key, no session)
    # a failed workflow is not recorded
    with pytest.raises(grpc.RpcError):
        list(stub.RunWorkflow(pb.WorkflowRequest(branch_prompts=[""], synthesis_prompt="s"),
                              metadata=client_metadata(KEY)))
    time.sleep(0.2)
    assert len(lines(folder)) == before + 1


def test_recording_never_blocks_or_fails_a_request(tmp_path):
    """A disk that refuses the write, or a full queue, drops lines and counts them; nothing raises."""
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    refused = TraceRecorder(str(blocked / "sub"), "x")
    refused.record({"kind": "workflow"})
    refused.close()
    assert refused.dropped == 1 and refused.written == 0
    dropped = []
    full = TraceRecorder(str(tmp_path / "ok"), "y", max_queued=1, on_drop=dropped.append)
    start = time.perf_counter()
    for i in range(2000):
        full.record({"kind": "workflow", "i": i})
    assert time.perf_counter() - start < 2  # (never waits for the disk)
    full.close()
    assert full.dropped == sum(dropped) > 0 and full.written + full.dropped == 2000


@pytest.mark.parametrize("content, needle", [
    ('{"branches": [{"prompt": "a"}], "synthesis": {"prompt": "s"}}\n{not json', "line 2: not JSON"),
    ('{"branches": [], "synthesis": {"prompt": "s"}}', "line 1: \"branches\" must be a non-empty list"),
    ('{"task_messages": [{"role": "system", "content": "t"}], "branches": [{"messages": [{"role": "robot", '
     '"content": "x"}]}]}', "line 1: branches[0].messages[0]"),
    ('{"branches": [{"messages": [{"role": "user", "content": "x"}]}]}', "line 1: task_messages: expected"),
    ('{"version": 7, "branches": [{"prompt": "a"}], "synthesis": {"prompt": "s"}}', "trace version 7"),
])
def test_a_bad_trace_line_is_refused_naming_the_file_and_line(tmp_path, content, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(TraceError) as e:
        list(read_traces(str(path)))
    assert str(path) in str(e.value) and needle in str(e.value), str(e.value)


def test_traces_a_user_writes_are_read_as_requests(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"task": "t", "branches": [{"prompt": "a"}, {"prompt": "b"}],
                                "synthesis": {"prompt": "s"}}) + "\n\n" +
                    json.dumps({"task_messages": [{"role": "system", "content": "be brief"}],
                                "branches": [{"messages": [{"role": "user", "content": "q"}]}],
                                "synthesis": {"messages": [{"role": "user", "content": "so?"}]}}) + "\n")
    (n1, strings), (n2, chat) = read_traces(str(path))
    assert (n1, n2) == (1, 3)
    assert list(trace_request(strings).branch_prompts) == ["a", "b"] and trace_request(strings).synthesis_prompt == "s"
    request = trace_request(chat)
    assert request.task_messages[0].content == "be brief" and request.branch_messages[0].messages[0].role == "user"


def test_loadtest_replays_recorded_workflows(recording, capsys):
    stub, server, folder = recording
    if not lines(folder):
        list(stub.RunWorkflow(pb.WorkflowRequest(task="t", branch_prompts=["a"], synthesis_prompt="s",
                                                 worker_sampling=GREEDY, synthesis_sampling=GREEDY),
                              metadata=client_metadata(KEY)))
        wait_for(folder, 1)
    traces = str(folder / "traces-in-process.jsonl")
    argv = ["--address", f"127.0.0.1:{server.port}", "--api-key", KEY, "--num-prompts", "3", "--traces", traces,
            "--worker-max-tokens", "3", "--answer-max-tokens", "3"]
    assert loadtest_main(argv + ["--recorded-rate"]) == 0
    assert "completed 3, failed 0" in capsys.readouterr().out
    assert loadtest_main(["--recorded-rate"]) == 2 and "give --traces FILE" in capsys.readouterr().out


def test_replay_gaps_are_the_recorded_ones_and_none_for_traces_without_a_time(tmp_path):
    from braid.loadtest.workload import trace_requests

    line = {"task": "t", "branches": [{"prompt": "a"}], "synthesis": {"prompt": "s"}}
    timed = tmp_path / "timed.jsonl"
    timed.write_text("".join(json.dumps({**line, "time": t}) + "\n" for t in (100.0, 100.5, 102.0)))
    requests, gaps = trace_requests([str(timed)], 5, 3, 3)
    assert len(requests) == 5 and gaps == [0.5, 1.5, 0.0, 0.5]  # (a new pass starts at once)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({**line, "time": 1.7e9}) + "\n" + json.dumps(line) + "\n")
    assert trace_requests([str(mixed)], 2, 3, 3)[1] == [0.0]


def _workflows(kinds: int, per_kind: int):
    from braid.models.traces import TraceWorkflow

    return [TraceWorkflow(f"traces.jsonl, line {k * per_kind + i + 1}", f"system of kind {k}",
                          tuple(f"part {j} of {i}" for j in range(2 + k % 3)), "the answer?", "<|worker|>", None)
            for k in range(kinds) for i in range(per_kind)]


def test_the_held_out_split_is_stratified_hashed_and_order_free():
    """models.traces.split: one in N of each kind (branch count and task) held out, in the order of a hash of each
    workflow's content: disjoint and complete, the same for any line order and in any process, unmoved by what is
    not the request (where it was read, its replies, its reference), and a workflow recorded twice on one side."""
    import dataclasses
    import random
    import subprocess
    import sys

    from braid.models.traces import split, workflow_digest, workflow_kind

    workflows = _workflows(6, 31)
    trained, held = split(workflows, 3)
    assert sorted(w.where for w in trained + held) == sorted(w.where for w in workflows)  # complete
    assert not {w.where for w in trained} & {w.where for w in held}  # disjoint
    assert [w.where for w in held] == [w.where for w in workflows if w in held]  # in the order given
    for kind in {workflow_kind(w) for w in workflows}:  # each kind holds out floor or ceil of its 31 / 3
        assert sum(workflow_kind(w) == kind for w in held) in (10, 11)
    assert len(held) == 62  # (ceil(186 / 3) in all)
    shuffled = workflows[:]
    random.Random(1).shuffle(shuffled)
    assert {w.where for w in split(shuffled, 3)[1]} == {w.where for w in held}
    # what is not the request does not move it: a reference added to the held-out lines, replies, the file name
    relabelled = [dataclasses.replace(w, where="other.jsonl", reference="42", replies=("a",) * w.branches)
                  for w in workflows]
    assert [workflow_digest(w) for w in split(relabelled, 3)[1]] == [workflow_digest(w) for w in held]
    # the same in another process (no per-process hash seed)
    code = ("from braid.models.traces import TraceWorkflow, split; ws = [TraceWorkflow('x', f't{k}', "
            "tuple(f'p{j} {i}' for j in range(2 + k % 3)), 's', 'h', None) for k in range(6) for i in range(31)]; "
            "print(sorted(w.prompts[0] + w.task for w in split(ws, 3)[1]))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    assert len(runs) == 1 and runs.pop().count("'") > 100
    # a workflow recorded twice is held out or trained on whole
    twice = workflows + [dataclasses.replace(w, where="again") for w in workflows[:40]]
    trained2, held2 = split(twice, 3)
    assert not {workflow_digest(w) for w in trained2} & {workflow_digest(w) for w in held2}
    # kinds of one workflow each: one in N of them held out all the same; 0 holds none out
    assert len(split(_workflows(300, 1), 3)[1]) == 100 and len(split(_workflows(2, 1), 3)[1]) == 1
    assert split(workflows, 0) == (workflows, []) and split(workflows, 1)[0] == []
    with pytest.raises(ValueError, match="held-out"):
        split(workflows, -1)


def test_calibrate_and_eval_hold_out_the_same_traces(tmp_path):
    """`braid calibrate --traces` and `braid eval --traces --held-out-traces` read the file with one function and
    the same N: the same held-out set whichever lines carry references, in whatever order the file lists them."""
    from braid.models.chat import WORKER_HEADER
    from braid.models.traces import load_trace_workflows, split

    rng = __import__("random").Random(0)
    lines = [{"task": f"kind {k}", "branches": [{"prompt": f"part {j} of {i}"} for j in range(2 + k)],
              "synthesis": {"prompt": "the sum?"}} for k in range(3) for i in range(20)]
    plain, labelled, shuffled = tmp_path / "plain.jsonl", tmp_path / "labelled.jsonl", tmp_path / "shuffled.jsonl"
    plain.write_text("".join(json.dumps(x) + "\n" for x in lines))
    held = {w.task + "|" + w.prompts[0] for w in split(load_trace_workflows([str(plain)], None, "m", WORKER_HEADER),
                                                        4)[1]}
    labelled.write_text("".join(json.dumps({**x, "reference": "7"}) + "\n" for x in lines))
    rng.shuffle(lines)
    shuffled.write_text("".join(json.dumps(x) + "\n" for x in lines))
    for path in (labelled, shuffled):
        again = split(load_trace_workflows([str(path)], None, "m", WORKER_HEADER), 4)[1]
        assert {w.task + "|" + w.prompts[0] for w in again} == held
    assert len(held) == 15  # (one in four of each kind of 20: 5 each)


def test_the_trace_quality_run_goes_end_to_end(tmp_path):
    """benchmarks/trace_quality.py, cut to six workflows and two calibration steps: it serves them with recording on,
    gives references to the held-out lines only, calibrates from the traces alone with the real `braid` command,
    verifies, and writes the stamped summary its docs section is generated from."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "trace_quality.py"), "--work",
                           str(tmp_path / "work"), "--workflows", "6", "--held-out", "3", "--steps", "2",
                           "--tasks-per-step", "2", "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    from braid.methods.calibration import Calibration

    lines = [json.loads(x) for x in (tmp_path / "work" / "traces.jsonl").read_text().splitlines()]
    held = sum(line["reference"] is not None for line in lines)
    assert len(lines) == 6 and held >= 1
    result = json.loads((tmp_path / "out" / "eval_trace_quality_cpu.json").read_text())
    # the lines given references are the ones calibration held out and verification ran (models.traces.split)
    assert result["stamp"]["model"] and result["summary"]["all"]["n"] == held
    assert set(result["summary"]["all"]) >= {"calibrated+refresh", "cache:mixed", "cache:mixed+refresh"}
    assert result["calibration_record"]["traces"]["held_out"] == held
    verification = result["verification"]
    assert verification["traces"] and verification["samples"] >= 1 and verification["needed_per_band"] == 149
    assert verification["bands"][0]["verifiable"] is False and verification["max_branches"] == 0  # (too few)
    # recorded beside the calibration, by name; its own record (none) untouched
    calibration = Calibration.load(str(tmp_path / "work" / "calibration"), result["verification_name"])
    assert calibration.verification == verification
    assert Calibration.load(str(tmp_path / "work" / "calibration")).verification is None
