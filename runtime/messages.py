"""Typed messages between the ingress, the workers and the synthesizer (what Serve carries between them)."""

from dataclasses import dataclass, field

from braid.engine.engine import DecodeCall
from braid.engine.sampling import SamplingParams
from braid.kv.connector import Transport
from braid.methods.staircase import StaircaseSchedule, Variant
from braid.methods.synthesis import SynthesisMode


@dataclass
class BranchRequest:
    """Ingress -> worker: decode these branches of a workflow as one parallel batch."""

    workflow: str
    task: str
    indices: list[int]  # the branches' places in the workflow
    prompts: list[str]
    sampling: SamplingParams
    transport: Transport  # as decided at the ingress (TEXT: no KV shipped)
    kv_address: str = ""  # the synthesizer's KV receiver, in KV modes
    header: str = ""  # opens each worker's reply ("": the worker's configured header)


@dataclass
class NodesRequest:
    """Graph holder (the Synthesizer replica running a RunGraph) -> worker: decode these calls of one wave
    together. Their parents are messages of the holder, fetched from it over KVExport (lent to this session for
    the wave); each call's output message is shipped back to the holder's KV receiver when the calls end.
    The worker answers as to a BranchRequest: BranchToken per token (`branch` is the call's index here), then
    BranchDone per call once its output is with the holder."""

    stream: str  # call c's output goes on KV stream stream_name(stream, c)
    session: str
    holder: str  # the holder's KVExport address
    fingerprint: str  # the holder's model: what the fetched parents must have been encoded by
    calls: list[DecodeCall]
    kv_address: str  # the holder's KV receiver
    transport: Transport  # GRPC or COLLECTIVE (Transport.remote)
    fetch_timeout_s: float = 60.0
    ship: tuple[int, ...] = ()  # ship each output in chunks of these sizes as it decodes (the last repeats); ():
    # whole, when the calls end


@dataclass
class BranchToken:
    """Worker -> ingress, per decoded token."""

    branch: int
    token_id: int
    text: str
    finish_reason: str = ""


@dataclass
class BranchDone:
    """Worker -> ingress, once the branch's KV (if any) is with the synthesizer."""

    branch: int
    token_ids: list[int]
    kv_bytes: int
    digest: int  # of the chunks sent (braid.kv.connector); 0 when nothing was copied
    replica: str = ""  # the worker that decoded it


@dataclass
class SynthesisRequest:
    """Ingress -> synthesizer."""

    workflow: str
    session: str
    task: str
    prompt: str
    mode: SynthesisMode  # text re-prefill, or KV re-encoded to a placement
    sampling: SamplingParams
    branches: int
    transport: Transport  # as decided at the ingress (metrics are tagged with it)
    branch_tokens: list[list[int]] = field(default_factory=list)  # text mode: the workers' replies
    # a staircase (Staircase Streaming): answer from the branches' KV chunks as they arrive, in this variant and schedule
    staircase: tuple[StaircaseSchedule, Variant] | None = None
    # the cache path reads branches longer than this many tokens from their text (methods.synthesis.Refresh
    # .whole_over), the rest from their KV; 0: all from KV. `auto`'s per-branch decision (api.decision)
    text_over: int = 0
    # the branches' prompts, as the workers encoded them after the task before each branch: what a branch's record
    # names as its context, so that its message can be encoded again where it was lost
    branch_prompts: list[str] = field(default_factory=list)


@dataclass
class SynthesisRound:
    """Synthesizer -> ingress, in a staircase: the token range [start, end) of each branch's message taken in
    before the next answer chunk."""

    round: int
    chunks: dict[int, tuple[int, int]]

@dataclass
class SynthesisOpened:
    """Synthesizer -> ingress, first: where workers push this workflow's KV."""

    kv_address: str


@dataclass
class KVArrived:
    """Synthesizer -> ingress: a branch's KV is complete (not sent for local hand-overs, which copy nothing)."""

    branch: int
    bytes: int
    digest: int
    transfer_ms: float
    transport: Transport  # how it came (ReceivedStream.transport)


@dataclass
class AnswerToken:
    token_id: int
    text: str
    finish_reason: str = ""
    message_id: str = ""


@dataclass
class SynthesisDone:
    answer_id: str
    answer_text: str  # the answer alone (not the prompt, not the branches)
    branch_ids: list[str]  # the branches as stored where the answer was made (empty in text mode; "" for a
    # branch a staircase lost)
    tpot_s: float | None = None
    registered: bool = True  # False: the control plane was unreachable (the answer stands; Redis lost it)
    failed: dict[int, str] = field(default_factory=dict)  # branches a staircase answered without, and why
    text_branches: list[int] = field(default_factory=list)  # branches the cache path read from their text (text_over)


@dataclass(frozen=True)
class SynthesizerInfo:
    """What the ingress needs to validate a request and choose its transport."""

    fingerprint: str
    max_positions: int
    vocab_size: int
    kv_bytes_per_token: int
    prefill_tokens_per_s: float
    link_bytes_per_s: float | None
    calibration: str = ""  # the calibration the cache path runs with ("": none; the KV path is then uncalibrated)
    placement: str = "branch_point"  # where branches go when a request does not say: the calibration's own
    verified_branches: int = 0  # up to how many branches the calibration's answers were verified to match text's
    verified_tokens: int = 0  # on branches of up to how many tokens (0: not recorded)
    verified_placement: str = ""  # at which placement ("": none verified)
    calibration_digest: str = ""  # the loaded calibration's (Calibration.digest; "": none)
