"""Prefix caching across requests: encoded messages found again by the hashes of their token blocks.

vLLM's automatic prefix caching keys each full KV block by a hash chained over every token before it.
Here the unit of KV is a message placed after parent messages, so a message's KV is a function of
(model, its parents' content at their offsets, its own offset, its tokens): `content_seed` hashes all
but the tokens, and `PrefixCache.keys` chains the tokens onto it block by block. A message's
`content_key` (the chain over all its tokens) is what its children's seeds are made of, so the same
text after the same history is found again whatever the message ids were.
"""

import hashlib
from collections.abc import Sequence

from braid.engine.store import Message, MessageStore


def _h(*parts: bytes) -> bytes:
    return hashlib.blake2b(b"\0".join(parts), digest_size=16).digest()


def _tokens(tokens: Sequence[int]) -> bytes:
    return b",".join(str(t).encode() for t in tokens)


def content_seed(fingerprint: str, parents: Sequence[tuple[bytes | None, int]], offset: int) -> bytes | None:
    """What a new message's KV depends on besides its tokens; None if some parent's content is unknown
    (KV imported from another engine: it was encoded in a context this engine never saw)."""
    if any(key is None for key, _ in parents):
        return None
    return _h(fingerprint.encode(), *(key + str(off).encode() for key, off in parents), str(offset).encode())


class PrefixCache:
    """block-chain key -> (id of a message in the store, how many of its first tokens the key covers)."""

    def __init__(self, block_tokens: int = 16):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self._index: dict[bytes, tuple[str, int]] = {}
        self.hits = self.misses = self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._index)

    def keys(self, seed: bytes, tokens: Sequence[int]) -> list[tuple[int, bytes]]:
        """(n, key) for every full block boundary n and for the whole message (n = len(tokens))."""
        out, key, b = [], seed, self.block_tokens
        for n in range(b, len(tokens) + 1, b):
            key = _h(key, _tokens(tokens[n - b:n]))
            out.append((n, key))
        if len(tokens) % b:
            out.append((len(tokens), _h(key, _tokens(tokens[len(tokens) - len(tokens) % b:]), b"end")))
        return out

    def content_key(self, seed: bytes, tokens: Sequence[int]) -> bytes:
        return self.keys(seed, tokens)[-1][1]

    def insert(self, keys: list[tuple[int, bytes]], message: Message) -> None:
        """Index `message` under its `keys(seed, message.token_ids)`."""
        for n, key in keys:
            self._index[key] = (message.id, n)

    def lookup(self, seed: bytes | None, tokens: Sequence[int], limit: int, store: MessageStore
               ) -> tuple[Message, int] | None:
        """The longest cached prefix of `tokens`, of at most `limit` tokens: (a message starting with it, n)."""
        if seed is None or limit < 1:
            return None
        for n, key in reversed(self.keys(seed, tokens)):
            if n > limit:
                continue
            found = self._index.get(key)
            if found is None:
                continue
            mid, covered = found
            msg = store.peek(mid)
            if msg is None or covered != n or msg.token_ids[:n] != tuple(tokens[:n]):
                del self._index[key]  # evicted since (or, never yet seen, a collision)
                continue
            self.hits += 1
            self.reused_tokens += n
            return msg, n
        self.misses += 1
        return None

    def prune(self, store: MessageStore) -> None:
        """Drop entries whose message the store has evicted."""
        self._index = {k: v for k, v in self._index.items() if v[0] in store}
