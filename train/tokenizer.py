"""The reference model's tokenizer: byte-level BPE trained on rendered workflow traces.

Words and numbers carry their leading space, so each reads as the same token
wherever it appears; every chat-template token is atomic.
"""

import re
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from braid.models.chat import CHAT_TEMPLATE, END, PAD, SPECIAL_TOKENS


_SPECIAL = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Texts may hold chat-template tokens: the trainer sees the text between them, as encoding will."""
    tok = Tokenizer(models.BPE())
    # every word carries its leading space, also right after a role token, so a name or
    # a number is the same single token in every message: copying it is one lookup
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((p for t in texts for p in _SPECIAL.split(t) if p), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END, pad_token=PAD,
                                   additional_special_tokens=SPECIAL_TOKENS[2:])
    fast.chat_template = CHAT_TEMPLATE
    return fast
