"""Seeded synthetic multi-agent tasks, each scored by exact match.

A task is a workflow: a shared system prompt (the branch point), one branch per
worker (its own context, of its own length, and the reply the worker should
write), and a synthesizer question whose answer needs the branches together.
They cover Parallel-Synthesis's three scenarios and Prompt Choreography's
MultiQA:

- chain (distinct sub-tasks): each worker looks up one fact in its own records;
  the answer chains a person's city from one branch with that city's country
  from another.
- vote (candidates of varying reliability): every worker proposes an answer with
  a confidence; the answer is the most confident one.
- trail (trajectories of different lengths): each worker retraces its own
  search, of its own length; one of them found the key, the answer is where.
- multiqa: each branch is a separately encoded question (a labelled sum of two
  digits); the answer must answer all of them.

Answers name what they combine ("uma lives in lima; lima is in qatar", "ray 2
plus 7 is 9, ..."), so each step is one lookup a small model can learn; scoring
is exact match on the whole answer (MultiQA's labelled parts in any order).

`lookup_drill` is training data only: a chain worker's lookup over any names.

`generate(name, seed, num_branches, length)` is a pure function of its arguments:
the same seed gives the same task on any machine. `length` is the (min, max) size
of each branch's work, drawn per branch, so branches differ in length.
"""

import random
from collections.abc import Callable
from dataclasses import dataclass

from braid.models.chat import END, ChatRenderer, header, turn

PEOPLE = ["ann", "bob", "cal", "dan", "eve", "fay", "gus", "hal", "ivy", "jon", "kim", "lee", "max", "ned",
          "ola", "pam", "ray", "sue", "tom", "uma", "vic", "wes", "yan", "zoe"]
CITIES = ["rome", "oslo", "lima", "kyiv", "riga", "bern", "doha", "baku", "suva", "apia", "nuuk", "lome",
          "quito", "sofia", "tunis", "hanoi", "dakar", "minsk", "cairo", "seoul"]
COUNTRIES = ["peru", "chad", "fiji", "iran", "laos", "mali", "oman", "togo", "cuba", "niger", "nepal", "spain",
             "japan", "kenya", "ghana", "chile", "italy", "egypt", "yemen", "qatar"]
WORDS = ["the", "plan", "looks", "fine", "but", "check", "again", "maybe", "step", "two", "fails", "so", "try",
         "another", "path", "then", "verify", "result", "it", "holds", "we", "think", "this", "is", "right"]
NAMES = PEOPLE + CITIES + COUNTRIES
MAX_BRANCHES = 12
DEFAULT_LENGTH = (2, 6)


@dataclass(frozen=True)
class Branch:
    context: str  # the worker's own user turn, after the shared system prompt
    output: str | None  # the reply the worker should write; None: the branch is the user turn itself (MultiQA)

    def message(self) -> str:
        """What the synthesizer sees of this branch."""
        return turn("user", self.context) if self.output is None else turn("worker", self.output)


@dataclass(frozen=True)
class Task:
    name: str
    seed: int
    system: str
    branches: tuple[Branch, ...]
    question: str
    answer: str

    @property
    def has_workers(self) -> bool:
        return self.branches[0].output is not None

    def prompt(self) -> str:
        """The synthesizer's own turn after the branches, up to where it starts answering."""
        return turn("user", self.question) + header("synthesizer")

    def workflow_texts(self, renderer: ChatRenderer | None = None) -> tuple[str, list[str], str, str]:
        """The task as an agent workflow's messages (methods.dag.presets.notes_graph), as they are encoded: the system
        turn, each solver's notes after it, the header its reply follows, and the final node's prompt (which opens
        the answer). In the reference role tokens, or (`renderer`: models.chat.task_renderer) rendered by a model's
        own template from the task's chat messages, as RunWorkflow renders a workflow sent as chat messages. A
        worker's reply, and the answer, end with the model's end-of-turn token."""
        if renderer is None:
            return (turn("system", self.system), [turn("user", b.context) for b in self.branches], header("worker"),
                    self.prompt())
        task, prompts, synthesis, opens = renderer.workflow(
            [{"role": "system", "content": self.system}],
            [[{"role": "user", "content": b.context}] for b in self.branches],
            [{"role": "user", "content": self.question}])
        return task, prompts, opens, synthesis

    def answer_apart(self) -> str:
        """The answer as a synthesizer that reads the branches encoded apart, all at one position, can write it:
        it cannot see their order, so where the parts' order does not count (MultiQA's labelled sums) they come in
        an order of their own (sorted); other answers are as they are."""
        return ", ".join(_NORMALIZE[self.name](self.answer)) if self.name in _NORMALIZE else self.answer

    def correct(self, prediction: str) -> bool:
        return _NORMALIZE.get(self.name, strip_reply)(prediction) == _NORMALIZE.get(self.name, strip_reply)(self.answer)


def strip_reply(text: str) -> str:
    """A reply as its words: without the end token and the spaces around."""
    return text.removesuffix(END).strip()


def _answer_set(text: str) -> tuple[str, ...]:
    # MultiQA answers are labelled, so in any order they are the same answer: with
    # the questions overlapping at one position there is no "first" question.
    return tuple(sorted(part.strip() for part in strip_reply(text).split(",")))


_NORMALIZE: dict[str, Callable[[str], object]] = {"multiqa": _answer_set}


def _lengths(rng: random.Random, m: int, length: tuple[int, int]) -> list[int]:
    return [rng.randint(*length) for _ in range(m)]


CHAIN_SYSTEM = "workers look up records. the synthesizer chains their facts."


def _lookup(kind: str, key: str, records: list[tuple[str, str]]) -> Branch:
    """A chain worker's turn: find `key` in its records and say its value ("who": lives in, "where": is in)."""
    table = "; ".join(f"{k} {v}" for k, v in records)
    value = dict(records)[key]
    said = f"{key} lives in {value}" if kind == "who" else f"{key} is in {value}"
    return Branch(f"records: {table}. {kind}: {key}", said)


def _chain(rng: random.Random, m: int, length: tuple[int, int]):
    if m < 2:
        raise ValueError("chain needs at least 2 branches: one with the person, one with the city")
    people = rng.sample(PEOPLE, m)
    cities = rng.sample(CITIES, min(2 * m, len(CITIES)))  # (more than 10 branches: every city is in play)
    countries = rng.sample(COUNTRIES, m)
    n_people = max(1, m // 2)
    lives = {p: cities[i] for i, p in enumerate(people[:n_people])}
    target = rng.choice(people[:n_people])
    # the target's city is always located; the other city branches locate other people's cities or strangers
    located = [lives[target]] + rng.sample([c for c in cities if c != lives[target]], m - n_people - 1)
    facts = ([("who", p, lives[p]) for p in people[:n_people]]
             + [("where", c, countries[i]) for i, c in enumerate(located)])
    rng.shuffle(facts)
    branches = []
    for (kind, key, value), n in zip(facts, _lengths(rng, m, length)):
        pool = PEOPLE if kind == "who" else CITIES
        records = [(key, value)] + [(k, rng.choice(CITIES if kind == "who" else COUNTRIES))
                                    for k in rng.sample([k for k in pool if k != key], n - 1)]
        rng.shuffle(records)
        branches.append(_lookup(kind, key, records))
    country = dict((k, v) for kind, k, v in facts if kind == "where")[lives[target]]
    return (CHAIN_SYSTEM, branches, f"which country does {target} live in?",
            f"{target} lives in {lives[target]}; {lives[target]} is in {country}")


def _vote(rng: random.Random, m: int, length: tuple[int, int]):
    confidences = rng.sample(range(1, 10 if m < 10 else 20), m)  # distinct: one digit, or two from 10 workers
    answers = [rng.randint(10, 99) for _ in range(m)]
    branches = []
    for a, c, n in zip(answers, confidences, _lengths(rng, m, length)):
        notes = " ".join(rng.choice(WORDS) for _ in range(2 * n))
        branches.append(Branch(f"notes: {notes}. confidence {c}, answer {a}", f"confidence {c}, answer {a}"))
    best = answers[confidences.index(max(confidences))]
    return ("workers solve the same problem. the synthesizer trusts the most confident.", branches,
            "which answer is most confident?", f"confidence {max(confidences)}, answer {best}")


def _trail(rng: random.Random, m: int, length: tuple[int, int]):
    lengths = _lengths(rng, m, length)
    if sum(lengths) <= 90:  # every room visited once
        rooms = rng.sample(range(10, 100), sum(lengths))
    else:  # long searches share the 90 rooms: each path visits distinct rooms
        rooms = [r for n in lengths for r in rng.sample(range(10, 100), n)]
    finder = rng.randrange(m)
    branches, start = [], 0
    for j, n in enumerate(lengths):
        path = rooms[start:start + n]
        start += n
        found = j == finder
        log = ", ".join(f"{r} {'key' if found and i == n - 1 else 'empty'}" for i, r in enumerate(path))
        said = " ".join(map(str, path)) + (f" key in {path[-1]}" if found else " key none")
        branches.append(Branch(f"search: {log}", f"visited {said}"))
    key_room = rooms[sum(lengths[:finder]) + lengths[finder] - 1]
    return ("workers search rooms for the key. the synthesizer reports where it is.", branches,
            "where is the key?", f"key in {key_room}")


def _multiqa(rng: random.Random, m: int, length: tuple[int, int]):
    labels = rng.sample(PEOPLE, m)
    branches, answers = [], []
    for label, n in zip(labels, _lengths(rng, m, length)):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        aside = " ".join(rng.choice(WORDS) for _ in range(n))
        branches.append(Branch(f"{label} asks: {aside}. what is {a} plus {b}?", None))
        answers.append(f"{label} {a} plus {b} is {a + b}")
    return ("answer every question.", branches, "answer all questions.", ", ".join(answers))


GENERATORS = {"chain": _chain, "vote": _vote, "trail": _trail, "multiqa": _multiqa}
WITHOUT_WORKERS = ("multiqa",)  # tasks whose branches are user turns, with no worker replies (Task.has_workers)
TASKS = tuple(GENERATORS)


def generate(name: str, seed: int, num_branches: int, length: tuple[int, int] = DEFAULT_LENGTH) -> Task:
    if name not in GENERATORS:
        raise ValueError(f"task {name!r} is not one of {', '.join(TASKS)}")
    if not 1 <= num_branches <= MAX_BRANCHES:
        raise ValueError(f"num_branches must be in 1..{MAX_BRANCHES}, got {num_branches}")
    lo, hi = length
    if not 1 <= lo <= hi <= 12:
        raise ValueError(f"length must be (min, max) with 1 <= min <= max <= 12, got {length}")
    rng = random.Random(f"{name}:{seed}:{num_branches}:{lo}:{hi}")
    system, branches, question, answer = GENERATORS[name](rng, num_branches, (lo, hi))
    return Task(name, seed, system, tuple(branches), question, answer)


def sample(name: str, n: int, seed: int, num_branches: int, length: tuple[int, int] = DEFAULT_LENGTH) -> list[Task]:
    """n tasks; task i depends only on (name, seed + i, num_branches, length)."""
    return [generate(name, seed + i, num_branches, length) for i in range(n)]


def synthesizer_trace(task: Task, apart: bool = False) -> list[tuple[str, bool]]:
    """The synthesizer turn as (segment, supervised) pieces, one per message; `apart`: answered as from the
    branches encoded apart (Task.answer_apart)."""
    return ([(turn("system", task.system), False)] + [(b.message(), False) for b in task.branches]
            + [(task.prompt(), False), ((task.answer_apart() if apart else task.answer) + END, True)])


def worker_trace(task: Task, j: int) -> list[tuple[str, bool]]:
    """Worker j's turn: the shared system prompt, its own context, its reply."""
    if not task.has_workers:
        raise ValueError(f"{task.name} branches are questions, not worker turns")
    return _worker_turn(task.system, task.branches[j])


def _worker_turn(system: str, branch: Branch) -> list[tuple[str, bool]]:
    return [(turn("system", system), False), (turn("user", branch.context), False),
            (header("worker"), False), (branch.output + END, True)]


def lookup_drill(rng: random.Random, max_records: int = 8) -> list[tuple[str, bool]]:
    """A chain worker's turn whose keys and values are any names, in either role: training data for one
    lookup that works on any key. Trained on chain alone, the model learned a lookup for one pairing of
    name kinds only (city keys to country values, or in another run person keys to city values)."""
    keys = rng.sample(NAMES, rng.randint(2, max_records))
    records = [(k, rng.choice([v for v in NAMES if v != k])) for k in keys]
    return _worker_turn(CHAIN_SYSTEM, _lookup(rng.choice(("who", "where")), rng.choice(keys), records))


MULTIQA_SYSTEM = "answer every question."


@dataclass(frozen=True)
class SharedTextTask:
    """KVComm's reference task: agents with fixed roles read the same user text, each under its own
    prefix. Agent j's role is its own question (a MultiQA turn fixed for that agent, of its own length, so
    the shared text starts at a different position with different context in each agent); the user's text is
    `questions` more MultiQA turns. Each agent answers its own question and all of the user's; its answer is
    right only if it read every digit of the shared text.
    """

    seed: int
    roles: tuple[str, ...]  # agent j's own question turn: the text of its prefix after the system prompt
    shared: str  # the user's questions (the placeholder every agent reads)
    answers: tuple[str, ...]  # per agent

    def prefix(self, j: int) -> str:
        return turn("system", MULTIQA_SYSTEM) + self.roles[j]

    @staticmethod
    def reply_header() -> str:
        return turn("user", "answer all questions.") + header("synthesizer")

    def correct(self, j: int, prediction: str) -> bool:
        return _answer_set(prediction) == _answer_set(self.answers[j])


def _question(rng: random.Random, label: str, words: int) -> tuple[str, str]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    aside = " ".join(rng.choice(WORDS) for _ in range(words))
    return turn("user", f"{label} asks: {aside}. what is {a} plus {b}?"), f"{label} {a} plus {b} is {a + b}"


def shared_text_task(seed: int, num_agents: int, questions: int = 3, length: tuple[int, int] = DEFAULT_LENGTH
                     ) -> SharedTextTask:
    """A pure function of its arguments. Agent j's role depends on j alone (a fixed template); the user's
    questions on the seed. Labels never repeat within a task."""
    if not 1 <= num_agents <= 8 or not 1 <= questions <= 8:
        raise ValueError(f"num_agents and questions must be in 1..8, got {num_agents} and {questions}")
    roles, own = [], []
    for j in range(num_agents):
        text, answer = _question(random.Random(f"role:{j}"), PEOPLE[j], 2 + 3 * j)  # ann, bob, ...: 2-23 words
        roles.append(text)
        own.append(answer)
    rng = random.Random(f"shared:{seed}:{questions}:{length}")
    labels = rng.sample(PEOPLE[8:], questions)
    turns, answers = zip(*(_question(rng, label, rng.randint(*length)) for label in labels))
    return SharedTextTask(seed, tuple(roles), "".join(turns),
                          tuple(", ".join([own[j], *answers]) for j in range(num_agents)))
