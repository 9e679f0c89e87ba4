"""bfcl: BFCL multi-turn against bfcl-eval's own data, API classes and checker (the bfcl tier)."""

from __future__ import annotations

import importlib.util
import itertools
import json
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from processes import rail
from rail.config import ConfigError, build_config
from rail.envs import Action, ToolRunner, make_env, rubric_status

pytestmark = pytest.mark.bfcl
ROOT = Path(__file__).resolve().parents[1]
CATEGORIES = ("base", "miss_func", "miss_param", "long_context")


@pytest.fixture(scope="module")
def env():
    return make_env("bfcl", 0, {"categories": list(CATEGORIES)})


def play(env, task, turns, fmt="json", reply="Done."):
    """Each user turn: its calls written in ``fmt``, then a message without a call; as a rollout runs them."""
    runner = ToolRunner(env, fmt).begin(task)
    steps = []
    for calls in turns:
        steps += [runner.step(task, runner.render(a)) for a in calls]
        steps.append(runner.step(task, reply))
        if steps[-1].done:
            break
    return steps


def test_every_ground_truth_trajectory_scores_one(env):
    assert len(env._cases) == 800
    for case in env._cases.values():
        task = case.task
        for fmt in ("hermes", "builtin"):
            runner = ToolRunner(env, fmt).begin(task)
            steps = [runner.step(task, runner.render(a)) for a in task.action_guide]
            assert steps[-1].done and env.reward(task, steps) == 1.0, (task.id, fmt)
            st = rubric_status(env, task, steps)
            assert st.first_violated is None and st.progress == 1.0


def _raw_ground_truth(category):
    path = resources.files("bfcl_eval") / "data" / "possible_answer" / f"BFCL_v4_multi_turn_{category}.json"
    return {row["id"]: row["ground_truth"] for row in map(json.loads, path.read_text().splitlines())}


def _wrong(a: Action, rng) -> Action | None:
    """One argument changed, its type kept."""
    args = a.arguments
    if not args:
        return None
    k = sorted(args)[int(rng.integers(len(args)))]
    v = args[k]
    if isinstance(v, bool):
        v = not v
    elif isinstance(v, (int, float)):
        v = v + 1
    elif isinstance(v, str):
        v = v + "x"
    elif isinstance(v, list):
        v = v + v[:1] if v else ["x"]
    else:
        return None
    return Action.named(a.tool, {**args, k: v})


def test_verifier_agrees_with_bfcl_multi_turn_checker_on_ground_truth_and_perturbed_trajectories():
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    env = make_env("bfcl", 0)  # the base split, all 200 tasks
    raw, rng, names = _raw_ground_truth("base"), np.random.default_rng(0), itertools.count()
    tally = {}
    for case in env._cases.values():
        gt = case.ground_truth
        k = [i for i, c in enumerate(gt) if c][int(rng.integers(sum(1 for c in gt if c)))]
        j = int(rng.integers(len(gt[k])))
        variants = {"ground truth": gt, "a dropped call": [c if i != k else c[:j] + c[j + 1:] for i, c in enumerate(gt)]}
        w = _wrong(gt[k][j], rng)
        if w is not None:
            variants["a wrong argument"] = [c if i != k else c[:j] + [w] + c[j + 1:] for i, c in enumerate(gt)]
        if len(gt) > 1:  # one call made in the next (or the previous) user turn
            k2 = k + 1 if k + 1 < len(gt) else k - 1
            moved = [list(c) for c in gt]
            a = moved[k].pop(j)
            moved[k2] = moved[k2] + [a] if k2 > k else [a] + moved[k2]
            variants["a call of the wrong turn"] = moved
        for name, turns in variants.items():
            ours = env.reward(case.task, play(env, case.task, turns))
            # BFCL's checker evaluates call strings; it runs on the rendered calls (literals only) of this test
            model = [[[a.render()] for a in calls] for calls in turns]
            theirs = multi_turn_checker(model, raw[case.task.id], case.entry, "multi_turn_base", f"rail_{next(names)}")
            t = tally.setdefault(name, [0, 0, 0])
            t[0] += 1
            t[1] += ours == (1.0 if theirs["valid"] else 0.0)
            t[2] += not theirs["valid"]
    assert tally["ground truth"] == [200, 200, 0]
    for name, (n, agree, invalid) in tally.items():
        assert agree == n, (name, tally)
    assert tally["a dropped call"][2] == 200 and tally["a wrong argument"][2] > 0.9 * tally["a wrong argument"][0]
    assert tally["a call of the wrong turn"][2] > 0.9 * tally["a call of the wrong turn"][0]


def test_python_in_a_model_output_executes_nothing(env, tmp_path):
    marker = tmp_path / "pwned"
    case = next(c for c in env._cases.values() if c.entry["involved_classes"][0] == "GorillaFileSystem")
    task = case.task
    payload = f"__import__('os').system('touch {marker}')"
    outputs = {
        "hermes": [f'<tool_call>{{"name": "{payload}", "arguments": {{}}}}</tool_call>',
                   f'<tool_call>{{"name": "cat", "arguments": {{"file_name": "{payload}"}}}}</tool_call>',
                   f'<tool_call>{{"name": "cat", "arguments": "{{\\"file_name\\": {payload}}}"}}</tool_call>'],
        "json": [json.dumps({"name": "eval", "arguments": {"source": payload}}),
                 json.dumps({"name": "_load_scenario", "arguments": {"scenario": {}}})],
        "builtin": [f"cat(file_name={payload})", payload, f"[cat(file_name='a'), {payload}]",
                    "cat(file_name=exec('import os'))"],
    }
    for fmt, texts in outputs.items():
        for text in texts:
            runner = ToolRunner(env, fmt).begin(task)
            before = {k: dict(vars(v)) for k, v in runner.episode.instances.items()}
            step = runner.step(task, text)
            # not a call (the user turn ends), or a failed one: an error result, or the API's own error for a
            # file name that is only a string
            assert (step.action is None and step.ok and step.user is not None) or not step.ok, (fmt, text)
            assert {k: dict(vars(v)) for k, v in runner.episode.instances.items()} == before
    with pytest.raises(ValueError):
        env.parse_call(f"cat(file_name={payload})")
    assert not marker.exists()


def test_a_message_without_a_call_ends_the_user_turn_and_the_next_one_arrives(env):
    case = next(c for c in env._cases.values() if c.category == "base" and c.task.level == 3)
    task = case.task
    steps = play(env, task, [case.ground_truth[0], [], []])  # the first turn done right, the rest not at all
    closes = [i for i, s in enumerate(steps) if s.user is not None or s.done]
    assert len(closes) == 3 and steps[-1].done
    assert [steps[i].user for i in closes[:2]] == case.turns[1:]
    assert env.reward(task, steps) == 0.0
    st = rubric_status(env, task, steps)
    assert st.holds[0] and not st.holds[1] and st.first_violated == 1 and st.violated_turn == closes[0] + 1
    # an unknown function or a wrong argument is an error result and the turn goes on
    runner = ToolRunner(env, "json").begin(task)
    s1 = runner.step(task, json.dumps({"name": "no_such_function", "arguments": {}}))
    first = case.ground_truth[0][0]
    s2 = runner.step(task, json.dumps({"name": first.tool, "arguments": {**first.arguments, "bogus": 1}}))
    assert not s1.ok and not s1.done and s1.user is None and "no function named" in s1.observation
    assert not s2.ok and "unexpected argument(s) bogus" in s2.observation


def test_each_task_lists_its_own_classes_and_miss_func_reveals_its_functions_later(env):
    for case in env._cases.values():
        names = {t["function"]["name"] for t in env.start(case.task).tools}
        assert names <= env.functions(case)
        hidden = {f for fs in case.reveal.values() for f in fs}
        assert names == env.functions(case) - hidden
        for k, fs in case.reveal.items():
            assert all(f'"name": "{f}"' in case.turns[k] for f in fs) and "What about now?" in case.turns[k]
    assert any(c.reveal for c in env._cases.values() if c.category == "miss_func")


def test_split_is_by_scenario_the_same_in_every_category(env):
    held = {c.task.id for lv in env._held.values() for c in lv}
    number = lambda tid: int(tid.rsplit("_", 1)[1])  # noqa: E731
    assert len({number(t) for t in held}) == 47 and len(held) == 4 * 47
    train = {c.task.id for lv in env._train.values() for c in lv}
    assert not {number(t) for t in held} & {number(t) for t in train}
    drawn = env.sample_tasks(np.random.default_rng(0), env.levels, 2000)
    assert not {t.id for t in drawn} & held
    ev = env.eval_tasks(3, 8)
    assert ev == env.eval_tasks(3, 8) and [t.family for t in ev[:4]] == [f"bfcl/{c}" for c in CATEGORIES]
    assert env.eval_tasks(1, 10) == []  # no held-out scenario has one user turn
    with pytest.raises(ValueError, match="no training tasks of levels"):
        make_env("bfcl", 0).sample_tasks(np.random.default_rng(0), [8], 1)


def test_bfcl_needs_a_checkpoint_with_its_own_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # validation looks for a model directory, loads nothing
    with pytest.raises(ConfigError, match="'bfcl' has no closed vocabulary"):
        build_config("smoke", sets=[{"env": {"families": ["bfcl"]}}])
    cfg = build_config("smoke", sets=[{"env": {"families": ["bfcl"], "options": {"bfcl": {"docs": "compact"}}},
                                       "model": {"path": str(tmp_path)}}])
    assert cfg.env.options == {"bfcl": {"docs": "compact"}}
    with pytest.raises(ConfigError, match="unexpected keyword argument 'split'"):
        build_config("smoke", sets=[{"env": {"families": ["bfcl"], "options": {"bfcl": {"split": 1}}},
                                     "model": {"path": str(tmp_path)}}])


@pytest.fixture(scope="module")
def tiny_bfcl_model(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "experiments" / "make_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path_factory.mktemp("tiny-bfcl")
    mod.build(out, bfcl=True)
    return out


def test_interventions_branch_after_a_passed_user_turn(env, tiny_bfcl_model):
    from policy.engine import TransformersEngine, SamplingParams
    from policy.model import load_policy
    from policy.records import Origin
    from policy.tokenizer import ChatRenderer
    from rail import interventions
    from rail.policy_setup import reference_trajectory

    model, tok = load_policy(tiny_bfcl_model)
    r = ChatRenderer(tok)
    compact = make_env("bfcl", 0, {"docs": "compact"})
    case = next(c for c in compact._cases.values() if c.task.level == 2 and len(c.ground_truth[1]) >= 1)
    task = case.task
    # a source trajectory that did the first user turn right and then stopped: the violation is turn 2
    src = reference_trajectory(compact, task, r, tool_format="hermes",
                               actions=[*case.ground_truth[0], Action.message("Done."), Action.message("Done.")])
    src.reward, src.rubric = compact.reward(task, src.steps), rubric_status(compact, task, src.steps)
    assert src.rubric.holds == (True, False) and src.rubric.violated_turn == len(case.ground_truth[0]) + 1
    runner = ToolRunner(compact, "hermes")
    engine = TransformersEngine(model, r)
    for how in ("rubric_hint", "guided_step", "action_guide"):
        where = "start" if how == "action_guide" else "violation"
        p = interventions.plan(interventions.Intervention(how, where, 2), 0, [src], task, runner,
                               compact.system_prompt(), "rollouts", 32)
        trajs = engine.generate(p.requests, SamplingParams(max_tokens_per_turn=16, max_turns=12), seed=0)
        for tr in trajs:
            if how == "rubric_hint":  # the hint follows the second user message, and lists its calls
                hint = tok.decode([t for t, o in zip(tr.ids, tr.origin) if o == Origin.GUIDANCE])
                assert case.turns[1] not in hint and case.ground_truth[1][0].tool in hint
                assert tr.steps[p.branch_turn - 1].user == case.turns[1]
            if how == "guided_step":  # the turn's first ground-truth call, executed on the prefix's state
                st = tr.steps[p.branch_turn]
                assert st.action == case.ground_truth[1][0] and not st.observation.startswith("Error")
            assert compact.reward(task, tr.steps) in (0.0, 1.0)


def test_smoke_training_run_on_bfcl(tiny_bfcl_model, tmp_path):
    out = tmp_path / "run"
    sets = [f"model.path='{tiny_bfcl_model}'", "rollout.tool_format=hermes", "env.families=['bfcl']",
            'env.options.bfcl.docs="compact"', f"warmstart.cache_dir='{tmp_path}'", "warmstart.steps=2",
            "warmstart.batch_size=4", "budget.rollouts_per_step=8", "run.steps=1", "eval.tasks_per_level=1",
            "eval.levels=[2, 3]", "rollout.max_tokens_per_turn=16", "learner.rehearsal_batch=2",
            "learner.minibatch_size=8"]
    r = rail("train", "--preset", "smoke", "--out", str(out), "--tracking-uri", "", "--no-progress",
             *[x for s in sets for x in ("--set", s)], timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["eval"]["final"]) == {"bfcl/base"} and summary["steps"] == 1
    assert summary["interventions"]["rollouts"] > 0 and summary["eval"]["tasks"]["bfcl/base"]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/bfcl/base/level_2" in m for m in rows) and any("eval/bfcl/base/all" in m for m in rows)
    assert "bfcl/base" in r.stdout
    decisions = [json.loads(ln) for ln in (out / "traces" / "decisions.dsjson").read_text().splitlines()]
    assert decisions and {d["c"]["s"]["family"] for d in decisions} == {"bfcl"}
