from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVChunk(_message.Message):
    __slots__ = ("message_id", "fingerprint", "layer_start", "layer_end", "token_start", "token_end", "dtype", "shape", "data", "crc32", "total_layers", "total_tokens", "stream_id", "token_ids", "offset", "link_id", "open", "parents", "parent_offsets", "stream_digest", "stream_bytes")
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    PARENT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    STREAM_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STREAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    message_id: str
    fingerprint: str
    layer_start: int
    layer_end: int
    token_start: int
    token_end: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    crc32: int
    total_layers: int
    total_tokens: int
    stream_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    link_id: str
    open: bool
    parents: _containers.RepeatedScalarFieldContainer[str]
    parent_offsets: _containers.RepeatedScalarFieldContainer[int]
    stream_digest: int
    stream_bytes: int
    def __init__(self, message_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., total_layers: _Optional[int] = ..., total_tokens: _Optional[int] = ..., stream_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., link_id: _Optional[str] = ..., open: _Optional[bool] = ..., parents: _Optional[_Iterable[str]] = ..., parent_offsets: _Optional[_Iterable[int]] = ..., stream_digest: _Optional[int] = ..., stream_bytes: _Optional[int] = ...) -> None: ...

class AbandonRequest(_message.Message):
    __slots__ = ("stream_ids", "reason")
    STREAM_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    stream_ids: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, stream_ids: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class LinkRequest(_message.Message):
    __slots__ = ("link_id", "backend")
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    link_id: str
    backend: str
    def __init__(self, link_id: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class LinkInfo(_message.Message):
    __slots__ = ("host", "port")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("session_id", "message_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    message_id: str
    def __init__(self, session_id: _Optional[str] = ..., message_id: _Optional[str] = ...) -> None: ...

class FetchAnchorsRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class AnchorsChunk(_message.Message):
    __slots__ = ("payload", "crc32", "total_bytes")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    crc32: int
    total_bytes: int
    def __init__(self, payload: _Optional[bytes] = ..., crc32: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class AdoptRequest(_message.Message):
    __slots__ = ("holder", "holder_address", "messages")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    HOLDER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    holder: str
    holder_address: str
    messages: _containers.RepeatedCompositeFieldContainer[FetchRequest]
    def __init__(self, holder: _Optional[str] = ..., holder_address: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[FetchRequest, _Mapping]]] = ...) -> None: ...

class AdoptReply(_message.Message):
    __slots__ = ("adopted", "skipped")
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    adopted: _containers.RepeatedScalarFieldContainer[str]
    skipped: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adopted: _Optional[_Iterable[str]] = ..., skipped: _Optional[_Iterable[str]] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("bytes", "chunks")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    chunks: int
    def __init__(self, bytes: _Optional[int] = ..., chunks: _Optional[int] = ...) -> None: ...
