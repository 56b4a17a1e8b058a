"""What a DAG run yields as it goes: each reply's tokens, each staircase node's rounds, and each node's end."""

from dataclasses import dataclass


@dataclass
class NodeToken:
    """One token of a decoding node's reply."""

    node: str
    token_id: int
    text: str
    finish_reason: str | None


@dataclass
class NodeRound:
    """A staircase node's round: the token range [start, end) of each parent's message it took in before its
    next answer chunk."""
    node: str
    round: int
    chunks: dict[str, tuple[int, int]]


@dataclass
class NodeDone:
    """A node's end, once its output is stored."""

    node: str
    message_id: str  # its output message: prompt + reply
    text: str  # the reply ("" for a node without sampling)
    reencoded: list[str]  # parents it read through a re-encoded copy ("name:text" or "name:private")
    replica: str = ""  # where it was decoded, when not on the run's own engine (a Worker replica)
