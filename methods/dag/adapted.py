"""A calibrated graph's adapted nodes: nodes shaped as a synthesis read their replies through the engine's
calibration, and turns decode with its turn LoRA. Their outputs are encoded again with base weights, so any reader
may take them.

Calibrated reading. With `calibrated`, a node shaped as a synthesis (its decoding parents, all cached, after the
parents it reads whole; not streamed by a staircase) reads those replies as the served cache path does, through
the engine's calibration: the mapper on their KV, the boundary refresh, and the synthesizer LoRA in its own
forwards (Parallel-Synthesis).

Turns. When the calibration has a turn LoRA (braid.train.turns, Prompt Choreography's fine-tuning of the agents),
a calibrated graph's turns also run with it: a turn is a decoding node that reads another decoding node's reply but
is not shaped as a synthesis (a debater speaking after earlier replies, then its own notes). Its parents are read
as usual (cached); the LoRA is on in its own forwards only.
"""

from collections.abc import Generator, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from braid.engine.engine import DecodeStream, Engine
from braid.methods.calibration import served_refresh
from braid.methods.dag.events import NodeDone, NodeToken
from braid.methods.dag.graph import Graph, Node
from braid.methods.synthesis import SynthesisMode, synthesis_stream

if TYPE_CHECKING:
    from braid.methods.dag.run import DagRun


def adaptable(graph: Graph, engine: Engine, n: Node) -> bool:
    """Whether node n may run with the calibration's LoRAs: the graph asks for calibrated reading, the engine
    has a calibration, and n decodes its own tokens (neither a staircase node nor one a staircase streams:
    those come from the wave's own decode) after at least one other node's reply, all read as cached KV."""
    replies = graph.replies(n)
    return graph.calibrated and engine.calibration is not None and n.sampling is not None \
        and not n.staircase and not any(n.name in graph.streamed(s) for s in graph.nodes) \
        and bool(replies) and all(graph.node(e.node).output == "kv" for e in replies)


def calibrated(graph: Graph, engine: Engine, n: Node) -> bool:
    """Whether node n reads its replies through the engine's calibration: adaptable, and shaped as a synthesis
    (its replies last, after the parents it reads whole, at unset offsets), the layout the calibration was
    trained on."""
    if not adaptable(graph, engine, n):
        return False
    first = n.parents.index(graph.replies(n)[0])
    return len(graph.replies(n)) == len(n.parents) - first and all(e.offset is None for e in n.parents)


def turn(graph: Graph, engine: Engine, n: Node) -> bool:
    """Whether node n runs with the calibration's turn LoRA: adaptable, not shaped as a synthesis (a debater
    that reads earlier replies, then its own notes: what braid.train.turns trains on), and the graph wants
    the turn LoRA, which the calibration has."""
    attached = engine.calibration
    return graph.turn_lora and attached is not None and attached.turns is not None and adaptable(graph, engine, n) \
        and not calibrated(graph, engine, n)


def run_turns(run: "DagRun", wave: Sequence[Node], start: float) -> Iterator[NodeToken | NodeDone]:
    """The wave's turns, decoded together on the run's engine with the turn LoRA on in their forwards; each
    one's output is then encoded again with base weights (its adapted KV is dropped)."""
    hooks = run.engine.calibration.turns
    stream = run.engine.decode_stream([replace(run.node_call(n), adapter=hooks.adapter) for n in wave])
    answers = yield from _adapted(run, stream, wave, start)
    run.encode_outputs(wave, answers, reread=False)
    for n in wave:
        yield run.states[n.name].done()


def synthesize(run: "DagRun", n: Node, start: float) -> Iterator[NodeToken | NodeDone]:
    """Calibrated node n: its whole parents read as usual (the prefix), its replies read as the served cache
    path reads branches (methods.synthesis); a reply whose encoding saw another role's private node is read
    through a copy re-encoded without it (through the mapper like the rest). The refresh is the one the
    calibration was trained with. Its output is encoded again with base weights."""
    state, reader = run.states[n.name], run.reader
    edges = run.graph.replies(n)
    whole = [e for e in n.parents if e not in edges]
    prefix, state.notes = reader.read(n, whole)
    state.context = prefix
    leaky = [e for e in edges if not e.leak and not reader.clean(run.states[e.node].taint, n.role)]
    branches = [reader.without_private(e.node, n.role).message if e in leaky else run.states[e.node].message
                for e in edges]
    state.notes += [f"{e.node}:private" for e in leaky]
    attached = run.engine.calibration  # (its placement, and the refresh it was trained with)
    mode = SynthesisMode(attached.record.placement, attached.hooks, served_refresh(attached))
    stream = synthesis_stream(run.engine, branches, n.prompt, [i.message for i in prefix], mode, n.sampling)
    [answer] = yield from _adapted(run, stream, [n], start)
    run.encode_outputs([n], [answer])
    yield state.done()


def _adapted(run: "DagRun", stream: DecodeStream, nodes: Sequence[Node], start: float
             ) -> Generator[NodeToken, None, list[list[int]]]:
    """Stream an adapted decode (call c: nodes[c]) as NodeTokens, recording each node's reply; then drop its
    messages (adapted KV: only the tokens are kept, for encode_outputs) and return each call's tokens."""
    tokens: list[list[int]] = [[] for _ in nodes]
    try:
        for ev in stream:
            run.states[nodes[ev.call].name].took(ev.text, start)
            tokens[ev.call].append(ev.token_id)
            yield NodeToken(nodes[ev.call].name, ev.token_id, ev.text, ev.finish_reason)
    finally:
        stream.close()
        run.engine.discard(stream.ids or ())
    return tokens
