"""A fully connected agent graph (the KVComm paper's setting): N agents answer the user's text, then, each round,
answer again having read every other agent's previous reply; shared texts go through KVComm or dense prefill.

Agent m's prompt in round r: its role prefix, the user's text (placeholder "user"), then from round 2 each
peer k's last reply (placeholder "reply:<k>"), each introduced by the peer join, then the reply header. The
agents of a round decode together, one engine call with a row each.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field

from braid.engine.engine import DecodeCall, TokenEvent
from braid.engine.errors import BraidError
from braid.engine.sampling import SamplingParams
from braid.methods.kvcomm import AgentPrompt, KVComm, KVCommConfig, Prepared

MAX_AGENTS, MAX_ROUNDS = 8, 4


@dataclass(frozen=True)
class Agent:
    name: str
    prefix: str  # its role: everything before the user's text


@dataclass
class AgentGraph:
    """One request: the agents, the user's text and how each prompt is put together."""

    agents: list[Agent]
    user_text: str
    rounds: int = 1
    kvcomm: bool = True  # reuse the shared texts' KV through anchors; False: dense prefill of every prompt
    peer_join: str = "\n{peer} said: "  # before each peer's reply; "{peer}" is its name
    reply_header: str = "\nAnswer: "  # opens each agent's reply
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self):
        if not 1 <= len(self.agents) <= MAX_AGENTS:
            raise BraidError(f"an agent graph needs 1 to {MAX_AGENTS} agents, got {len(self.agents)}")
        names = [a.name for a in self.agents]
        if any(not n for n in names) or len(set(names)) != len(names):
            raise BraidError(f"agent names must be non-empty and distinct, got {names}")
        for a in self.agents:
            if not a.prefix:
                raise BraidError(f"agent {a.name!r} has an empty prefix; give it its role's text")
        if not self.user_text:
            raise BraidError("user_text is empty")
        if not 1 <= self.rounds <= MAX_ROUNDS:
            raise BraidError(f"rounds must be in 1..{MAX_ROUNDS}, got {self.rounds}")
        if not self.reply_header:
            raise BraidError("reply_header is empty: each agent's reply must open with at least one token")

    def prompt(self, m: int, replies: list[str] | None) -> AgentPrompt:
        """Agent m's prompt, reading `replies` (every agent's previous reply; None in round 1)."""
        agent = self.agents[m]
        slots, joins = [("user", self.user_text)], []
        for k, peer in enumerate(self.agents):
            if replies is not None and k != m:
                joins.append(self.peer_join.replace("{peer}", peer.name))
                slots.append((f"reply:{peer.name}", replies[k] or " "))
        joins.append(self.reply_header)
        # the template differs between round 1 and the rest: each keeps its own offsets
        # every shared text's base is read behind the first agent's prefix (KVComm's module docstring)
        return AgentPrompt(agent.name if replies is None else f"{agent.name}+peers", agent.prefix, slots, joins,
                           self.sampling, base_prefix=self.agents[0].prefix)


@dataclass(frozen=True)
class AgentStarted:
    round: int
    agent: int
    prepared: Prepared


@dataclass(frozen=True)
class AgentToken:
    round: int
    agent: int
    event: TokenEvent


def run_agent_graph(comm: KVComm, graph: AgentGraph, scope: str) -> Iterator[AgentStarted | AgentToken]:
    """Yield each agent's AgentStarted (reused or prefilled, matched anchors), then its tokens, round by round;
    returns the last round's replies. Every message it made is freed by the time it returns."""
    eng, replies = comm.engine, None
    dense = comm if graph.kvcomm else KVComm(eng, KVCommConfig(gamma=0.0))  # (dense: the pools untouched)
    for r in range(graph.rounds):
        preps: list[Prepared] = []
        try:
            for m in range(len(graph.agents)):
                preps.append(dense.prepare(graph.prompt(m, replies), scope))
                yield AgentStarted(r, m, preps[-1])
            stream = eng.decode_stream([DecodeCall(p.header, parents=p.parents, sampling=graph.sampling)
                                        for p in preps])
            texts = [""] * len(preps)
            try:
                for event in stream:
                    texts[event.call] += event.text
                    yield AgentToken(r, event.call, event)
            finally:
                stream.close()
            for mid in stream.ids or []:
                eng.free(mid, when_unpinned=True)
        finally:
            for p in preps:
                dense.free(p)
        replies = texts
    return replies
