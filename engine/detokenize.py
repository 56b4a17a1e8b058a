"""Incremental detokenization: constant work per token, however long the output grows."""

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - tokenizers before 0.21
    DecodeStream = None


def streams(tokenizer) -> bool:
    """Whether `tokenizer` can decode token by token in tokenizers' own DecodeStream (one call into Rust a token)
    and give what its `decode` gives: a fast tokenizer that does not clean up spaces after decoding."""
    return (DecodeStream is not None and getattr(tokenizer, "backend_tokenizer", None) is not None
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False))


class Detokenizer:
    """Turns a growing token list into text deltas.

    A fast tokenizer steps tokenizers' DecodeStream. Any other decodes a short window (from a few tokens
    back), as byte-level BPE needs neighbours to merge bytes into characters. Either way a delta is held
    back while it ends in an incomplete character. `tokenizer` may offer `decode_step(stream, token)`, the
    step under its own lock (engine._SharedTokenizer).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), stream: bool = True):
        self.tokenizer = tokenizer
        self.stop = stop
        self.tokens: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # window start
        self._read_offset = 0  # tokens before this are already in self.text
        self._stream = DecodeStream(skip_special_tokens=False) if stream and streams(tokenizer) else None
        self._step = getattr(tokenizer, "decode_step", None) or (
            lambda s, token: s.step(tokenizer.backend_tokenizer, token))

    def add(self, token: int) -> str:
        self.tokens.append(token)
        if self._stream is not None:
            delta = self._step(self._stream, token)
            if delta is None:  # (an incomplete character: held back)
                return ""
            self._read_offset = len(self.tokens)
            self.text += delta
            return delta
        window = self.tokens[self._prefix_offset:]
        prefix_text = self.tokenizer.decode(self.tokens[self._prefix_offset:self._read_offset])
        new_text = self.tokenizer.decode(window)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.tokens)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever is still held back, at the end of the stream."""
        rest = self.tokenizer.decode(self.tokens[self._read_offset:]) if self._read_offset < len(self.tokens) else ""
        self._read_offset = len(self.tokens)
        self.text += rest
        return rest

    def hit_stop(self, delta: str) -> bool:
        """Did the text that `delta` just completed contain a stop string?"""
        return any(s in self.text[-(len(s) + len(delta)):] for s in self.stop) if delta else False
