"""Environments: determinism, the held-out split, action guides, rubrics, tool errors and the vocabulary."""

from __future__ import annotations

import re
import zlib

import numpy as np
import pytest

from rail.envs import (
    ENVIRONMENTS,
    Action,
    CalcEnv,
    KinEnv,
    LookupEnv,
    RubricItem,
    Step,
    ToolRunner,
    make_env,
    parse_action,
    rubric_status,
)

FAMILIES = sorted(ENVIRONMENTS)


def words(text: str) -> list[str]:
    return re.findall(r"\w+|[^\w\s]", text)


def run(env, task, texts: list[str]) -> list[Step]:
    """Execute assistant turns as the rollout engine does, stopping at the end of the episode."""
    runner, steps = ToolRunner(env), []
    for text in texts:
        steps.append(runner.step(task, text))
        if steps[-1].done:
            break
    return steps


def guide_texts(task) -> list[str]:
    return [a.render() for a in task.action_guide]


# ------------------------------------------------------------------------------- registry


def test_make_env_builds_each_family_and_rejects_unknown_names():
    for name in FAMILIES:
        env = make_env(name, 3)
        assert env.name == name and env.seed == 3
        assert env.levels == tuple(range(1, 9))
    with pytest.raises(ValueError, match=r"'nope'.*lookup.*calc|'nope'.*calc.*lookup"):
        make_env("nope", 0)


# ------------------------------------------------------------------------------- determinism and split


@pytest.mark.parametrize("name", FAMILIES)
def test_same_seed_same_tasks_different_seed_different_tasks(name):
    a, b, c = make_env(name, 0), make_env(name, 0), make_env(name, 1)
    ta = a.sample_tasks(np.random.default_rng(5), [1, 2, 3, 4], 30)
    tb = b.sample_tasks(np.random.default_rng(5), [1, 2, 3, 4], 30)
    assert ta == tb
    assert a.eval_tasks(3, 20) == b.eval_tasks(3, 20) == a.eval_tasks(3, 20)
    assert a.eval_tasks(3, 20) != c.eval_tasks(3, 20)
    if name == "lookup":  # the world itself depends on the seed, not only the task stream
        tc = c.sample_tasks(np.random.default_rng(5), [1, 2, 3, 4], 30)
        assert [t.id for t in ta] == [t.id for t in tc]  # same stream of questions ...
        assert [t.answer for t in ta] != [t.answer for t in tc]  # ... about a different graph


def test_lookup_graph_never_maps_an_entity_to_itself_and_covers_every_pair():
    env = LookupEnv(seed=2, n_entities=30)
    for e in env.entities:
        for r in ("mother", "father", "boss", "friend", "mentor", "neighbor"):
            target = env.follow(e, r)
            assert target != e and target in env.entities
    tiny = LookupEnv(seed=0, n_entities=2)
    assert tiny.follow("e0", "boss") == "e1" and tiny.follow("e1", "boss") == "e0"


@pytest.mark.parametrize("name", FAMILIES)
def test_training_tasks_never_come_from_the_eval_pools(name):
    env = make_env(name, 0)
    pool = {t.id for lv in range(1, 7) for t in env.eval_tasks(lv, 40)}
    assert len(pool) == 6 * 40  # distinct within and across levels
    train = env.sample_tasks(np.random.default_rng(0), [1, 2, 3, 4, 5, 6], 3000)
    assert not pool & {t.id for t in train}
    # and the rejection is really by key: the eval pool is exactly the held-out part of what was drawn
    assert all(zlib.crc32(i.encode()) % 5 == 0 for i in pool)
    assert all(zlib.crc32(t.id.encode()) % 5 != 0 for t in train)


@pytest.mark.parametrize("name", FAMILIES)
def test_levels_are_drawn_from_the_given_list_and_every_level_generates(name):
    env = make_env(name, 0)
    train = env.sample_tasks(np.random.default_rng(1), [2, 5], 200)
    assert {t.level for t in train} == {2, 5}
    for lv in range(1, 9):
        (task,) = env.sample_tasks(np.random.default_rng(lv), [lv], 1)
        assert task.level == lv and task.family == name
        calls = 3 if name == "kin" else lv  # kin: every level is three lookups (levels differ in knowledge)
        assert len(task.rubric) == calls + 1 and len(task.action_guide) == calls + 1
        assert [i.kind for i in task.rubric] == ["call"] * calls + ["answer"]
    with pytest.raises(ValueError):
        env.eval_tasks(9, 1)
    with pytest.raises(ValueError):
        env.sample_tasks(np.random.default_rng(0), [0], 1)


def test_eval_tasks_refuses_more_than_the_pool_holds():
    env = LookupEnv(seed=0, n_entities=5)  # level 1: 30 tasks, about 6 held out
    with pytest.raises(ValueError, match="held-out"):
        env.eval_tasks(1, 50)


# ------------------------------------------------------------------------------- formats


def test_lookup_task_format():
    env = LookupEnv(seed=0)
    t = env._task("e17", ["mother", "boss", "friend"])
    assert t.id == "lookup:e17:mother.boss.friend"
    assert t.prompt == "start at e17 , follow mother , then boss , then friend . which entity do you reach ?"
    m = env.follow("e17", "mother")
    assert t.rubric[0] == RubricItem(f"lookup(e17, mother) -> {m}", "call", Action("lookup", ("e17", "mother")),
                                     m, f"the mother of e17 is {m}")
    assert t.rubric[1].action == Action("lookup", (m, "boss"))  # the chain carries the previous result
    assert t.rubric[-1].action == Action("answer", (t.answer,))
    assert t.rubric[-1].evidence == f"the answer is {t.answer}"
    one = env._task("e17", ["mother"])
    assert one.prompt == "start at e17 , follow mother . which entity do you reach ?"
    assert env.system_prompt() == ("you are a search agent . call lookup ( entity , relation ) to follow a "
                                   "relation , then answer ( entity ) .")


def test_calc_task_format():
    env = CalcEnv(seed=0)
    t = env._task(3, [("+", 4), ("*", 2), ("-", 5)])
    assert t.id == "calc:3:+4*2-5"
    assert t.prompt == "start with 3 , add 4 , multiply by 2 , subtract 5 . what is the result ?"
    assert t.answer == "9"
    assert [i.description for i in t.rubric] == ["calc(3, +, 4) -> 7", "calc(7, *, 2) -> 14",
                                                 "calc(14, -, 5) -> 9", "answer(9)"]
    assert [i.evidence for i in t.rubric] == ["3 + 4 is 7", "7 * 2 is 14", "14 - 5 is 9", "the answer is 9"]
    assert [i.result for i in t.rubric[:3]] == ["7", "14", "9"]
    assert t.action_guide[-1] == Action("answer", ("9",))


def test_kin_task_format_and_definitions():
    env = KinEnv(seed=0)
    defs = env.definitions
    assert len(defs) == 32 and len(set(defs.values())) == 32  # distinct compositions of the base relations
    assert all(len(d) == 3 for d in defs.values())
    assert KinEnv(seed=0).definitions == defs and KinEnv(seed=1).definitions != defs
    assert env.names(1) == ("grandparent", "sibling", "cousin", "uncle") and len(set(env.names(8))) == 4
    (task,) = env.sample_tasks(np.random.default_rng(3), [3], 1)
    name, start = task.prompt.split()[2], task.action_guide[0].args[0]
    assert name in env.names(3) and task.prompt == f"find the {name} of {start} . which entity is it ?"
    r1, r2, r3 = defs[name]
    a = env.world.follow(start, r1)
    b = env.world.follow(a, r2)
    assert [x.render() for x in task.action_guide] == [f"lookup({start}, {r1})", f"lookup({a}, {r2})",
                                                        f"lookup({b}, {r3})", f"answer({env.world.follow(b, r3)})"]
    # the hint for any call reveals the whole definition; the name itself is no relation the tool knows
    assert {i.evidence for i in task.rubric[:3]} == {f"{name} is {r1} then {r2} then {r3}"}
    assert env.execute(task, Action("lookup", (start, name)))[1] is False
    # the world is the lookup family's graph of the same seed
    assert env.world.follow(start, r1) == LookupEnv(seed=0).follow(start, r1)


def test_kin_levels_differ_in_names_only():
    env = KinEnv(seed=0)
    seen = {lv: {t.prompt.split()[2] for t in env.eval_tasks(lv, 48)} for lv in (1, 2, 3, 4)}
    for lv, names in seen.items():
        assert names == set(env.names(lv))
    assert not seen[1] & seen[3] and not seen[2] & seen[4]
    assert {len(t.action_guide) for lv in (1, 4) for t in env.eval_tasks(lv, 20)} == {4}


def test_kin_guided_demonstrations_use_nonce_names_with_fresh_definitions():
    from rail.envs.kin import NAMES, NONCE_NAMES

    env, rng = KinEnv(seed=0), np.random.default_rng(0)
    tasks = [env.demonstration_task(rng, [1, 2], guided=True) for _ in range(50)]
    assert all(t.level == 0 and t.prompt.split()[2] in NONCE_NAMES for t in tasks)
    assert len({tuple(a.args[1] for a in t.action_guide[:3]) for t in tasks}) > 30  # drawn afresh each time
    assert all(run(env, t, guide_texts(t))[-1].done and env.reward(t, run(env, t, guide_texts(t))) == 1.0
               for t in tasks)
    plain = [env.demonstration_task(rng, [1, 2], guided=False) for _ in range(20)]
    assert {t.level for t in plain} == {1, 2} and all(t.prompt.split()[2] in NAMES[:8] for t in plain)


def test_calc_values_stay_in_range():
    env = CalcEnv(seed=0)
    for task in env.sample_tasks(np.random.default_rng(0), [8], 300):
        start = int(task.id.split(":")[1])
        assert 1 <= start <= 20
        values = [int(i.result) for i in task.rubric if i.kind == "call"]
        assert all(0 <= v <= 999 for v in values)
        assert all(1 <= int(a.args[2]) <= 9 for a in task.action_guide[:-1])


# ------------------------------------------------------------------------------- action guide and rubric


@pytest.mark.parametrize("name", FAMILIES)
def test_action_guide_solves_every_task_and_satisfies_every_item(name):
    env = make_env(name, 0)
    tasks = env.sample_tasks(np.random.default_rng(0), list(range(1, 9)), 80)
    tasks += [t for lv in (1, 4, 8) for t in env.eval_tasks(lv, 5)]
    for task in tasks:
        steps = run(env, task, guide_texts(task))
        assert len(steps) == len(task.action_guide) and steps[-1].done
        assert all(s.ok for s in steps)
        # each call's observation is the rubric item's result
        assert [s.observation for s in steps[:-1]] == [i.result for i in task.rubric[:-1]]
        assert env.reward(task, steps) == 1.0
        st = rubric_status(env, task, steps)
        assert all(st.holds) and st.first_violated is None and st.progress == 1.0


@pytest.mark.parametrize("name", FAMILIES)
def test_wrong_answer_and_unfinished_trajectories_get_no_reward(name):
    env = make_env(name, 0)
    (task,) = env.sample_tasks(np.random.default_rng(3), [3], 1)
    calls = guide_texts(task)[:-1]
    wrong = str(int(task.answer) + 1) if name == "calc" else ("e0" if task.answer != "e0" else "e1")
    assert env.reward(task, run(env, task, calls + [f"answer({wrong})"])) == 0.0
    assert env.reward(task, run(env, task, calls)) == 0.0  # never answered
    assert env.reward(task, []) == 0.0
    assert env.reward(task, run(env, task, [f"answer({task.answer})"])) == 1.0  # the verifier checks outcomes
    assert env.reward(task, run(env, task, [f"answer ( {task.answer} )"])) == 1.0


def test_rubric_status_on_hand_made_lookup_trajectories():
    env = LookupEnv(seed=0)
    task = env._task("e17", ["mother", "boss", "friend"])
    first, second = task.action_guide[0], task.action_guide[1]
    wrong_rel = "father" if env.follow(second.args[0], "father") != env.follow(second.args[0], "boss") else "friend"
    wrong_answer = "e0" if task.answer != "e0" else "e1"
    steps = run(env, task, [first.render(), f"lookup({second.args[0]}, {wrong_rel})", f"answer({wrong_answer})"])
    st = rubric_status(env, task, steps)
    assert st.holds == (True, False, False, False)
    assert st.first_violated == 1 and st.violated_turn == 1
    assert st.achieved_turn == (0, None, None, None)

    empty = rubric_status(env, task, [])
    assert empty.first_violated == 0 and empty.violated_turn == 0 and empty.progress == 0.0

    prefix = run(env, task, guide_texts(task)[:2])
    st = rubric_status(env, task, prefix)
    assert st.holds == (True, True, False, False)
    assert st.first_violated == 2 and st.violated_turn == 2  # == len(prefix): stopped before that turn
    assert st.progress == 0.5

    # a failed call in between shifts the turn the next milestone was due
    noisy = run(env, task, [first.render(), "lookup(e17)", second.render()])
    st = rubric_status(env, task, noisy)
    assert st.achieved_turn[:2] == (0, 2) and st.first_violated == 2 and st.violated_turn == 3


def test_rubric_call_items_require_success_and_exact_lookup():
    env = LookupEnv(seed=0)
    task = env._task("e5", ["friend", "mentor"])
    item = task.rubric[0]
    good = Step("x", item.action, item.result, True, False)
    assert env.item_holds(task, item, good)
    assert not env.item_holds(task, item, Step("x", item.action, "error : x", False, False))
    assert not env.item_holds(task, item, Step("x", Action("lookup", ("e5", "mother")), "e1", True, False))
    assert not env.item_holds(task, item, Step("x", None, "error : malformed call", False, False))
    answer = task.rubric[-1]
    assert env.item_holds(task, answer, Step("x", Action("answer", (task.answer,)), "", True, True))
    assert not env.item_holds(task, answer, Step("x", Action("answer", ("e999",)), "", True, True))
    assert not env.item_holds(task, answer, Step("x", item.action, item.result, True, False))


def test_calc_plus_and_times_are_commutative_minus_is_not():
    env = CalcEnv(seed=0)
    task = env._task(3, [("+", 4), ("*", 2), ("-", 5)])
    plus, times, minus = task.rubric[:3]
    steps = run(env, task, ["calc(4, +, 3)", "calc(2, *, 7)", "calc(5, -, 14)"])
    assert [s.observation for s in steps] == ["7", "14", "error : out of range"]
    assert env.item_holds(task, plus, steps[0])
    assert env.item_holds(task, times, steps[1])
    assert not env.item_holds(task, minus, steps[2])
    swapped = Step("x", Action("calc", ("5", "-", "14")), "9", True, False)  # even if it had succeeded
    assert not env.item_holds(task, minus, swapped)
    # operands are compared as integers; the operator must match
    assert env.item_holds(task, plus, Step("x", Action("calc", ("03", "+", "4")), "7", True, False))
    assert not env.item_holds(task, plus, Step("x", Action("calc", ("3", "*", "4")), "12", True, False))
    assert not env.item_holds(task, plus, Step("x", Action("calc", ("3", "+", "5")), "8", True, False))
    st = rubric_status(env, task, steps + run(env, task, ["answer(9)"]))
    assert st.holds == (True, True, False, True) and st.first_violated == 2 and st.violated_turn == 2


# ------------------------------------------------------------------------------- tool errors


def test_lookup_tool_errors():
    env = LookupEnv(seed=0)
    (task,) = env.sample_tasks(np.random.default_rng(0), [2], 1)
    cases = {
        "lookup(e1)": "error : lookup takes an entity and a relation",
        "lookup(e1, mother, boss)": "error : lookup takes an entity and a relation",
        "lookup()": "error : lookup takes an entity and a relation",
        "lookup(e240, mother)": "error : unknown entity",
        "lookup(E1, mother)": "error : unknown entity",
        "lookup(e01, mother)": "error : unknown entity",
        "lookup(__class__, mother)": "error : unknown entity",
        "lookup(e1, Mother)": "error : unknown relation",
        "lookup(e1, __init__)": "error : unknown relation",
        "answer()": "error : answer takes one value",
        "answer(e1, e2)": "error : answer takes one value",
        "search(e1, mother)": "error : unknown tool",
        "calc(1, +, 2)": "error : unknown tool",
        "lookup(e1,": "error : malformed call",
        "lookup e1 mother": "error : malformed call",
        "lookup(__import__('os'), mother)": "error : malformed call",
        "": "error : malformed call",
    }
    for text, want in cases.items():
        (step,) = run(env, task, [text])
        assert (step.observation, step.ok, step.done) == (want, False, False), text
    obs, ok, done = env.execute(task, Action("lookup", ("e1", "mother")))
    assert (obs, ok, done) == (env.follow("e1", "mother"), True, False) and re.fullmatch(r"e\d+", obs)
    assert env.execute(task, Action("answer", ("e3",))) == ("", True, True)


def test_calc_tool_errors_and_hostile_text():
    env = CalcEnv(seed=0)
    (task,) = env.sample_tasks(np.random.default_rng(0), [2], 1)
    args_err = "error : calc takes a number , an operator and a number"
    cases = {
        "calc(3, +, 4)": ("7", True),
        "calc(007, *, 2)": ("14", True),
        "calc(999, *, 1)": ("999", True),
        "calc(5, -, 5)": ("0", True),
        "calc(5, -, 6)": ("error : out of range", False),
        "calc(500, *, 2)": ("error : out of range", False),
        "calc(1000, -, 1)": ("error : out of range", False),
        f"calc({'9' * 5000}, -, 1)": ("error : out of range", False),  # never reaches int()'s digit limit
        "calc(3, /, 4)": (args_err, False),
        "calc(3, **, 4)": (args_err, False),
        "calc(3, +)": (args_err, False),
        "calc(3, +, 4, 5)": (args_err, False),
        "calc(-3, +, 4)": (args_err, False),
        "calc(3.5, +, 4)": (args_err, False),
        "calc(1e3, +, 1)": (args_err, False),
        "calc(0x10, +, 1)": (args_err, False),
        "calc(\u0663, +, 1)": (args_err, False),  # a non-ASCII digit: int() would accept it
        "calc(1; import os, +, 1)": (args_err, False),
        "calc(os.system, +, 1)": (args_err, False),
        "calc(__import__('os'), +, 1)": ("error : malformed call", False),
        "calc(1, +, 1) or __import__('os')": ("error : malformed call", False),
        "calc(eval(1), +, 1)": ("error : malformed call", False),
        "answer()": ("error : answer takes one value", False),
        "answer(1, 2)": ("error : answer takes one value", False),
        "lookup(e1, mother)": ("error : unknown tool", False),
        "calc(1, +, 1": ("error : malformed call", False),
    }
    for text, (want, want_ok) in cases.items():
        (step,) = run(env, task, [text])
        assert (step.observation, step.ok, step.done) == (want, want_ok, False), text
    assert env.execute(task, Action("answer", ("12",))) == ("", True, True)
    assert env.execute(task, None) == ("error : malformed call", False, False)


# ------------------------------------------------------------------------------- parsing


def test_parse_action_edge_cases():
    assert parse_action("lookup ( e1 , mother )") == Action("lookup", ("e1", "mother"))
    assert parse_action("lookup(e1, mother)") == Action("lookup", ("e1", "mother"))
    assert parse_action("  answer ( 42 )  \n") == Action("answer", ("42",))
    assert parse_action("calc ( 3 , * , 4 )") == Action("calc", ("3", "*", "4"))
    assert parse_action("lookup()") == Action("lookup", ())
    for bad in ["lookup(e1,", "lookup(e1,,mother)", "lookup(e1, )", "lookup e1", "(e1)", "1lookup(e1)",
                "lookup(f(e1), mother)", "lookup(e1)) extra", "", "answer(1) answer(2)"]:
        assert parse_action(bad) is None, bad
    # what render() writes, parse_action reads back
    a = Action("calc", ("14", "-", "5"))
    assert parse_action(a.render()) == a and parse_action(" ".join(words(a.render()))) == a


# ------------------------------------------------------------------------------- vocabulary


@pytest.mark.parametrize("name", FAMILIES)
def test_vocabulary_covers_everything_the_environment_writes(name):
    env = make_env(name, 0)
    vocab = set(env.vocabulary())
    assert len(vocab) == len(env.vocabulary())  # no duplicates
    texts = [env.system_prompt()]
    tasks = env.sample_tasks(np.random.default_rng(0), list(range(1, 9)), 300)
    tasks += [t for lv in range(1, 9) for t in env.eval_tasks(lv, 10)]
    for task in tasks:
        texts.append(task.prompt)
        for item in task.rubric:
            texts += [item.description, item.evidence, item.action.render()]
        texts += [a.render() for a in task.action_guide]
        texts += [s.observation for s in run(env, task, guide_texts(task))]
    bad_calls = ["lookup(e1)", "lookup(zz, mother)", "lookup(e1, zz)", "answer()", "zz()", "((", "calc(1, +)",
                 "calc(9, -, 10)", "calc(1, +, 1)", "lookup(e1, mother)"]
    (task,) = env.sample_tasks(np.random.default_rng(1), [1], 1)
    texts += [env.execute(task, parse_action(t))[0] for t in bad_calls]
    missing = {w for text in texts for w in words(text)} - vocab
    assert not missing, sorted(missing)
    if name == "calc":
        assert {str(i) for i in range(1000)} <= vocab and {"+", "-", "*"} <= vocab
    else:
        assert {f"e{i}" for i in range(240)} <= vocab and "neighbor" in vocab
    assert {"(", ")", ",", ".", "?", ":", "answer"} <= vocab
