"""A message's KV as a stream of checksummed chunks, and its reassembly.

The gRPC and collective transports move the same KVChunk units, so size limits,
integrity and fingerprints are checked in one place, once per chunk where it is received. Chunks split the
token axis (all layers per chunk) and fall back to splitting layers when a single
token's KV is larger than the limit.
"""

import zlib

import torch

from braid.engine.config import DTYPES
from braid.engine.errors import BraidError, FingerprintMismatchError
from braid.kv.connector import chain_digest
from braid.protos.kv_pb2 import KVChunk

DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class ChunkError(BraidError):
    code = "DATA_LOSS"


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def iter_pieces(kv: torch.Tensor, max_bytes: int):
    """(layer_start, layer_end, token_start, token_end, piece) covering kv [L, 2, H, T, D], pieces <= max_bytes."""
    layers, _, heads, tokens, head_dim = kv.shape
    token_bytes = layers * 2 * heads * head_dim * kv.element_size()
    per_chunk = max(1, max_bytes // token_bytes)
    layer_step = layers if token_bytes <= max_bytes else max(1, max_bytes // (token_bytes // layers))
    for t0 in range(0, tokens, per_chunk):
        t1 = min(tokens, t0 + per_chunk)
        for l0 in range(0, layers, layer_step):
            l1 = min(layers, l0 + layer_step)
            yield l0, l1, t0, t1, kv[l0:l1, :, :, t0:t1].contiguous()


def iter_chunks(message_id: str, fingerprint: str, kv: torch.Tensor, max_bytes: int = 1 << 20,
                token_start: int = 0, total_tokens: int = 0, token_ids=(), offset: int = 0,
                stream_id: str = "", link_id: str = ""):
    """(KVChunk, piece) pairs for kv [L, 2, H, T, D] (tokens token_start.. of the message).

    total_tokens is the message's full length when known (0 while it is still decoding);
    token_ids, if given, are the tokens of this range. With a link_id the chunk carries no
    data: the piece travels on that collective link, and the CRC-32 covers it all the same.
    """
    for l0, l1, t0, t1, piece in iter_pieces(kv, max_bytes):
        data = tensor_bytes(piece)
        yield KVChunk(message_id=message_id, fingerprint=fingerprint, layer_start=l0, layer_end=l1,
                      token_start=token_start + t0, token_end=token_start + t1, dtype=DTYPE_NAMES[kv.dtype],
                      shape=list(piece.shape), data=b"" if link_id else data, crc32=zlib.crc32(data),
                      total_layers=kv.shape[0], total_tokens=total_tokens, stream_id=stream_id, offset=offset,
                      token_ids=list(token_ids[t0:t1]) if l0 == 0 else [], link_id=link_id), piece


class KVAssembler:
    """Collects one message's chunks, in any order; `tensor()` once `complete`."""

    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint
        self.message_id: str | None = None
        self.total_tokens = 0
        self.offset = 0
        self.bytes_received = 0
        self.digest = 0  # over the chunks' CRC-32s, in arrival order (see braid.kv.connector)
        self._tokens: dict[int, list[int]] = {}  # token_start -> ids
        self._pieces: dict[tuple[int, int], list[tuple[int, int, torch.Tensor]]] = {}  # token range -> layers
        self._layers = 0

    def add(self, chunk: KVChunk, piece: torch.Tensor | None = None) -> None:
        """A chunk, with its payload in `chunk.data` or, from a collective link, as `piece`."""
        if chunk.fingerprint != self.fingerprint:
            raise FingerprintMismatchError(f"KV chunk of message {chunk.message_id!r} was encoded by model "
                                           f"{chunk.fingerprint}, this engine runs {self.fingerprint}")
        if self.message_id is None:
            self.message_id = chunk.message_id
        elif chunk.message_id != self.message_id:
            raise ChunkError(f"chunk of message {chunk.message_id!r} sent into the stream of {self.message_id!r}")
        data = chunk.data if piece is None else tensor_bytes(piece)
        if zlib.crc32(data) != chunk.crc32:
            raise ChunkError(f"checksum mismatch in KV chunk of {chunk.message_id!r}, tokens "
                             f"{chunk.token_start}-{chunk.token_end}, layers {chunk.layer_start}-{chunk.layer_end}")
        if chunk.dtype not in DTYPES:
            raise ChunkError(f"unknown KV dtype {chunk.dtype!r}")
        if piece is None:
            piece = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(DTYPES[chunk.dtype])
            piece = piece.reshape(tuple(chunk.shape))
        self._pieces.setdefault((chunk.token_start, chunk.token_end), []).append(
            (chunk.layer_start, chunk.layer_end, piece))
        self._layers = chunk.total_layers
        self.total_tokens = max(self.total_tokens, chunk.total_tokens)
        self.offset = chunk.offset
        if chunk.token_ids:
            self._tokens[chunk.token_start] = list(chunk.token_ids)
        self.bytes_received += len(data)
        self.digest = chain_digest(self.digest, chunk.crc32)

    @property
    def tokens_received(self) -> int:
        return sum(t1 - t0 for (t0, t1), parts in self._pieces.items()
                   if sum(l1 - l0 for l0, l1, _ in parts) == self._layers)

    @property
    def complete(self) -> bool:
        return self.total_tokens > 0 and self.tokens_received == self.total_tokens

    def token_ids(self) -> list[int]:
        return [t for start in sorted(self._tokens) for t in self._tokens[start]]

    def _whole(self) -> list[tuple[int, int]]:
        """Token ranges received whole (every layer, and their token ids), in order from the message's start up
        to the first gap."""
        ranges, at = [], 0
        for t0, t1 in sorted(self._pieces):
            if t0 != at or t0 not in self._tokens or \
                    sum(l1 - l0 for l0, l1, _ in self._pieces[(t0, t1)]) != self._layers:
                break
            ranges.append((t0, t1))
            at = t1
        return ranges

    @property
    def contiguous(self) -> int:
        """Tokens that can be read while the message is still arriving: whole from its start (the staircase's
        synthesizer reads them)."""
        ranges = self._whole()
        return ranges[-1][1] if ranges else 0

    def read(self, start: int, end: int) -> tuple[list[int], torch.Tensor]:
        """Tokens [start, end) of the message and their KV [L, 2, H, end - start, D], within `contiguous`."""
        if not 0 <= start <= end <= self.contiguous:
            raise ChunkError(f"tokens {start}-{end} of {self.message_id!r} have not arrived "
                             f"({self.contiguous} have, from its start)")
        tokens, blocks = [], []
        for t0, t1 in self._whole():
            if t1 <= start or t0 >= end:
                continue
            a, b = max(start, t0) - t0, min(end, t1) - t0
            tokens += self._tokens[t0][a:b]
            parts = sorted(self._pieces[(t0, t1)], key=lambda x: x[0])
            blocks.append(torch.cat([p for _, _, p in parts], dim=0)[:, :, :, a:b])
        return tokens, torch.cat(blocks, dim=3) if blocks else torch.empty(0)

    def tensor(self) -> torch.Tensor:
        """The message's KV [L, 2, H, T, D], bit-identical to what was sent."""
        if not self.complete:
            raise ChunkError(f"KV of {self.message_id!r} incomplete: {self.tokens_received} of "
                             f"{self.total_tokens or '?'} tokens received")
        blocks = []
        for (t0, _), parts in sorted(self._pieces.items()):
            blocks.append(torch.cat([p for _, _, p in sorted(parts, key=lambda x: x[0])], dim=0))
        return torch.cat(blocks, dim=3)
