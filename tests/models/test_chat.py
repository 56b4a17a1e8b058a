"""Chat messages rendered with a model's own chat template, one message at a time (braid.models.chat), and
served: RunWorkflow and Generate take chat messages on a model that has a template."""

import grpc
import pytest
from transformers import AutoTokenizer

from braid.cluster.inprocess import start_in_process
from braid.engine import Engine, EngineConfig, SamplingParams
from braid.models import REFERENCE_MODEL
from braid.models.chat import END, ROLES, ChatRenderer, TemplateError, header, turn
from braid.models.checkpoints import make_random_checkpoint
from braid.protos import agent_pb2 as pb
from braid.protos import agent_pb2_grpc
from braid.runtime.directory import Directory, EmbeddedRedis

# Written for these tests after Qwen's template (no model hub here): turns as <|im_start|>role ... <|im_end|>
QWEN_STYLE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Templates the renderer must refuse: roles that must alternate (as Mistral's), the system turn moved last, a date
ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
               "{% if add_generation_prompt %}[assistant]{% endif %}")
SYSTEM_LAST = ("{% for m in messages if m['role'] != 'system' %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
               "{% for m in messages if m['role'] == 'system' %}<sys>{{ m['content'] }}{% endfor %}"
               "{% if add_generation_prompt %}<assistant>{% endif %}")
DATED = "{{ strftime_now('%d %b %Y') }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def tokenizer_with(checkpoint, template: str | None):
    tok = AutoTokenizer.from_pretrained(checkpoint("llama"))
    tok.chat_template = template
    return tok


def msg(role, content):
    return {"role": role, "content": content}


def test_the_reference_template_renders_braids_own_turns():
    """One path for every model: on the reference model the renderer gives exactly the strings its tasks,
    trainer and calibration were built with (models.chat.turn and header)."""
    r = ChatRenderer(AutoTokenizer.from_pretrained(REFERENCE_MODEL))
    assert r.roles == {role: role for role in ROLES}
    before = []
    for role in ROLES:
        assert r.render([msg(role, " some text")], before) == turn(role, " some text")
        assert r.header(role, before) == header(role)
        before.append(msg(role, " x"))


def test_a_qwen_style_template_renders_each_message_after_what_it_follows(checkpoint):
    r = ChatRenderer(tokenizer_with(checkpoint, QWEN_STYLE), "qwen-style")
    assert r.roles["worker"] == r.roles["synthesizer"] == "assistant"
    task = [msg("system", "solve it")]
    assert r.render(task) == "<|im_start|>system\nsolve it<|im_end|>\n"
    assert r.render([msg("user", "part 1")], task) == "<|im_start|>user\npart 1<|im_end|>\n"
    assert r.header("worker", [*task, msg("user", "part 1")]) == "<|im_start|>assistant\n"
    q = msg("user", "q")
    whole = r.render(task) + r.render([q], task) + r.render([msg("worker", "a")], [*task, q])
    assert whole == r.tokenizer.apply_chat_template([*task, q, msg("assistant", "a")], tokenize=False)
    # a role map of the model's own (here: workers as users)
    mapped = ChatRenderer(r.tokenizer, "qwen-style", roles={**r.roles, "worker": "user"})
    assert mapped.render([msg("worker", "a")], task) == "<|im_start|>user\na<|im_end|>\n"


@pytest.mark.parametrize("template, needle", [
    (None, "has no chat template"),
    (DATED, "today's date"),
])
def test_templates_it_cannot_serve_are_refused_at_once(checkpoint, template, needle):
    with pytest.raises(TemplateError, match=needle) as e:
        ChatRenderer(tokenizer_with(checkpoint, template), "my-model")
    assert "my-model" in str(e.value)


def test_unstable_or_rejecting_templates_are_refused_naming_the_model(checkpoint):
    moved = ChatRenderer(tokenizer_with(checkpoint, SYSTEM_LAST), "sys-last")
    with pytest.raises(TemplateError, match="sys-last.*not render 1 message.*stably"):
        moved.render([msg("user", "q")], [msg("system", "s")])
    alternating = ChatRenderer(tokenizer_with(checkpoint, ALTERNATING), "alternating")
    assert alternating.render([msg("worker", "a")], [msg("user", "q")]) == "[assistant]a"
    with pytest.raises(TemplateError, match="alternating.*cannot render the roles user, assistant, assistant"):
        alternating.render([msg("worker", "b")], [msg("user", "q"), msg("worker", "a")])
    with pytest.raises(TemplateError, match="role 'tool'"):
        alternating.render([msg("tool", "x")])


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory):
    """A tiny random Qwen3 checkpoint with a Qwen-style template, served in process, recording what it serves."""
    path = make_random_checkpoint(str(tmp_path_factory.mktemp("qwen3-chat")), "qwen3", "tiny")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = QWEN_STYLE
    tok.save_pretrained(path)
    redis = EmbeddedRedis()
    server = start_in_process(Engine(EngineConfig(path)), Directory.connect(redis.url),
                              record_dir=str(tmp_path_factory.mktemp("qwen3-traces")))
    server.path = path
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield agent_pb2_grpc.AgentServiceStub(channel), server
    channel.close()
    server.stop()
    redis.stop()


def chat(*pairs):
    return [pb.ChatMessage(role=r, content=c) for r, c in pairs]


GREEDY = pb.Sampling(max_tokens=4, ignore_eos=True)


def test_a_workflow_sent_as_chat_messages_is_rendered_with_the_models_template(qwen_server):
    stub, server = qwen_server
    events = list(stub.RunWorkflow(pb.WorkflowRequest(
        task_messages=chat(("system", "add the parts")),
        branch_messages=[pb.Conversation(messages=chat(("user", "part 1"))),
                         pb.Conversation(messages=chat(("user", "part 2")))],
        synthesis_messages=chat(("user", "the sum?")), worker_sampling=GREEDY, synthesis_sampling=GREEDY,
        transport=pb.TRANSPORT_LOCAL)))
    done = events[-1].done
    text = {m: stub.GetMessage(pb.GetMessageRequest(session_id=done.session_id, message_id=m)).text
            for m in [*done.branch_message_ids, done.answer_message_id]}
    for j, m in enumerate(done.branch_message_ids):  # each branch: its conversation, then an assistant turn
        assert text[m].startswith("<|im_start|>assistant\n"), text[m]
    answer = text[done.answer_message_id]
    assert answer.startswith("<|im_start|>user\nthe sum?<|im_end|>\n<|im_start|>assistant\n"), answer
    reply = list(stub.Generate(pb.GenerateRequest(session_id=done.session_id, sampling=GREEDY,
                                                  messages=chat(("system", "s"), ("user", "hi")))))
    info = stub.GetMessage(pb.GetMessageRequest(session_id=done.session_id, message_id=reply[-1].message_id))
    assert info.text.startswith("<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                                "<|im_start|>assistant\n"), info.text


def test_choreography_calls_and_graph_nodes_take_chat_messages(qwen_server):
    """Prefill and Decode calls, and RunGraph nodes, sent as chat messages are rendered with the model's template:
    a call without parents starts a conversation, one with parents continues it, and a decoding call's reply
    follows the header of its reply role."""
    stub, _ = qwen_server
    got = stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(messages=chat(("system", "add the parts")))]))
    sid, (task,) = got.session_id, got.message_ids
    text = lambda mid: stub.GetMessage(pb.GetMessageRequest(session_id=sid, message_id=mid)).text  # noqa: E731
    assert text(task) == "<|im_start|>system\nadd the parts<|im_end|>\n"
    events = list(stub.Decode(pb.DecodeRequest(session_id=sid, calls=[pb.DecodeCallSpec(
        messages=chat(("user", "part 1")), parents=[task], sampling=GREEDY)])))
    assert text(events[-1].message_id).startswith("<|im_start|>user\npart 1<|im_end|>\n<|im_start|>assistant\n")
    graph = list(stub.RunGraph(pb.GraphRequest(session_id=sid, nodes=[
        pb.GraphNode(name="ask", messages=chat(("user", "part 2")), parents=[pb.GraphParent(message_id=task)],
                     decode=True, sampling=GREEDY),
        pb.GraphNode(name="sum", messages=chat(("user", "the sum?")), reply_role="synthesizer", decode=True,
                     parents=[pb.GraphParent(message_id=task), pb.GraphParent(node="ask")], sampling=GREEDY)])))
    done = {e.node_done.node: e.node_done for e in graph if e.HasField("node_done")}
    assert text(done["ask"].message_id).startswith("<|im_start|>user\npart 2<|im_end|>\n<|im_start|>assistant\n")
    assert text(done["sum"].message_id).startswith("<|im_start|>user\nthe sum?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("call, needle", [
    (lambda s: s.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(text="t", messages=chat(("user", "a")))])),
     "calls[0]: a call sends text, tokens or chat messages"),
    (lambda s: list(s.Decode(pb.DecodeRequest(calls=[pb.DecodeCallSpec(messages=chat(("user", "a")),
                                                                       reply_role="robot")]))),
     "calls[0].reply_role 'robot' must be worker or synthesizer"),
    (lambda s: list(s.RunGraph(pb.GraphRequest(nodes=[pb.GraphNode(name="a", messages=chat(("bot", "a")))]))),
     "nodes[0].messages[0].role 'bot'"),
    (lambda s: list(s.RunGraph(pb.GraphRequest(nodes=[pb.GraphNode(name="a", prompt="p",
                                                                   messages=chat(("user", "a")))]))),
     "nodes[0]: a node sends a prompt or chat messages, not both"),
])
def test_bad_chat_calls_are_refused_naming_the_field(qwen_server, call, needle):
    stub, _ = qwen_server
    with pytest.raises(grpc.RpcError) as e:
        call(stub)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details(), e.value.details()


@pytest.mark.parametrize("request_, code, needle", [
    (pb.WorkflowRequest(task="t", branch_messages=[pb.Conversation(messages=chat(("user", "a")))],
                        synthesis_messages=chat(("user", "s"))), grpc.StatusCode.INVALID_ARGUMENT, "not both"),
    (pb.WorkflowRequest(branch_messages=[pb.Conversation(messages=chat(("robot", "a")))]),
     grpc.StatusCode.INVALID_ARGUMENT, "branch_messages[0][0].role 'robot'"),
    (pb.WorkflowRequest(branch_messages=[pb.Conversation()]), grpc.StatusCode.INVALID_ARGUMENT,
     "branch_messages[0] is empty"),
    (pb.WorkflowRequest(branch_messages=[pb.Conversation(messages=chat(("user", "a")))]),
     grpc.StatusCode.INVALID_ARGUMENT, "task_messages is empty"),
    # (what `braid run --branch ""` sends: a branch whose one message has no text)
    (pb.WorkflowRequest(task_messages=chat(("system", "t")), branch_messages=[
        pb.Conversation(messages=chat(("user", "a"))), pb.Conversation(messages=chat(("user", " ")))]),
     grpc.StatusCode.INVALID_ARGUMENT, "branch_messages[1][0].content is empty"),
])
def test_bad_chat_workflows_are_refused_naming_the_field(qwen_server, request_, code, needle):
    stub, _ = qwen_server
    with pytest.raises(grpc.RpcError) as e:
        list(stub.RunWorkflow(request_))
    assert e.value.code() == code and needle in e.value.details(), e.value.details()


def test_braid_run_sends_plain_content_rendered_by_the_server(qwen_server, capsys):
    """`braid run` sends --task, --branch and --prompt as chat messages (system, user, user), which the server
    renders with the model's template; the answer follows the template's assistant turn."""
    from braid.cli import main

    stub, server = qwen_server
    assert main(["run", "--address", f"127.0.0.1:{server.port}", "--task", "add the parts", "--branch", "part 1",
                 "--branch", "part 2", "--prompt", "the sum?", "--max-tokens", "3", "--transport", "text"]) == 0
    session, answer = capsys.readouterr().out.split("[done] session ")[1].strip().split(", answer ")
    text = stub.GetMessage(pb.GetMessageRequest(session_id=session, message_id=answer)).text
    # (text mode: the workers' replies, each an assistant turn, then the question and the answer's turn)
    assert text.startswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nthe sum?<|im_end|>\n<|im_start|>assistant\n" in text


def test_a_model_without_a_template_refuses_chat_messages_and_serves_strings(checkpoint, capsys):
    from braid.cli import main

    redis = EmbeddedRedis()
    server = start_in_process(Engine(EngineConfig(checkpoint("llama"))), Directory.connect(redis.url))
    try:
        run = ["run", "--address", f"127.0.0.1:{server.port}", "--task", "t", "--branch", "a", "--max-tokens", "2"]
        assert main(run) == 1
        err = capsys.readouterr().err
        assert "FAILED_PRECONDITION" in err and "no chat template" in err and "--raw" in err
        assert main([*run, "--raw"]) == 0 and "[done] session" in capsys.readouterr().out
        stub = agent_pb2_grpc.AgentServiceStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(messages=chat(("user", "hi")), sampling=GREEDY)))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no chat template" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Prefill(pb.PrefillRequest(calls=[pb.PrefillCallSpec(messages=chat(("user", "hi")))]))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no chat template" in e.value.details()
        assert list(stub.Generate(pb.GenerateRequest(prompt="hi", sampling=GREEDY)))[-1].message_id
    finally:
        server.stop()
        redis.stop()


def test_synthetic_tasks_are_laid_out_as_the_model_is_served(qwen_server, checkpoint):
    """Braid's synthetic tasks in a model's own layout: rendered by its template from the task's chat messages, as
    RunWorkflow renders a workflow sent as chat messages (the same ChatRenderer.workflow); in the reference role
    tokens where that is the served layout (the reference template, or no template: raw strings)."""
    from braid.models.chat import task_renderer
    from braid.models.tasks import generate

    task = generate("chain", 3, 2)
    reference = (turn("system", task.system), [turn("user", b.context) for b in task.branches], header("worker"),
                 task.prompt())
    for tok in (AutoTokenizer.from_pretrained(REFERENCE_MODEL), tokenizer_with(checkpoint, None)):
        assert task_renderer(tok) is None
        assert task.workflow_texts(task_renderer(tok)) == reference
    _, server = qwen_server
    r = task_renderer(AutoTokenizer.from_pretrained(server.path), "qwen-style")
    system, contexts, opens, prompt = task.workflow_texts(r)
    assert system == f"<|im_start|>system\n{task.system}<|im_end|>\n"
    assert contexts == [f"<|im_start|>user\n{b.context}<|im_end|>\n" for b in task.branches]
    assert opens == "<|im_start|>assistant\n"
    assert prompt == f"<|im_start|>user\n{task.question}<|im_end|>\n<|im_start|>assistant\n"
    assert (system, contexts, prompt, opens) == r.workflow(*[
        [msg("system", task.system)], [[msg("user", b.context)] for b in task.branches], [msg("user", task.question)]])
    with pytest.raises(TemplateError, match="alternate"):
        task_renderer(tokenizer_with(checkpoint, ALTERNATING))


def test_calibration_and_eval_on_synthetic_tasks_in_a_models_own_layout(qwen_server, tmp_path, capsys):
    """`braid calibrate` and `braid eval` draw the worker tasks in a Qwen-style model's own layout; tasks laid out only
    in the reference role tokens (multiqa, the parallel source) are refused for it, naming what to draw instead."""
    from braid.cli import main
    from braid.methods.calibration import Calibration

    _, server = qwen_server
    out = tmp_path / "cal"
    args = ["calibrate", "--model", server.path, "--out", str(out), "--tasks", "chain", "--branches", "2",
            "--sources", "synthesis=1,distill=1", "--steps", "2", "--tasks-per-step", "2", "--eval-every", "2",
            "--held-out-per-cell", "1", "--worker-max-tokens", "4", "--answer-max-tokens", "4", "--lora-rank", "2"]
    assert main(args) == 0
    assert Calibration.load(str(out)).record["steps"] == 2
    capsys.readouterr()
    assert main([*args[:5], "--tasks", "chain,multiqa", *args[7:]]) == 2
    assert "multiqa: laid out only in the reference" in capsys.readouterr().err
    assert main(["eval", "--model", server.path, "--calibration", "none", "--tasks", "chain", "--branches", "2",
                 "--samples", "1", "--modes", "text", "--worker-max-tokens", "4", "--answer-max-tokens", "4"]) == 0
    capsys.readouterr()
    assert main(["eval", "--model", server.path, "--calibration", "none", "--tasks", "multiqa", "--samples", "1",
                 "--modes", "text"]) == 2
    assert "--traces" in capsys.readouterr().err


def test_a_calibration_trains_on_the_workflows_a_model_served(qwen_server, tmp_path):
    """serve -> record -> calibrate: chat workflows served on a Qwen-style model are recorded, and `braid calibrate
    --traces` trains on them as the served path lays them out (rendered with the model's template), reusing the
    replies these weights wrote, holding some traces out for its check. A trace this model's template cannot
    render is refused naming its file and line."""
    from braid.cli import main
    from braid.engine.model import fingerprint_checkpoint
    from braid.methods.calibration import Calibration, load_engine
    from braid.models.chat import WORKER_HEADER
    from braid.models.traces import load_trace_workflows, split, workflow_digest
    from braid.synthesizer.runner import SynthesisRunner, SynthesizerConfig

    stub, server = qwen_server
    for i in range(4):  # (four workflows of one kind: two branches under one task)
        list(stub.RunWorkflow(pb.WorkflowRequest(
            task_messages=chat(("system", "add the parts")),
            branch_messages=[pb.Conversation(messages=chat(("user", f"part {j} of set {i}"))) for j in range(2)],
            synthesis_messages=chat(("user", "the sum?")), worker_sampling=GREEDY, synthesis_sampling=GREEDY,
            transport=pb.TRANSPORT_TEXT)))
    server.recorder.close()  # (everything recorded is on disk)
    traces = server.recorder.path
    assert len(open(traces).read().splitlines()) >= 4
    out = tmp_path / "cal"
    args = ["calibrate", "--model", server.path, "--out", str(out), "--traces", traces, "--sources", "none",
            "--tasks", "chain", "--branches", "2", "--steps", "2", "--tasks-per-step", "2",
            "--eval-every", "2", "--held-out-per-cell", "1", "--held-out-traces", "2", "--worker-max-tokens", "4",
            "--answer-max-tokens", "4", "--lora-rank", "2"]
    assert main(args) == 0
    record = Calibration.load(str(out)).record
    # (the graphs served before are recorded too; none of them holds a synthesis)
    n = sum('"kind":"workflow"' in line for line in open(traces).read().splitlines())
    workflows = load_trace_workflows([traces], AutoTokenizer.from_pretrained(server.path), fingerprint_checkpoint(
        server.path), WORKER_HEADER, server.path)
    held = split(workflows, 2)[1]  # (about one in 2 of each kind, by a hash of each)
    # (this kind: two branches under "add the parts", the four sent here and any an earlier test in this module sent)
    # (the split counts distinct workflows: one sent twice is one, held out or trained on whole)
    kind = {workflow_digest(w) for w in workflows if "add the parts" in w.task and w.branches == 2}
    held_kind = {workflow_digest(w) for w in held if "add the parts" in w.task and w.branches == 2}
    assert len(kind) >= 4 and held_kind <= kind and len(held_kind) in (len(kind) // 2, -(-len(kind) // 2))
    assert record["traces"] == {"files": [traces], "workflows": n, "held_out": len(held), "replies_decoded_again": 0}
    assert set(record["held_out_accuracy"][-1]) == {"step", "traces"}  # (traces alone: no synthetic check)
    # -> verify on the traces it held out -> the served path's gate reads that verification
    assert main(["eval", "--model", server.path, "--calibration", str(out), "--traces", traces,
                 "--held-out-traces", "2", "--modes", "text,calibrated", "--worker-max-tokens", "4",
                 "--answer-max-tokens", "4", "--verify", "--verification", "own"]) == 0
    cal = Calibration.load(str(out))
    v = cal.verification
    assert v["traces"] == [traces] and v["tasks"] == ["traces"] and v["placement"] == cal.placement.value
    assert v["calibration"] == cal.digest and v["mode"] == "calibrated"
    assert sum(b["n"] for b in v["bands"]) == len(held)  # (the traces calibrate held out: the same ones)
    engine = load_engine(EngineConfig(server.path, calibration=str(out)))
    info = SynthesisRunner(engine, None, None, SynthesizerConfig(refresh_tokens=0)).info()
    assert info.verified_branches == v["max_branches"] and info.verified_placement == cal.placement.value
    # a chat trace on a model without a template: refused, naming the file and line
    bad = tmp_path / "bad.jsonl"
    bad.write_text(open(traces).readline())
    plain = make_random_checkpoint(str(tmp_path / "plain"), "llama", "tiny")
    assert main(["calibrate", "--model", plain, "--out", str(tmp_path / "cal2"), "--traces", str(bad),
                 *args[7:]]) == 2


def test_a_graph_served_is_recorded_and_its_synthesis_read_as_a_workflow(qwen_server, tmp_path):
    """RunGraph is recorded (one line of kind "graph": each node as served, chat messages rendered, with its reply);
    a graph shaped as a synthesis (a task, workers each over notes of their own, a final node reading their replies)
    reads back as the workflow RunWorkflow lays out from the same messages, with the replies these weights wrote;
    other nodes give none, and a graph that fails is not recorded."""
    from braid.models.chat import WORKER_HEADER
    from braid.models.traces import load_trace_workflows

    _, qwen = qwen_server
    redis = EmbeddedRedis()
    engine = Engine(EngineConfig(qwen.path))
    server = start_in_process(engine, Directory.connect(redis.url), record_dir=str(tmp_path))
    try:
        stub = agent_pb2_grpc.AgentServiceStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
        opens = "<|im_start|>assistant\n"
        nodes = [pb.GraphNode(name="system", messages=chat(("system", "add the parts")))]
        for j in range(2):
            nodes += [pb.GraphNode(name=f"notes{j}", messages=chat(("user", f"part {j}")),
                                   parents=[pb.GraphParent(node="system")]),
                      pb.GraphNode(name=f"solve{j}", prompt=opens, decode=True, sampling=GREEDY,
                                   parents=[pb.GraphParent(node="system"), pb.GraphParent(node=f"notes{j}")])]
        nodes.append(pb.GraphNode(name="final", messages=chat(("user", "the sum?")), reply_role="synthesizer",
                                  decode=True, sampling=GREEDY, parents=[pb.GraphParent(node=n)
                                                                         for n in ("system", "solve0", "solve1")]))
        events = list(stub.RunGraph(pb.GraphRequest(nodes=nodes)))
        replies = {e.node_done.node: e.node_done.text for e in events if e.HasField("node_done")}
        with pytest.raises(grpc.RpcError):  # (refused: not recorded)
            list(stub.RunGraph(pb.GraphRequest(nodes=[pb.GraphNode(name="x", prompt="y", decode=True,
                                                                   parents=[pb.GraphParent(node="nowhere")])])))
    finally:
        server.stop()
        redis.stop()
    lines = open(server.recorder.path).read().splitlines()
    assert len(lines) == 1 and '"kind":"graph"' in lines[0]
    (w,) = load_trace_workflows([server.recorder.path], engine.lm.tokenizer, engine.fingerprint, WORKER_HEADER)
    assert w.where.endswith("line 1, node final") and w.replies == (replies["solve0"], replies["solve1"])
    task, prompts, synthesis, header = ChatRenderer(engine.lm.tokenizer).workflow(
        [msg("system", "add the parts")], [[msg("user", f"part {j}")] for j in range(2)], [msg("user", "the sum?")])
    assert (w.task, list(w.prompts), w.synthesis, w.header) == (task, prompts, synthesis, header)
    # another model's trace: its replies are decoded again
    (again,) = load_trace_workflows([server.recorder.path], engine.lm.tokenizer, "another", WORKER_HEADER)
    assert again.replies is None


def test_a_models_own_layout_closes_turns_with_the_stop_token_its_template_writes(checkpoint):
    """In a model's own layout the synthetic replies and answers end with the stop token its template closes a turn
    with (as Llama 3's <|eot_id|>), not the first of the model's stop tokens (its <|end_of_text|>)."""
    from transformers import AutoModelForCausalLM

    from braid.models.chat import task_renderer
    from braid.train.calibrate import CalibrateConfig, Encoder

    path = checkpoint("llama")
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": ["<|eot|>"]})
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|eot|>{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    eot = tok.convert_tokens_to_ids("<|eot|>")
    model = AutoModelForCausalLM.from_pretrained(path)
    model.generation_config.eos_token_id = [tok.eos_token_id, eot]
    encoder = Encoder(model, tok, model.model.rotary_emb.inv_freq, CalibrateConfig(model=path), task_renderer(tok))
    assert encoder.end == eot and encoder.closed("hi") == encoder.ids("hi") + [eot]
    reference = Encoder(model, tok, model.model.rotary_emb.inv_freq, CalibrateConfig(model=path))
    assert reference.end == tok.eos_token_id and reference.closed("hi") == reference.ids("hi" + END)


@pytest.mark.parametrize("workflow", ["tot", "mad-iter", "mad-par"])
def test_a_preset_over_notes_is_served_as_the_measured_workflow(qwen_server, workflow):
    """`braid run --preset` over notes sends chat messages (and header-only reply nodes); the server renders them
    into exactly the graph `braid.evals.workflows` measures (notes_graph over Task.workflow_texts), for the
    reference template and a model's own."""
    import argparse

    from braid.cli import notes_request
    from braid.methods.dag.presets import notes_graph
    from braid.models.chat import task_renderer
    from braid.models.tasks import generate
    from braid.runtime.convert import graph

    task = generate("vote", 11, 3)
    args = argparse.Namespace(preset=workflow, task=task.system, branch=[b.context for b in task.branches],
                              prompt=task.question)
    _, server = qwen_server
    for path in (REFERENCE_MODEL, server.path):
        tok = AutoTokenizer.from_pretrained(path)
        sent = graph(notes_request(args, SamplingParams(max_tokens=8), "kv", None), 64,
                     renderer=ChatRenderer(tok, path))
        measured = notes_graph(workflow, *task.workflow_texts(task_renderer(tok, path)))
        assert [(n.name, n.prompt, n.role, n.parents) for n in sent.nodes] == \
            [(n.name, n.prompt, n.role, n.parents) for n in measured.nodes]
