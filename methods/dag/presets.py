"""Prompt Choreography's three agent workflows (its section 4), and Mixture-of-Agents, as DAGs (methods.dag).

- MADiter: two debaters speak in turn over a shared history, for some rounds; a moderator then answers.
- MADpar: n identical agents answer in parallel, each round reading every agent's previous answer.
- ToT (depth 1): b solutions in parallel, v voters each reading all of them, then a final answer from the
  winning solution (a second graph, `tot_final`, once the votes are counted).
- MoA (Mixture-of-Agents, the workflow Staircase Streaming speeds up): layers of n proposers, each layer reading
  every answer of the layer before, then one aggregator.

The same three shapes over agents' own notes (`notes_graph`: each solver reads its notes and replies; the
debaters read earlier replies first) are the reference model's workflows (braid.evals.workflows measures
them, braid.train.turns fine-tunes their turns).

With `staircase` (a variant of Staircase Streaming), MADpar's later rounds, ToT's voters and MoA's later layers and
aggregator are staircase nodes: each starts from the first chunks of what it reads instead of waiting for it
whole (methods.dag.streaming). MADiter has none: each turn reads every earlier turn, so its readers do not decode
together.

`output="kv"` is the choreographed workflow (every message read through its cached encoding); `"text"` is
the baseline: every message re-encoded in each reader's context (prefix caching still reuses identical
prompt starts). The presets mark nothing private (debate roles are public, as in Prompt Choreography's
timings); add private nodes for the leakage experiments.
"""

from collections.abc import Sequence

from braid.engine.sampling import SamplingParams
from braid.methods.dag.graph import Edge, Graph, Node
from braid.methods.staircase import Variant

PRESETS = ("mad-iter", "mad-par", "tot", "moa")


def mad_iter(question: str, rounds: int = 3, sampling: SamplingParams = SamplingParams(), output: str = "kv",
             roles: tuple[str, str] = ("affirmative", "negative")) -> Graph:
    nodes = [Node("question", f"Debate topic: {question}\n", output=output)]
    nodes += [Node(f"system:{r}", f"You are the {r} side of a debate. Argue your side.\n", role=r, output=output)
              for r in roles]
    turns: list[str] = []
    for k in range(rounds):
        for r in roles:
            name = f"round{k + 1}:{r}"
            nodes.append(Node(name, f"\n{r}:", role=r, sampling=sampling, output=output,
                              parents=(Edge(f"system:{r}"), Edge("question"), *(Edge(t) for t in turns))))
            turns.append(name)
    nodes.append(Node("moderator", "\nModerator: the better answer is", role="moderator", sampling=sampling,
                      output=output, parents=(Edge("question"), *(Edge(t) for t in turns))))
    return Graph(nodes)


def mad_par(question: str, agents: int = 3, rounds: int = 3, sampling: SamplingParams = SamplingParams(),
            output: str = "kv", staircase: Variant | None = None) -> Graph:
    """With `staircase`, each round after the first reads the previous round's arguments as they are made."""
    nodes = [Node("system", "Answer the question. Read the other agents' answers and improve yours.\n",
                  output=output),
             Node("question", f"Question: {question}\n", output=output)]
    previous: list[str] = []
    for k in range(rounds):
        current = []
        for i in range(agents):
            name = f"round{k + 1}:agent{i}"
            nodes.append(Node(name, f"\nAgent {i}:", role=f"agent{i}", sampling=sampling, output=output,
                              parents=(Edge("system"), Edge("question"), *(Edge(p) for p in previous)),
                              staircase=staircase is not None and k > 0))
            current.append(name)
        previous = current
    return _graph(nodes, staircase)


def tot(problem: str, solutions: int = 8, voters: int = 4, sampling: SamplingParams = SamplingParams(),
        output: str = "kv", staircase: Variant | None = None) -> Graph:
    """With `staircase`, the voters read the solutions as they are written."""
    nodes = [Node("solve", "Think step by step and propose a solution.\n", output=output),
             Node("vote", "Read the candidate solutions and name the best one.\n", output=output),
             Node("problem", f"Problem: {problem}\n", output=output)]
    names = [f"solution{i}" for i in range(solutions)]
    nodes += [Node(s, f"\nSolution {i}:", role=s, sampling=sampling, output=output,
                   parents=(Edge("solve"), Edge("problem"))) for i, s in enumerate(names)]
    nodes += [Node(f"voter{j}", "\nThe best solution is", role=f"voter{j}", sampling=sampling, output=output,
                   parents=(Edge("vote"), Edge("problem"), *(Edge(s) for s in names)), staircase=staircase is not None)
              for j in range(voters)]
    return _graph(nodes, staircase)


def tot_final(solve: str, problem: str, winner: str, sampling: SamplingParams = SamplingParams(),
              output: str = "kv") -> Graph:
    """The final answer from the winning solution: `solve`, `problem` and `winner` are the first graph's
    output message ids (session messages now)."""
    return Graph([Node("final", "\nFinal answer:", sampling=sampling, output=output,
                       parents=(Edge(message=solve), Edge(message=problem), Edge(message=winner)))])


def moa(question: str, proposers: int = 3, layers: int = 2, sampling: SamplingParams = SamplingParams(),
        output: str = "kv", staircase: Variant | None = None) -> Graph:
    """With `staircase`, every layer after the first, and the aggregator, reads the layer before as it is
    written (nested staircases, as Staircase Streaming's MoA)."""
    nodes = [Node("system", "Answer the question. Use the earlier answers where they help.\n", output=output),
             Node("question", f"Question: {question}\n", output=output)]
    previous: list[str] = []
    for k in range(layers):
        current = [f"layer{k + 1}:proposer{i}" for i in range(proposers)]
        nodes += [Node(name, f"\nProposer {i}:", role=f"proposer{i}", sampling=sampling, output=output,
                       parents=(Edge("system"), Edge("question"), *(Edge(p) for p in previous)),
                       staircase=staircase is not None and k > 0)
                  for i, name in enumerate(current)]
        previous = current
    nodes.append(Node("aggregator", "\nAggregated answer:", role="aggregator", sampling=sampling, output=output,
                      parents=(Edge("system"), Edge("question"), *(Edge(p) for p in previous)),
                      staircase=staircase is not None))
    return _graph(nodes, staircase)


NOTES_WORKFLOWS = ("tot", "mad-iter", "mad-par")
NOTES_STREAMING = ("tot", "mad-par")  # whose final node reads replies that decode together: a staircase applies


def notes_graph(workflow: str, system: str, notes: Sequence[str], header: str, prompt: str,
                solver: SamplingParams = SamplingParams(max_tokens=48),
                final: SamplingParams = SamplingParams(max_tokens=64), output: str = "kv",
                staircase: bool = False, calibrated: bool = False, turn_lora: bool = True) -> Graph:
    """Solvers over their own notes as one of NOTES_WORKFLOWS; every text is a whole rendered message (the
    replies' `header` opens theirs), solver j is role "solver<j>" and the last node, "final", answers `prompt`.

    - tot: each solver reads its notes and replies; the final node reads every solution;
    - mad-iter: solver j speaks after every earlier turn (then its notes); the final node reads every turn;
    - mad-par: two rounds of parallel solvers, the second reading every first-round answer (then its notes);
      the final node reads the second round.
    `output` is how replies are read ("kv": cached, "text": re-encoded, the baseline); `staircase` makes the
    final node stream its replies (tot, mad-par); `calibrated` and `turn_lora` are the Graph's options."""
    if workflow not in NOTES_WORKFLOWS:
        raise ValueError(f"workflow {workflow!r} is not one of {', '.join(NOTES_WORKFLOWS)}")
    if staircase and workflow not in NOTES_STREAMING:
        raise ValueError(f"{workflow}'s final node reads turns that never decode together: no staircase")

    def speak(j: int, name: str, before: tuple[Edge, ...] = ()) -> list[Node]:
        return [Node(f"{name}:notes", notes[j], role=f"solver{j}", parents=(Edge("system"), *before)),
                Node(name, header, role=f"solver{j}", sampling=solver, output=output,
                     parents=(Edge("system"), *before, Edge(f"{name}:notes")))]

    m = len(notes)
    nodes = [Node("system", system)]
    if workflow == "tot":
        replies = [f"solution{j}" for j in range(m)]
        nodes += [n for j in range(m) for n in speak(j, replies[j])]
    elif workflow == "mad-iter":
        replies = [f"turn{j}" for j in range(m)]
        for j in range(m):
            nodes += speak(j, replies[j], tuple(Edge(r) for r in replies[:j]))
    else:
        first, replies = [f"round1:{j}" for j in range(m)], [f"round2:{j}" for j in range(m)]
        nodes += [n for j in range(m) for n in speak(j, first[j])]
        nodes += [n for j in range(m) for n in speak(j, replies[j], tuple(Edge(r) for r in first))]
    reader = {"tot": "voter", "mad-iter": "moderator", "mad-par": "aggregator"}[workflow]
    nodes.append(Node("final", prompt, role=reader, sampling=final, staircase=staircase,
                      parents=(Edge("system"), *(Edge(r) for r in replies))))
    return Graph(nodes, calibrated=calibrated, turn_lora=turn_lora)


def solver(n: Node) -> int | None:
    """The solver a notes_graph node belongs to (role "solver<j>": j), None for the others."""
    return int(n.role.removeprefix("solver")) if n.role.startswith("solver") else None


def notes_turns(graph: Graph) -> list[Node]:
    """A notes_graph's turns: the solvers' replies that read other replies (where a turn LoRA runs)."""
    return [n for n in graph.nodes if n.sampling is not None and solver(n) is not None and graph.replies(n)]


def _graph(nodes: list[Node], staircase: Variant | None) -> Graph:
    return Graph(nodes) if staircase is None else Graph(nodes, variant=staircase)


def count_votes(votes: list[str], solutions: int) -> int:
    """The solution most voters named ("... solution 3 ..." or a bare number); ties and no votes: the lowest."""
    tally = [0] * solutions
    for text in votes:
        for word in text.replace(".", " ").replace(",", " ").split():
            if word.isdigit() and int(word) < solutions:
                tally[int(word)] += 1
                break
    return max(range(solutions), key=lambda i: (tally[i], -i))
