"""Incremental detokenization: constant work per token, however long the output grows."""


class Detokenizer:
    """Turns a growing token list into text deltas.

    Decodes only a short window (from a few tokens back), as byte-level BPE needs
    neighbours to merge bytes into characters; a delta is held back while it ends in
    an incomplete character.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.tokens: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # window start
        self._read_offset = 0  # tokens before this are already in self.text

    def add(self, token: int) -> str:
        self.tokens.append(token)
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
