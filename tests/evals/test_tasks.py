"""Task generators: deterministic per seed, answers right by an independent reading, exact-match scoring."""

import random
import re

import pytest

from braid.models.chat import END, header, turn
from braid.evals.stats import accuracy_ci, mcnemar_p, paired_difference_ci
from braid.models.tasks import (CITIES, COUNTRIES, PEOPLE, TASKS, generate, lookup_drill, sample, synthesizer_trace,
                         worker_trace)


def solve(task) -> str:
    """Answer a task from what the synthesizer sees (the branch messages), written apart from the generators."""
    seen = [b.output if b.output is not None else b.context for b in task.branches]
    if task.name == "chain":
        lives = dict(re.fullmatch(r"(\w+) lives in (\w+)", s).groups() for s in seen if " lives in " in s)
        country = dict(re.fullmatch(r"(\w+) is in (\w+)", s).groups() for s in seen if " is in " in s)
        person = re.fullmatch(r"which country does (\w+) live in\?", task.question).group(1)
        return f"{person} lives in {lives[person]}; {lives[person]} is in {country[lives[person]]}"
    if task.name == "vote":
        scored = [tuple(map(int, re.fullmatch(r"confidence (\d+), answer (\d+)", s).groups())) for s in seen]
        return "confidence {}, answer {}".format(*max(scored))
    if task.name == "trail":
        (room,) = [re.search(r"key in (\d+)$", s).group(1) for s in seen if "key in" in s]
        return f"key in {room}"
    sums = [re.fullmatch(r"(\w+) asks: .*what is (\d) plus (\d)\?", s).groups() for s in seen]
    return ", ".join(f"{name} {a} plus {b} is {int(a) + int(b)}" for name, a, b in sums)


@pytest.mark.parametrize("name", TASKS)
def test_generators_are_deterministic_and_seeded(name):
    assert generate(name, 7, 5) == generate(name, 7, 5)
    assert sample(name, 3, 10, 4) == [generate(name, s, 4) for s in (10, 11, 12)]
    assert len({generate(name, s, 4) for s in range(20)}) == 20
    assert generate(name, 7, 5, (1, 3)) != generate(name, 7, 5, (4, 6))


@pytest.mark.parametrize("name", TASKS)
@pytest.mark.parametrize("m,length", [(2, (2, 6)), (4, (2, 6)), (8, (2, 6)), (10, (1, 12)), (12, (12, 12))])
def test_answers_follow_from_the_branches(name, m, length):
    for task in sample(name, 50, 0, m, length):
        assert len(task.branches) == m
        assert solve(task) == task.answer, task
        assert task.correct(task.answer) and task.correct(f"  {task.answer}{END}")


@pytest.mark.parametrize("name", TASKS)
def test_branches_have_their_own_lengths(name):
    lengths = {len(b.context) for t in sample(name, 20, 0, 6, (1, 8)) for b in t.branches}
    assert len(lengths) > 5
    if name != "multiqa":  # multiqa's branches are the questions themselves
        assert all(t.has_workers for t in sample(name, 5, 0, 3))


def test_known_wrong_answers_score_wrong():
    chain = generate("chain", 3, 4)
    person, city = re.match(r"(\w+) lives in (\w+);", chain.answer).groups()
    assert not chain.correct(f"{person} lives in {city}")  # stopped after one hop
    for b in chain.branches:  # any other country
        other = b.output.split()[-1]
        if " is in " in b.output and other != chain.answer.split()[-1]:
            assert not chain.correct(f"{person} lives in {city}; {city} is in {other}")
    assert not chain.correct(chain.answer + " " + chain.answer) and not chain.correct("")

    vote = generate("vote", 3, 5)
    least = min(vote.branches, key=lambda b: int(b.output.split(",")[0].split()[1])).output
    assert not vote.correct(least) and vote.correct(max(b.output for b in vote.branches))

    trail = generate("trail", 3, 4)
    empty_room = next(b.output.split()[1] for b in trail.branches if b.output.endswith("key none"))
    assert not trail.correct(f"key in {empty_room}") and not trail.correct("key none")

    qa = generate("multiqa", 3, 3)
    parts = qa.answer.split(", ")
    assert qa.correct(", ".join(reversed(parts)))  # labelled answers: order is free
    assert not qa.correct(", ".join(parts[:-1]))  # one question left unanswered
    *head, total = parts[0].split()
    assert not qa.correct(", ".join([" ".join([*head, str(int(total) + 1)]), *parts[1:]]))


def test_traces_use_the_chat_roles():
    task = generate("chain", 0, 3)
    synth = synthesizer_trace(task)
    assert synth[0] == (turn("system", task.system), False)
    assert [s for s, _ in synth[1:4]] == [turn("worker", b.output) for b in task.branches]
    assert synth[-2][0].endswith(header("synthesizer")) and synth[-1] == (task.answer + END, True)
    work = worker_trace(task, 1)
    assert work[1][0] == turn("user", task.branches[1].context) and work[-1] == (task.branches[1].output + END, True)
    with pytest.raises(ValueError, match="questions"):
        worker_trace(generate("multiqa", 0, 2), 0)


def test_lookup_drills_pair_any_names_and_answer_from_the_records():
    drills = [lookup_drill(random.Random(s)) for s in range(200)]
    assert drills == [lookup_drill(random.Random(s)) for s in range(200)]
    kind_of = {**dict.fromkeys(PEOPLE, "person"), **dict.fromkeys(CITIES, "city"),
               **dict.fromkeys(COUNTRIES, "country")}
    pairings = set()
    for system, user, head, (reply, supervised) in drills:
        assert system == (turn("system", generate("chain", 0, 2).system), False) and head == (header("worker"), False)
        table, kind, key = re.fullmatch(r"<\|user\|>records: (.*)\. (who|where): (\w+)<\|end\|>", user[0]).groups()
        records = dict(r.split() for r in table.split("; "))
        verb = "lives in" if kind == "who" else "is in"
        assert supervised and reply == f"{key} {verb} {records[key]}{END}" and records[key] != key
        pairings.update((kind, kind_of[k], kind_of[v]) for k, v in records.items())
    # every pairing of name kinds, in both questions: chain itself has only who: person->city, where: city->country
    assert len(pairings) == 2 * 3 * 3


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="not one of"):
        generate("sum", 0, 2)
    with pytest.raises(ValueError, match="num_branches"):
        generate("vote", 0, 13)
    with pytest.raises(ValueError, match="at least 2"):
        generate("chain", 0, 1)
    with pytest.raises(ValueError, match="length"):
        generate("trail", 0, 3, (5, 2))
    with pytest.raises(ValueError, match="role"):
        header("assistant")


def test_confidence_intervals_and_mcnemar():
    ci = accuracy_ci([True] * 90 + [False] * 10)
    assert ci.value == pytest.approx(0.9) and 0.82 < ci.low < 0.9 < ci.high <= 0.96
    assert accuracy_ci([True] * 20) == accuracy_ci([True] * 20) and accuracy_ci([True] * 20).low == 1.0
    a, b = [True] * 10 + [False] * 5, [False] * 10 + [False] * 5
    assert mcnemar_p(a, b) == pytest.approx(2 / 2 ** 10)  # 10 discordant pairs, all one way
    assert mcnemar_p(a, a) == 1.0 and mcnemar_p(a, b) == mcnemar_p(b, a)
    assert mcnemar_p([True, False] * 10, [False, True] * 10) == 1.0
    diff = paired_difference_ci(a, b)
    assert diff.value == pytest.approx(10 / 15) and diff.low > 0.3
    with pytest.raises(ValueError):
        paired_difference_ci([True], [True, False])


def test_the_answer_apart_does_not_depend_on_the_branch_order():
    """Read from branches encoded apart at one position, MultiQA's questions have no order: the answer trained
    for that (`answer_apart`) is the same for any order of the branches, and still a right answer."""
    import dataclasses

    task = generate("multiqa", 3, 6)
    shuffled = dataclasses.replace(task, branches=task.branches[::-1],
                                   answer=", ".join(reversed(task.answer.split(", "))))
    assert task.answer_apart() == shuffled.answer_apart() != task.answer
    assert task.correct(task.answer_apart()) and task.answer_apart().startswith(sorted(task.answer.split(", "))[0])
    chain = generate("chain", 3, 4)
    assert chain.answer_apart() == chain.answer  # (an order that counts stays as it is)
    assert synthesizer_trace(task, apart=True)[-1] == (task.answer_apart() + END, True)
