"""Between agent-API protos and typed requests; a bad field becomes a BraidError that names it."""

import secrets
from dataclasses import dataclass

from braid.engine import DecodeCall, PrefillCall, SamplingParams
from braid.engine.errors import BraidError, ContextOverflowError, PreconditionError
from braid.kv.connector import Transport
from braid.methods.dag import Edge, Graph, Node
from braid.methods.staircase import StaircaseSchedule, Variant
from braid.methods.synthesis import Placement
from braid.models.chat import ROLES, ChatRenderer, TemplateError
from braid.protos import agent_pb2 as pb
from braid.runtime.messages import SynthesizerInfo


@dataclass
class Workflow:
    """One RunWorkflow request, validated whole: it carries the request through the ingress."""

    id: str
    session: str  # empty: a new session
    task: str
    prompts: list[str]
    synthesis_prompt: str
    worker_sampling: SamplingParams
    answer_sampling: SamplingParams
    placement: Placement
    transport: Transport | None  # as the client asked (None: TRANSPORT_UNSPECIFIED, the cluster decides)
    branch_limit: int  # the most tokens one branch message can hold: worker header + max_tokens
    staircase: tuple[StaircaseSchedule, Variant] | None = None  # answer from the branches' first chunks
    worker_header: str = ""  # opens each worker's reply ("": the workers' configured header)

    @property
    def num_branches(self) -> int:
        return len(self.prompts)


def chat_text(renderer: ChatRenderer | str, messages, before=(), then: str | None = None, field: str = "messages"
              ) -> str:
    """Chat messages as the model's template renders them after `before` (and, with `then`, the header that opens
    a turn of that role after them). `renderer` is the model's ChatRenderer, or why it has none. An unknown role
    is INVALID_ARGUMENT, naming the field; a template that cannot render them is FAILED_PRECONDITION."""
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise BraidError(f"{field}[{i}].role {m.role!r} is not one of {', '.join(ROLES)}")
    if isinstance(renderer, str):
        raise PreconditionError(f"{field}: {renderer}")
    try:
        text = renderer.render(messages, before) if messages else ""
        return text + (renderer.header(then, [*before, *messages]) if then is not None else "")
    except TemplateError as e:
        raise PreconditionError(f"{field}: {e}") from None


def _chat_workflow(request: pb.WorkflowRequest, renderer: ChatRenderer | str) -> tuple[str, list[str], str, str]:
    """(task, branch prompts, synthesis prompt, worker header) of a workflow sent as chat messages
    (ChatRenderer.workflow)."""
    if request.task or request.branch_prompts or request.synthesis_prompt:
        raise BraidError("a workflow is sent as strings (task, branch_prompts, synthesis_prompt) or as chat "
                         "messages (task_messages, branch_messages, synthesis_messages), not both")
    fields = [("task_messages", request.task_messages), ("synthesis_messages", request.synthesis_messages),
              *((f"branch_messages[{j}]", c.messages) for j, c in enumerate(request.branch_messages))]
    for field, messages in fields:
        for i, m in enumerate(messages):
            if m.role not in ROLES:
                raise BraidError(f"{field}[{i}].role {m.role!r} is not one of {', '.join(ROLES)}")
            if not m.content.strip():
                raise BraidError(f"{field}[{i}].content is empty; every message needs text (a branch its "
                                 "instruction)")
    for j, conversation in enumerate(request.branch_messages):
        if not conversation.messages:
            raise BraidError(f"branch_messages[{j}] is empty; every branch needs an instruction")
    if not request.task_messages:
        raise BraidError("task_messages is empty: the workers and the synthesizer read a shared task first; send it "
                         "(a system or user message)")
    if isinstance(renderer, str):
        raise PreconditionError(f"chat messages: {renderer}")
    try:
        return renderer.workflow(request.task_messages, [c.messages for c in request.branch_messages],
                                 request.synthesis_messages)
    except TemplateError as e:
        raise PreconditionError(str(e)) from None


def workflow(request: pb.WorkflowRequest, info: SynthesizerInfo, tokenize, header: str, default_max_tokens: int,
             max_branches: int, colocated: bool, schedule: StaircaseSchedule = StaircaseSchedule(strict=False),
             renderer: ChatRenderer | str = "this server renders no chat messages") -> Workflow:
    """Every check a workflow gets, before any replica works on it. `tokenize(text) -> ids` is the model's;
    `renderer` renders a workflow sent as chat messages (or says why the model has none)."""
    transport = requested_transport(request.transport)
    if colocated and transport is not None and transport.remote:
        raise BraidError(f"transport {pb.Transport.Name(transport)} needs separate worker and synthesizer "
                         "engines; this cluster is colocated (use TRANSPORT_LOCAL, TRANSPORT_TEXT or leave it unset)")
    if not colocated and transport is Transport.LOCAL:
        raise BraidError("transport TRANSPORT_LOCAL needs a colocated cluster (braid serve --colocate); use "
                         "TRANSPORT_GRPC, TRANSPORT_COLLECTIVE, TRANSPORT_TEXT or leave it unspecified")
    chat = bool(request.task_messages or request.branch_messages or request.synthesis_messages)
    n = len(request.branch_messages if chat else request.branch_prompts)
    if not 1 <= n <= max_branches:
        raise BraidError(f"{n} {'branch_messages' if chat else 'branch_prompts'} given; a workflow takes 1 to "
                         f"{max_branches}")
    if chat:
        task, prompts, synthesis_prompt, header = _chat_workflow(request, renderer)
    else:
        task, prompts, synthesis_prompt = request.task, list(request.branch_prompts), request.synthesis_prompt
        for j, prompt in enumerate(prompts):
            if not prompt.strip():
                raise BraidError(f"branch_prompts[{j}] is empty; every branch needs an instruction")
        if not synthesis_prompt:
            raise BraidError("synthesis_prompt is empty")
    staircase = None
    if request.HasField("staircase"):
        if transport is Transport.TEXT:
            raise BraidError("staircase reads the workers' KV chunks as they arrive: it needs a KV transport "
                             "(TRANSPORT_GRPC, TRANSPORT_COLLECTIVE or unspecified), not TRANSPORT_TEXT")
        if colocated:
            raise PreconditionError("staircase needs workers and a synthesizer on separate replicas, which ship KV "
                                    "in chunks as they decode; this cluster is colocated (its workers hand whole "
                                    "messages over). RunGraph's staircase nodes stream on one replica")
        staircase = staircase_options(request.staircase, schedule)
        staircase[0].quorum(n)  # (refuses a redundancy that leaves no branch to wait for)
    try:
        placement = Placement(request.placement or info.placement)  # unset: what the synthesizer was calibrated for
    except ValueError:
        raise BraidError(f"placement {request.placement!r} is not one of {[p.value for p in Placement]}") from None
    worker = sampling(request.worker_sampling, default_max_tokens, "worker_sampling")
    answer = sampling(request.synthesis_sampling, default_max_tokens, "synthesis_sampling")
    wf = Workflow(secrets.token_hex(8), request.session_id, task or " ", prompts, synthesis_prompt, worker, answer,
                  placement, transport, len(tokenize(header)) + worker.max_tokens, staircase,
                  header if chat else "")
    _check_context(wf, info.max_positions, tokenize, text=transport is Transport.TEXT)
    return wf


def requested_transport(value: int) -> Transport | None:
    """A request's Transport field as the type the cluster carries (None: unspecified); INVALID_ARGUMENT naming
    the values for a number the API does not define."""
    if value == pb.TRANSPORT_UNSPECIFIED:
        return None
    try:
        return Transport(value)
    except ValueError:
        raise BraidError(f"transport {value} is not a Transport value ({', '.join(pb.Transport.keys())})") from None


def _check_context(wf: Workflow, limit: int, tokenize, text: bool) -> None:
    """Refuse what would overflow the context, at the most the sampling caps allow (as vLLM does)."""
    task = len(tokenize(wf.task))
    ends = []  # where each branch message can end
    for j, prompt in enumerate(wf.prompts):
        end = task + len(tokenize(prompt)) + wf.branch_limit
        if end > limit:
            raise ContextOverflowError(
                f"branch_prompts[{j}]: task + branch prompt + worker header + worker_sampling.max_tokens "
                f"({wf.worker_sampling.max_tokens}) = {end} positions exceed the model's {limit}")
        ends.append(end)
    m, b = wf.num_branches, wf.branch_limit
    if text or wf.placement in (Placement.SEQUENTIAL, Placement.MIXED):  # (MIXED lays decoded replies end to end)
        synth_at = task + m * b
    elif wf.placement is Placement.BRANCH_POINT:
        synth_at = task + b
    else:
        synth_at = max(ends)
    need = synth_at + len(tokenize(wf.synthesis_prompt)) + wf.answer_sampling.max_tokens
    if need > limit:
        raise ContextOverflowError(
            f"synthesis_prompt: {m} branches of up to {b} tokens ({wf.placement.value if not text else 'text'}), the "
            f"prompt and synthesis_sampling.max_tokens ({wf.answer_sampling.max_tokens}) need up to {need} positions; "
            f"the model has {limit}. Lower the max_tokens or send fewer or shorter branches")


def sampling(msg: pb.Sampling, default_max_tokens: int, field: str = "sampling") -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=msg.max_tokens or default_max_tokens, temperature=msg.temperature, top_p=msg.top_p or 1.0,
            stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
            seed=msg.seed if msg.HasField("seed") else None)
    except ValueError as e:
        raise BraidError(f"{field}: {e}") from None


def _offsets(values, parents) -> list[int | None] | None:
    if not values:
        return None
    return [None if v == -1 else int(v) for v in values]


# A message that has parents continues a conversation: it is rendered as following an earlier turn (the renderer's
# stand-in for one), so that a template's conversation start (a default system turn, a begin-of-text token) is not
# rendered again in the middle of it
_CONTINUES = ({"role": "user", "content": "x"},)


def call_text(renderer: ChatRenderer | str, messages, has_parents: bool, reply_role: str | None, field: str) -> str:
    """A choreography call's or graph node's chat messages as its text (chat_text), after its parents when it has
    some; with `reply_role`, the header that opens that turn follows (a call that decodes)."""
    if reply_role is not None and reply_role not in ("worker", "synthesizer"):
        raise BraidError(f"{field.rsplit('.', 1)[0]}.reply_role {reply_role!r} must be worker or synthesizer")
    return chat_text(renderer, messages, _CONTINUES if has_parents else (), reply_role, field)


def prefill_call(spec: pb.PrefillCallSpec, renderer: ChatRenderer | str = "no chat template",
                 field: str = "calls") -> PrefillCall:
    if spec.messages and (spec.text or spec.tokens):
        raise BraidError(f"{field}: a call sends text, tokens or chat messages, one of them")
    text = call_text(renderer, spec.messages, bool(spec.parents), None, f"{field}.messages") if spec.messages \
        else spec.text
    return PrefillCall(text or list(spec.tokens), parents=list(spec.parents),
                       offsets=_offsets(spec.offsets, spec.parents),
                       new_offset=spec.new_offset if spec.HasField("new_offset") else None)


def decode_call(spec: pb.DecodeCallSpec, default_max_tokens: int, renderer: ChatRenderer | str = "no chat template",
                field: str = "calls") -> DecodeCall:
    if spec.messages and (spec.header or spec.header_tokens):
        raise BraidError(f"{field}: a call sends a header, header tokens or chat messages, one of them")
    header = call_text(renderer, spec.messages, bool(spec.parents), spec.reply_role or "synthesizer",
                       f"{field}.messages") if spec.messages else spec.header
    return DecodeCall(header or list(spec.header_tokens), parents=list(spec.parents),
                      offsets=_offsets(spec.offsets, spec.parents),
                      new_offset=spec.new_offset if spec.HasField("new_offset") else None,
                      sampling=sampling(spec.sampling, default_max_tokens))


def graph(request: pb.GraphRequest, default_max_tokens: int,
          schedule: StaircaseSchedule = StaircaseSchedule(strict=False),
          renderer: ChatRenderer | str = "no chat template") -> Graph:
    """A RunGraph request as a validated Graph (INVALID_ARGUMENT naming the node and field otherwise); nodes
    sent as chat messages are rendered with `renderer`."""
    nodes = []
    for i, n in enumerate(request.nodes):
        parents = tuple(Edge(p.node, p.message_id, p.offset if p.HasField("offset") else None, p.leak)
                        for p in n.parents)
        prompt = n.prompt
        if n.messages and n.prompt:
            raise BraidError(f"nodes[{i}]: a node sends a prompt or chat messages, not both")
        if n.messages or (n.decode and n.reply_role and not n.prompt):  # (no messages: the reply's header alone)
            prompt = call_text(renderer, n.messages, bool(n.parents), (n.reply_role or "worker") if n.decode else None,
                               f"nodes[{i}].messages")
        nodes.append(Node(n.name, prompt, n.role, parents,
                          sampling(n.sampling, default_max_tokens, f"nodes[{i}].sampling") if n.decode else None,
                          n.output or "kv", n.private, n.staircase))
    schedule, variant = staircase_options(request.staircase, schedule)
    return Graph(nodes, schedule, variant, request.calibrated, turn_lora=not request.base_turns)


MAX_CHUNK_SIZES = 8


def staircase_options(msg: pb.StaircaseOptions, default: StaircaseSchedule = StaircaseSchedule(strict=False)
                      ) -> tuple[StaircaseSchedule, Variant]:
    """The schedule and variant a request's StaircaseOptions ask for: `default`'s (the server's) wherever the
    request sets nothing. A redundancy the request sets is refused where it leaves no branch to wait for."""
    for name in ("proposer_chunks", "aggregator_chunks"):
        if len(getattr(msg, name)) > MAX_CHUNK_SIZES:
            raise BraidError(f"staircase.{name}: at most {MAX_CHUNK_SIZES} sizes (the last repeats), got "
                             f"{len(getattr(msg, name))}")
    own = msg.HasField("redundancy")
    schedule = StaircaseSchedule(tuple(msg.proposer_chunks) or default.proposer,
                                 tuple(msg.aggregator_chunks) or default.aggregator,
                                 msg.redundancy if own else default.redundancy, strict=own or default.strict)
    try:
        return schedule, Variant(msg.variant or Variant.REPREFILL.value)
    except ValueError:
        raise BraidError(f"staircase.variant {msg.variant!r} is not one of "
                         f"{', '.join(v.value for v in Variant)}") from None


def graph_request(graph: Graph, session_id: str = "") -> pb.GraphRequest:
    """A Graph as the RunGraph request that gives it back (the client side of `graph`)."""
    nodes = []
    for n in graph.nodes:
        parents = [pb.GraphParent(node=e.node, message_id=e.message, leak=e.leak,
                                  **({} if e.offset is None else {"offset": e.offset})) for e in n.parents]
        node = pb.GraphNode(name=n.name, prompt=n.prompt, role=n.role, parents=parents, output=n.output,
                            private=n.private, decode=n.sampling is not None, staircase=n.staircase)
        if n.sampling is not None:
            s = n.sampling
            node.sampling.CopyFrom(pb.Sampling(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                                               stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
                                               ignore_eos=s.ignore_eos, **({} if s.seed is None else {"seed": s.seed})))
        nodes.append(node)
    options = pb.StaircaseOptions(variant=graph.variant.value)
    if graph.schedule is not None:  # (None: the server's default schedule)
        options.MergeFrom(pb.StaircaseOptions(proposer_chunks=graph.schedule.proposer,
                                              aggregator_chunks=graph.schedule.aggregator,
                                              **({"redundancy": graph.schedule.redundancy}
                                                 if graph.schedule.strict else {})))
    return pb.GraphRequest(session_id=session_id, nodes=nodes, staircase=options, calibrated=graph.calibrated,
                           base_turns=not graph.turn_lora)


def token_event(event) -> pb.TokenEvent:
    return pb.TokenEvent(call=event.call, token_id=event.token_id, text=event.text,
                         finish_reason=event.finish_reason or "", message_id=event.message_id or "")
