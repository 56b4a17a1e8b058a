"""Between agent-API protos and engine calls; bad fields become BraidErrors (INVALID_ARGUMENT)."""

from dataclasses import dataclass

from braid.engine import DecodeCall, PrefillCall, SamplingParams
from braid.engine.errors import BraidError
from braid.engine.synthesis import Placement
from braid.protos import agent_pb2 as pb


@dataclass
class WorkflowParams:
    placement: Placement
    worker_sampling: SamplingParams
    answer_sampling: SamplingParams


def workflow_params(request: pb.WorkflowRequest, default_max_tokens: int, max_branches: int) -> WorkflowParams:
    """The checks every workflow request gets, wherever it runs."""
    n = len(request.branch_prompts)
    if not 1 <= n <= max_branches:
        raise BraidError(f"{n} branch_prompts given; a workflow takes 1 to {max_branches}")
    if not request.synthesis_prompt:
        raise BraidError("synthesis_prompt is empty")
    try:
        placement = Placement(request.placement or Placement.BRANCH_POINT)
    except ValueError:
        raise BraidError(f"placement {request.placement!r} is not one of {[p.value for p in Placement]}") from None
    return WorkflowParams(placement, sampling(request.worker_sampling, default_max_tokens),
                          sampling(request.synthesis_sampling, default_max_tokens))


def sampling(msg: pb.Sampling, default_max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=msg.max_tokens or default_max_tokens, temperature=msg.temperature, top_p=msg.top_p or 1.0,
            stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
            seed=msg.seed if msg.HasField("seed") else None)
    except ValueError as e:
        raise BraidError(f"sampling: {e}") from None


def _offsets(values, parents) -> list[int | None] | None:
    if not values:
        return None
    return [None if v == -1 else int(v) for v in values]


def prefill_call(spec: pb.PrefillCallSpec) -> PrefillCall:
    return PrefillCall(spec.text or list(spec.tokens), parents=list(spec.parents),
                       offsets=_offsets(spec.offsets, spec.parents),
                       new_offset=spec.new_offset if spec.HasField("new_offset") else None)


def decode_call(spec: pb.DecodeCallSpec, default_max_tokens: int) -> DecodeCall:
    return DecodeCall(spec.header or list(spec.header_tokens), parents=list(spec.parents),
                      offsets=_offsets(spec.offsets, spec.parents),
                      new_offset=spec.new_offset if spec.HasField("new_offset") else None,
                      sampling=sampling(spec.sampling, default_max_tokens))


def token_event(event) -> pb.TokenEvent:
    return pb.TokenEvent(call=event.call, token_id=event.token_id, text=event.text,
                         finish_reason=event.finish_reason or "", message_id=event.message_id or "")
