from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_TEXT: _ClassVar[Transport]
    TRANSPORT_GRPC: _ClassVar[Transport]
    TRANSPORT_COLLECTIVE: _ClassVar[Transport]
    TRANSPORT_LOCAL: _ClassVar[Transport]
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_TEXT: Transport
TRANSPORT_GRPC: Transport
TRANSPORT_COLLECTIVE: Transport
TRANSPORT_LOCAL: Transport

class Sampling(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "stop", "stop_token_ids", "ignore_eos", "seed")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    seed: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., seed: _Optional[int] = ...) -> None: ...

class WorkflowRequest(_message.Message):
    __slots__ = ("session_id", "task", "branch_prompts", "synthesis_prompt", "worker_sampling", "synthesis_sampling", "transport", "placement", "staircase", "task_messages", "branch_messages", "synthesis_messages")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    BRANCH_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SYNTHESIS_PROMPT_FIELD_NUMBER: _ClassVar[int]
    WORKER_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SYNTHESIS_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    STAIRCASE_FIELD_NUMBER: _ClassVar[int]
    TASK_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    BRANCH_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SYNTHESIS_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    task: str
    branch_prompts: _containers.RepeatedScalarFieldContainer[str]
    synthesis_prompt: str
    worker_sampling: Sampling
    synthesis_sampling: Sampling
    transport: Transport
    placement: str
    staircase: StaircaseOptions
    task_messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    branch_messages: _containers.RepeatedCompositeFieldContainer[Conversation]
    synthesis_messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, session_id: _Optional[str] = ..., task: _Optional[str] = ..., branch_prompts: _Optional[_Iterable[str]] = ..., synthesis_prompt: _Optional[str] = ..., worker_sampling: _Optional[_Union[Sampling, _Mapping]] = ..., synthesis_sampling: _Optional[_Union[Sampling, _Mapping]] = ..., transport: _Optional[_Union[Transport, str]] = ..., placement: _Optional[str] = ..., staircase: _Optional[_Union[StaircaseOptions, _Mapping]] = ..., task_messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., branch_messages: _Optional[_Iterable[_Union[Conversation, _Mapping]]] = ..., synthesis_messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Conversation(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class WorkflowEvent(_message.Message):
    __slots__ = ("branch_token", "synthesis_token", "decision", "timings", "done", "kv_receipt", "round", "branch_failed")
    BRANCH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SYNTHESIS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    KV_RECEIPT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FAILED_FIELD_NUMBER: _ClassVar[int]
    branch_token: BranchToken
    synthesis_token: TokenEvent
    decision: Decision
    timings: Timings
    done: WorkflowDone
    kv_receipt: KVReceipt
    round: StaircaseRound
    branch_failed: BranchFailed
    def __init__(self, branch_token: _Optional[_Union[BranchToken, _Mapping]] = ..., synthesis_token: _Optional[_Union[TokenEvent, _Mapping]] = ..., decision: _Optional[_Union[Decision, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., done: _Optional[_Union[WorkflowDone, _Mapping]] = ..., kv_receipt: _Optional[_Union[KVReceipt, _Mapping]] = ..., round: _Optional[_Union[StaircaseRound, _Mapping]] = ..., branch_failed: _Optional[_Union[BranchFailed, _Mapping]] = ...) -> None: ...

class BranchFailed(_message.Message):
    __slots__ = ("branch", "reason")
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    branch: int
    reason: str
    def __init__(self, branch: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class StaircaseRound(_message.Message):
    __slots__ = ("round", "chunks")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    round: int
    chunks: _containers.RepeatedCompositeFieldContainer[BranchChunk]
    def __init__(self, round: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[BranchChunk, _Mapping]]] = ...) -> None: ...

class BranchChunk(_message.Message):
    __slots__ = ("branch", "start", "end")
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    branch: int
    start: int
    end: int
    def __init__(self, branch: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class KVReceipt(_message.Message):
    __slots__ = ("branch", "bytes", "crc32", "crc32_sent", "transfer_ms", "transport")
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    CRC32_SENT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    branch: int
    bytes: int
    crc32: int
    crc32_sent: int
    transfer_ms: float
    transport: Transport
    def __init__(self, branch: _Optional[int] = ..., bytes: _Optional[int] = ..., crc32: _Optional[int] = ..., crc32_sent: _Optional[int] = ..., transfer_ms: _Optional[float] = ..., transport: _Optional[_Union[Transport, str]] = ...) -> None: ...

class BranchToken(_message.Message):
    __slots__ = ("branch", "token_id", "text", "finish_reason")
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    branch: int
    token_id: int
    text: str
    finish_reason: str
    def __init__(self, branch: _Optional[int] = ..., token_id: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("transport", "reason")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transport: Transport
    reason: str
    def __init__(self, transport: _Optional[_Union[Transport, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("ttft_ms", "last_branch_to_first_token_ms", "kv_transfer_ms", "kv_bytes")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_BRANCH_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    last_branch_to_first_token_ms: float
    kv_transfer_ms: float
    kv_bytes: int
    def __init__(self, ttft_ms: _Optional[float] = ..., last_branch_to_first_token_ms: _Optional[float] = ..., kv_transfer_ms: _Optional[float] = ..., kv_bytes: _Optional[int] = ...) -> None: ...

class WorkflowDone(_message.Message):
    __slots__ = ("session_id", "branch_message_ids", "answer_message_id", "answer_text", "failed_branches", "text_branches")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BRANCH_MESSAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    ANSWER_TEXT_FIELD_NUMBER: _ClassVar[int]
    FAILED_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    TEXT_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    branch_message_ids: _containers.RepeatedScalarFieldContainer[str]
    answer_message_id: str
    answer_text: str
    failed_branches: _containers.RepeatedCompositeFieldContainer[BranchFailed]
    text_branches: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., branch_message_ids: _Optional[_Iterable[str]] = ..., answer_message_id: _Optional[str] = ..., answer_text: _Optional[str] = ..., failed_branches: _Optional[_Iterable[_Union[BranchFailed, _Mapping]]] = ..., text_branches: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("call", "token_id", "text", "finish_reason", "message_id")
    CALL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    call: int
    token_id: int
    text: str
    finish_reason: str
    message_id: str
    def __init__(self, call: _Optional[int] = ..., token_id: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., message_id: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "prompt", "sampling", "messages")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt: str
    sampling: Sampling
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, session_id: _Optional[str] = ..., prompt: _Optional[str] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class PrefillCallSpec(_message.Message):
    __slots__ = ("text", "tokens", "parents", "offsets", "new_offset", "messages")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NEW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[str]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    new_offset: int
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[str]] = ..., offsets: _Optional[_Iterable[int]] = ..., new_offset: _Optional[int] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("session_id", "calls")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    calls: _containers.RepeatedCompositeFieldContainer[PrefillCallSpec]
    def __init__(self, session_id: _Optional[str] = ..., calls: _Optional[_Iterable[_Union[PrefillCallSpec, _Mapping]]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("session_id", "message_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    message_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., message_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DecodeCallSpec(_message.Message):
    __slots__ = ("header", "header_tokens", "parents", "offsets", "new_offset", "sampling", "messages", "reply_role")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    HEADER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NEW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    REPLY_ROLE_FIELD_NUMBER: _ClassVar[int]
    header: str
    header_tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[str]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    new_offset: int
    sampling: Sampling
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    reply_role: str
    def __init__(self, header: _Optional[str] = ..., header_tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[str]] = ..., offsets: _Optional[_Iterable[int]] = ..., new_offset: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., reply_role: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("session_id", "calls")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    calls: _containers.RepeatedCompositeFieldContainer[DecodeCallSpec]
    def __init__(self, session_id: _Optional[str] = ..., calls: _Optional[_Iterable[_Union[DecodeCallSpec, _Mapping]]] = ...) -> None: ...

class GetMessageRequest(_message.Message):
    __slots__ = ("session_id", "message_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    message_id: str
    def __init__(self, session_id: _Optional[str] = ..., message_id: _Optional[str] = ...) -> None: ...

class MessageInfo(_message.Message):
    __slots__ = ("message_id", "text", "token_ids", "offset", "parents", "fingerprint", "kv_bytes")
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    message_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    parents: _containers.RepeatedScalarFieldContainer[str]
    fingerprint: str
    kv_bytes: int
    def __init__(self, message_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., parents: _Optional[_Iterable[str]] = ..., fingerprint: _Optional[str] = ..., kv_bytes: _Optional[int] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "messages", "kv_bytes", "created_unix")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    messages: int
    kv_bytes: int
    created_unix: float
    def __init__(self, session_id: _Optional[str] = ..., messages: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., created_unix: _Optional[float] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("freed_messages",)
    FREED_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    freed_messages: int
    def __init__(self, freed_messages: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "model_fingerprint")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    status: str
    model_fingerprint: str
    def __init__(self, status: _Optional[str] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class AgentSpec(_message.Message):
    __slots__ = ("name", "prefix")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    name: str
    prefix: str
    def __init__(self, name: _Optional[str] = ..., prefix: _Optional[str] = ...) -> None: ...

class AgentsRequest(_message.Message):
    __slots__ = ("session_id", "user_text", "agents", "rounds", "kvcomm", "peer_join", "reply_header", "sampling")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    USER_TEXT_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    KVCOMM_FIELD_NUMBER: _ClassVar[int]
    PEER_JOIN_FIELD_NUMBER: _ClassVar[int]
    REPLY_HEADER_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    user_text: str
    agents: _containers.RepeatedCompositeFieldContainer[AgentSpec]
    rounds: int
    kvcomm: bool
    peer_join: str
    reply_header: str
    sampling: Sampling
    def __init__(self, session_id: _Optional[str] = ..., user_text: _Optional[str] = ..., agents: _Optional[_Iterable[_Union[AgentSpec, _Mapping]]] = ..., rounds: _Optional[int] = ..., kvcomm: _Optional[bool] = ..., peer_join: _Optional[str] = ..., reply_header: _Optional[str] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ...) -> None: ...

class PlaceholderReport(_message.Message):
    __slots__ = ("name", "tokens", "reused", "anchor_ids", "anchor_weights", "new_anchor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSED_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_IDS_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    NEW_ANCHOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    tokens: int
    reused: bool
    anchor_ids: _containers.RepeatedScalarFieldContainer[int]
    anchor_weights: _containers.RepeatedScalarFieldContainer[float]
    new_anchor: bool
    def __init__(self, name: _Optional[str] = ..., tokens: _Optional[int] = ..., reused: _Optional[bool] = ..., anchor_ids: _Optional[_Iterable[int]] = ..., anchor_weights: _Optional[_Iterable[float]] = ..., new_anchor: _Optional[bool] = ...) -> None: ...

class AgentReport(_message.Message):
    __slots__ = ("round", "agent", "reused", "placeholders", "prepare_ms")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    REUSED_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDERS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_MS_FIELD_NUMBER: _ClassVar[int]
    round: int
    agent: int
    reused: bool
    placeholders: _containers.RepeatedCompositeFieldContainer[PlaceholderReport]
    prepare_ms: float
    def __init__(self, round: _Optional[int] = ..., agent: _Optional[int] = ..., reused: _Optional[bool] = ..., placeholders: _Optional[_Iterable[_Union[PlaceholderReport, _Mapping]]] = ..., prepare_ms: _Optional[float] = ...) -> None: ...

class AgentToken(_message.Message):
    __slots__ = ("round", "agent", "token")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    round: int
    agent: int
    token: TokenEvent
    def __init__(self, round: _Optional[int] = ..., agent: _Optional[int] = ..., token: _Optional[_Union[TokenEvent, _Mapping]] = ...) -> None: ...

class AgentsDone(_message.Message):
    __slots__ = ("session_id", "replies", "reused", "prompts")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    REUSED_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    replies: _containers.RepeatedScalarFieldContainer[str]
    reused: int
    prompts: int
    def __init__(self, session_id: _Optional[str] = ..., replies: _Optional[_Iterable[str]] = ..., reused: _Optional[int] = ..., prompts: _Optional[int] = ...) -> None: ...

class AgentsEvent(_message.Message):
    __slots__ = ("report", "token", "done")
    REPORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    report: AgentReport
    token: AgentToken
    done: AgentsDone
    def __init__(self, report: _Optional[_Union[AgentReport, _Mapping]] = ..., token: _Optional[_Union[AgentToken, _Mapping]] = ..., done: _Optional[_Union[AgentsDone, _Mapping]] = ...) -> None: ...

class GraphParent(_message.Message):
    __slots__ = ("node", "message_id", "offset", "leak")
    NODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LEAK_FIELD_NUMBER: _ClassVar[int]
    node: str
    message_id: str
    offset: int
    leak: bool
    def __init__(self, node: _Optional[str] = ..., message_id: _Optional[str] = ..., offset: _Optional[int] = ..., leak: _Optional[bool] = ...) -> None: ...

class GraphNode(_message.Message):
    __slots__ = ("name", "prompt", "role", "parents", "decode", "sampling", "output", "private", "staircase", "messages", "reply_role")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PRIVATE_FIELD_NUMBER: _ClassVar[int]
    STAIRCASE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    REPLY_ROLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    prompt: str
    role: str
    parents: _containers.RepeatedCompositeFieldContainer[GraphParent]
    decode: bool
    sampling: Sampling
    output: str
    private: bool
    staircase: bool
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    reply_role: str
    def __init__(self, name: _Optional[str] = ..., prompt: _Optional[str] = ..., role: _Optional[str] = ..., parents: _Optional[_Iterable[_Union[GraphParent, _Mapping]]] = ..., decode: _Optional[bool] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., output: _Optional[str] = ..., private: _Optional[bool] = ..., staircase: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., reply_role: _Optional[str] = ...) -> None: ...

class StaircaseOptions(_message.Message):
    __slots__ = ("proposer_chunks", "aggregator_chunks", "redundancy", "variant")
    PROPOSER_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    REDUNDANCY_FIELD_NUMBER: _ClassVar[int]
    VARIANT_FIELD_NUMBER: _ClassVar[int]
    proposer_chunks: _containers.RepeatedScalarFieldContainer[int]
    aggregator_chunks: _containers.RepeatedScalarFieldContainer[int]
    redundancy: int
    variant: str
    def __init__(self, proposer_chunks: _Optional[_Iterable[int]] = ..., aggregator_chunks: _Optional[_Iterable[int]] = ..., redundancy: _Optional[int] = ..., variant: _Optional[str] = ...) -> None: ...

class GraphRequest(_message.Message):
    __slots__ = ("session_id", "nodes", "staircase", "calibrated", "base_turns")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    STAIRCASE_FIELD_NUMBER: _ClassVar[int]
    CALIBRATED_FIELD_NUMBER: _ClassVar[int]
    BASE_TURNS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    nodes: _containers.RepeatedCompositeFieldContainer[GraphNode]
    staircase: StaircaseOptions
    calibrated: bool
    base_turns: bool
    def __init__(self, session_id: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[GraphNode, _Mapping]]] = ..., staircase: _Optional[_Union[StaircaseOptions, _Mapping]] = ..., calibrated: _Optional[bool] = ..., base_turns: _Optional[bool] = ...) -> None: ...

class GraphToken(_message.Message):
    __slots__ = ("node", "token_id", "text", "finish_reason")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    node: str
    token_id: int
    text: str
    finish_reason: str
    def __init__(self, node: _Optional[str] = ..., token_id: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class GraphNodeDone(_message.Message):
    __slots__ = ("node", "message_id", "text", "reencoded", "replica")
    NODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    REENCODED_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    node: str
    message_id: str
    text: str
    reencoded: _containers.RepeatedScalarFieldContainer[str]
    replica: str
    def __init__(self, node: _Optional[str] = ..., message_id: _Optional[str] = ..., text: _Optional[str] = ..., reencoded: _Optional[_Iterable[str]] = ..., replica: _Optional[str] = ...) -> None: ...

class GraphDone(_message.Message):
    __slots__ = ("session_id", "seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    seconds: float
    def __init__(self, session_id: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class GraphChunk(_message.Message):
    __slots__ = ("parent", "start", "end")
    PARENT_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    parent: str
    start: int
    end: int
    def __init__(self, parent: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class GraphRound(_message.Message):
    __slots__ = ("node", "round", "chunks")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    node: str
    round: int
    chunks: _containers.RepeatedCompositeFieldContainer[GraphChunk]
    def __init__(self, node: _Optional[str] = ..., round: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[GraphChunk, _Mapping]]] = ...) -> None: ...

class GraphEvent(_message.Message):
    __slots__ = ("token", "node_done", "done", "round")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    NODE_DONE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    token: GraphToken
    node_done: GraphNodeDone
    done: GraphDone
    round: GraphRound
    def __init__(self, token: _Optional[_Union[GraphToken, _Mapping]] = ..., node_done: _Optional[_Union[GraphNodeDone, _Mapping]] = ..., done: _Optional[_Union[GraphDone, _Mapping]] = ..., round: _Optional[_Union[GraphRound, _Mapping]] = ...) -> None: ...
