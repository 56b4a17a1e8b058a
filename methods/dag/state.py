"""What a DAG run keeps of each node: the context it read, its output message and what that encoding saw, and how
its reply went. One object per node, so that what is known of a node is found in one place."""

import time
from dataclasses import dataclass, field

from braid.engine.errors import UnknownMessageError
from braid.methods.dag.events import NodeDone
from braid.methods.dag.graph import Node


@dataclass(frozen=True)
class Item:
    """One message in a node's context, as the node read it: its id, offset, and the private nodes its
    encoding attended to (`taint`)."""

    message: str
    offset: int
    taint: frozenset[str]
    source: str = ""  # the node it is (a version of), "" for a session message or a re-encoded run


@dataclass
class NodeState:
    """One node of a run, from its parents read to its output stored."""

    node: Node
    context: list[Item] = field(default_factory=list)  # what it read, in order
    notes: list[str] = field(default_factory=list)  # the parents it read through a re-encoded copy (NodeDone's)
    message: str | None = None  # its output message (prompt + reply), once stored
    taint: frozenset[str] = frozenset()  # the private nodes that output's encoding attended to (set with it)
    reply: list[str] = field(default_factory=list)  # its reply's text, piece by piece as decoded
    ttft: float | None = None  # seconds from its wave's start (its parents read, its prompt encoded) to its first token
    replica: str = ""  # where it was decoded, when not on the run's own engine
    visible: dict[str, Item] = field(default_factory=dict)  # role -> its output re-encoded without what the role
    # may not see (made once, for every reader of that role)

    def took(self, text: str, start: float) -> None:
        """One more token of its reply; the first sets its TTFT, counted from `start`, its wave's start."""
        if not self.reply:
            self.ttft = time.perf_counter() - start
        self.reply.append(text)

    def done(self) -> NodeDone:
        """The event that says it ended: its output message, its reply, how it read its parents."""
        if self.message is None:  # (its call ended, but the store lost the output before the run held it)
            raise UnknownMessageError(f"node {self.node.name!r} has no output message")
        return NodeDone(self.node.name, self.message, "".join(self.reply), self.notes, self.replica)
