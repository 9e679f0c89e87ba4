"""The step protocol (rail/rounds.py) and the rung rule: the learned controller's shadowed heuristic is exactly the
``ladder`` (and ``rti``) arm; the rescue count and its per-operator column are one definition."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from controller import Rollout
from controller.heuristic import actionable, asked, next_rung, rung_plan
from policy.records import Status
from policy.tokenizer import ChatRenderer, build_word_tokenizer
from rail.budget import StepBudget
from rail.config import build_config
from rail.controllers import CONTROLLERS
from rail.envs import Action, ToolRunner, make_env, rubric_status
from rail.envs.lookup import RELATIONS
from rail.interventions import Intervention
from rail.policy_setup import reference_trajectory, vocabulary
from rail.rounds import Decision, Outcome, Rounds, drive, intervention_metrics, intervention_summary, make_group, \
    make_menu


@pytest.fixture(scope="module")
def world():
    env = make_env("lookup", 0)
    renderer = ChatRenderer(build_word_tokenizer(vocabulary({"lookup": env})))
    tasks = [t for t in env.sample_tasks(np.random.default_rng(3), [3], 40) if t.level == 3][:5]
    return env, renderer, tasks


def _failed(env, task, renderer, group: int, wrong_at: int = 1):
    """A hand-made failure: right calls up to ``wrong_at``, a wrong relation there, then consistent."""
    guide = list(task.action_guide)
    rel = guide[wrong_at].args[1]
    other = next(r for r in RELATIONS if r != rel)
    acts = [*guide[:wrong_at], Action("lookup", (guide[wrong_at].args[0], other)), *guide[wrong_at + 1:]]
    tr = reference_trajectory(env, task, renderer, actions=acts)
    tr.reward = env.reward(task, tr.steps)
    tr.rubric = rubric_status(env, task, tr.steps)
    tr.group = group
    return tr


def _solved(env, task, renderer, group: int):
    tr = reference_trajectory(env, task, renderer)
    tr.reward = env.reward(task, tr.steps)
    tr.rubric = rubric_status(env, task, tr.steps)
    tr.group = group
    return tr


def _groups(world):
    """Five groups of two base rollouts: failures at the second call, one at the first (no ``before`` branch),
    one group with a success, one whose capacity holds a single rung; group 4's wrong relation happens to reach
    the right entity, so it is solved."""
    env, r, tasks = world
    groups = []
    for i, task in enumerate(tasks):
        if i == 2:
            base = [_solved(env, task, r, i), _failed(env, task, r, i)]
        else:
            base = [_failed(env, task, r, i, wrong_at=0 if i == 1 else 1) for _ in range(2)]
        groups.append(make_group(i, "lookup", task, base, capacity=2 if i == 3 else None))
    return groups


def _cfg(name: str, **controller):
    cfg = build_config(sets=[{"controller": {"name": name, **controller}, "env": {"families": ["lookup"]}}])
    cfg.run.steps = 10
    return cfg


#: a ladder over RAIL's own action dimensions: an entropy branch point and a decoding temperature of its own
TEMPERED = {"temperatures": [0.7, 1.3], "menu": ["resample@entropy:1.3", "resample@violation", "rubric_hint@entropy",
                                               "rubric_hint@violation"],
            "ladder": ["resample@entropy:1.3", "resample@violation", "rubric_hint@violation:1.3"]}


@pytest.mark.parametrize("budget, explore", [(10_000, 1e-9), (5, 1e-9), (3, 1e-9), (10_000, 0.5), (4, 0.5)],
                         ids=["ample", "short", "shorter", "ample-exploring", "short-exploring"])
@pytest.mark.parametrize("shadow, extra", [("ladder", {}), ("rti", {}), ("ladder", TEMPERED)],
                         ids=["ladder", "rti", "ladder-entropy-temperature"])
def test_the_shadowed_heuristic_is_the_fixed_arm(world, shadow, extra, budget, explore):
    """Given the same groups, menu and budget, round after round, the heuristic the learned controller shadows
    decides exactly what the ``ladder`` (``rti``) arm decides: the same groups, operator, branch point, temperature
    and size, also when the budget cannot serve every group (both serve the groups in order while their rungs fit)
    and whatever the shadow's exploration ran instead (both sides then see the same interventions). Every
    intervention fails, except that group 0 succeeds in round 1, so later rounds ask fewer groups."""
    env, renderer, _ = world
    envs, runners = {"lookup": env}, {"lookup": ToolRunner(env)}
    arm_cfg = _cfg(shadow, **extra)
    rail_cfg = _cfg("rail", shadow=shadow, heuristic_epsilon=explore, **extra)
    arm, rail = CONTROLLERS[shadow](config=arm_cfg), CONTROLLERS["rail"](config=rail_cfg, out=None)
    arm_groups, rail_groups = _groups(world), _groups(world)
    menu_a, menu_r = make_menu(arm_cfg, envs, runners), make_menu(rail_cfg, envs, runners)
    rng = np.random.default_rng(0)
    step_budget = StepBudget("rollouts", rail_cfg.step_budget())
    arm.begin_step(1, 10, step_budget, rng)
    rail.begin_step(1, 10, step_budget, rng)
    rail._add(rail_groups, menu_r)
    seen_rounds, short = 0, False
    for rnd in range(5):
        decided = {d.group: (d.intervention.key, d.intervention.how_many)
                   for d in arm.decide(arm_groups, budget, "rollouts", menu_a)}
        decisions = rail.session.decide(budget)
        shadowed = {rail._views[d.group].index: (d.heuristic.key, d.heuristic.size)
                    for d in decisions if d.heuristic is not None}
        assert shadowed == decided, f"round {rnd}"
        assert sum(d.intervention.cost for d in decisions if d.intervenes) <= budget
        if explore < 1e-6:
            assert all(d.intervention is d.heuristic for d in decisions)  # the heuristic acted
        served = {rail._views[d.group].index for d in decisions}
        short |= len(decided) < sum(1 for i in served if not arm_groups[i].successes)
        if not any(d.intervenes for d in decisions):
            break
        seen_rounds += 1
        for d in decisions:
            if d.intervention is None:
                continue
            gi = rail._views[d.group].index
            win = rnd == 1 and gi == 0
            for gs in (arm_groups[gi], rail_groups[gi]):
                tr = copy.copy(gs.base[-1])
                tr.reward = 1.0 if win else 0.0
                gs.trajectories += [tr] * d.intervention.size
                gs.interventions.append(d.intervention.key)
                gs.spent += d.intervention.cost
            rail.session.ran(d.id, [Rollout(tr.reward, win)] * d.intervention.size, d.intervention.cost)
    rail.session.end_step()
    if budget < 10:
        assert short, "the budget served every group: the test would not see the budget's order"
    if budget < 10 or explore > 1e-6:
        return
    assert seen_rounds == (1 if shadow == "rti" else len(arm_cfg.controller.ladder))  # rti: one hint; ladder: each rung
    if extra:  # the rungs ran at their own temperatures, through the menu the learned controller chooses from
        assert arm_groups[0].interventions[:2] == ["resample@entropy:1.3", "resample@violation"]
        assert {iv.key for iv in menu_r.legal(rail_groups[0]) if iv.how_many == 2} >= set(extra["ladder"])
    assert len(arm_groups[3].interventions) == (0 if shadow == "rti" else 1)  # its capacity (2) held one rung of 2
    assert not arm_groups[2].interventions  # it had a success


def test_the_rung_rule_by_hand():
    ladder = ["a@x", "b@x", "c@y"]
    assert next_rung(ladder, [], {"a@x", "b@x"}, solved=False) == "a@x"
    assert next_rung(ladder, ["a@x"], {"a@x", "c@y"}, solved=False) == "c@y"  # b not actionable: skipped
    assert next_rung(ladder, ["a@x"], {"a@x", "b@x"}, solved=True) is None
    assert next_rung(ladder, ["a@x"], {"b@x"}, solved=False, escalates=False) is None  # rti: one hint per group
    assert asked(0, [], solved=True) and asked(1, ["a@x"], solved=False)
    assert not asked(1, ["a@x"], solved=True) and not asked(2, ["a@x"], solved=False)
    # actionable: legal (a cost) and within the room; rung_plan: in order while the rungs fit the budget
    acts = actionable([("a@x", 2.0, "A"), ("b@x", None, "B"), ("c@y", 4.0, "C")], room=3.0)
    assert acts == {"a@x": ("A", 2.0)}
    groups = [("g0", ladder, [], False, {"a@x": ("A", 2.0)}), ("g1", ladder, [], False, {"c@y": ("C", 4.0)}),
              ("g2", ladder, [], False, {"a@x": ("A", 2.0)}), ("g3", ladder, [], True, {"a@x": ("A", 2.0)}),
              ("g4", ["c@y"], [], False, {"a@x": ("A", 2.0)})]  # its own ladder has no rung it can act on
    assert rung_plan(groups, budget=5.0) == {"g0": ("a@x", "A", 2.0), "g2": ("a@x", "A", 2.0)}  # g1: 4 > 3 left
    assert rung_plan(groups, budget=100.0).keys() == {"g0", "g1", "g2"}  # g3 is solved


def test_rescues_are_counted_once_by_one_definition(world):
    """The summary's rescued groups and the per-operator ``rescued`` column use one rule: an outcome rescues a
    group when its base rollouts tied and one of its trained rollouts breaks the tie. Two interventions on one
    group both break the tie: the operators' column counts both, the group is rescued once."""
    env, r, tasks = world
    g = make_group(0, "lookup", tasks[0], [_failed(env, tasks[0], r, 0), _failed(env, tasks[0], r, 0)])
    hint = Decision(0, Intervention.parse("rubric_hint@violation", 2))
    step = Decision(0, Intervention.parse("guided_step@violation", 2))
    outs = []
    for d in (hint, step):
        win, lose = _solved(env, tasks[0], r, 0), _failed(env, tasks[0], r, 0)
        outs.append(Outcome(d, ran=True, cost=2, trajectories=[win, lose]))
        g.trajectories += [win, lose]
        g.interventions.append(d.intervention.key)
    for t in g.trajectories:
        t.status = Status.TRAINED
    per, totals = {}, {}
    m = intervention_metrics([g], outs, 0.5, per, totals)
    s = intervention_summary(per, totals, 2, 4)
    assert m["intervention/rescued_groups"] == 1 == s["rescued_groups"]
    assert sum(d["rescued"] for d in s["by_operator"].values()) == 2
    for t in outs[1].trajectories:  # the guided step's rollouts filtered out: only the hint rescued
        t.status = Status.SHIFT_REJECTED
    per, totals = {}, {}
    intervention_metrics([g], outs, 0.5, per, totals)
    assert per["guided_step@violation"]["rescued"] == 0 and per["rubric_hint@violation"]["rescued"] == 1
    assert totals["rescued_groups"] == 1


def test_rounds_never_exceed_the_budget_or_a_groups_capacity(world):
    """The protocol runs a decision only when it fits the budget and its group's capacity, and the fill spends
    exactly what is left on the groups' free slots."""
    env, renderer, _ = world
    cfg = _cfg("ladder")
    groups = _groups(world)
    for g in groups:
        g.capacity = 4
    tasks = [("lookup", g.task) for g in groups]
    ctl = CONTROLLERS["ladder"](config=cfg)
    budget = StepBudget("rollouts", sum(g.capacity for g in groups))
    ctl.begin_step(1, 10, budget, np.random.default_rng(0))
    calls = []

    def requests(idx, k):
        return [(i, None) for i in idx for _ in range(k)]

    def generate(gen):
        calls.append(gen)
        out = []
        for req in gen.requests:
            i = req[0] if isinstance(req, tuple) else req.group
            tr = copy.copy(groups[i].base[-1])
            tr.reward, tr.n_generated = 0.0, 3
            out.append(tr)
        return out

    rounds = Rounds(ctl, groups, tasks, make_menu(cfg, {"lookup": env}, {"lookup": ToolRunner(env)}), budget,
                    max_rounds=8, group_size=2, base_requests=requests)
    ran = drive(rounds.protocol(), generate)
    assert budget.remaining == 0 and budget.spent["intervention"] == sum(o.cost for o in ran)
    assert all(len(g.trajectories) == g.n_base + g.capacity for g in groups)  # every free slot, no more
    assert all(g.spent <= g.capacity for g in groups)
    assert [c.key[0] for c in calls][-1] == "fill" and {c.key[0] for c in calls[:-1]} == {"round"}


def _step_with_fresh_groups(world, controller: str, total: int, max_rounds: int):
    """The protocol over the five groups with a budget of ``total`` rollouts and fresh groups of 8 for the fill, every
    generated rollout a failure; returns (groups, budget, the generate calls as (key, requests), the outcomes)."""
    env, _, _ = world
    cfg = _cfg(controller)
    groups = _groups(world)
    tasks = [("lookup", g.task) for g in groups]
    ctl = CONTROLLERS[controller](config=cfg)
    budget = StepBudget("rollouts", total)
    ctl.begin_step(1, 10, budget, np.random.default_rng(0))
    calls = []

    def generate(gen):
        calls.append((gen.key, len(gen.requests)))
        out = []
        for req in gen.requests:
            tr = copy.copy(groups[0].base[-1])
            tr.group, tr.reward = req.group, 0.0
            out.append(tr)
        return out

    def requests(idx, k):
        from policy.engine import RolloutRequest
        return [RolloutRequest(task=tasks[i][1], env=None, system="", group=i) for i in idx for _ in range(k)]

    rounds = Rounds(ctl, groups, tasks, make_menu(cfg, {"lookup": env}, {"lookup": ToolRunner(env)}), budget,
                    max_rounds=max_rounds, group_size=8, base_requests=requests,
                    new_tasks=lambda n, key: [("lookup", groups[0].task)] * n)
    return groups, budget, calls, drive(rounds.protocol(), generate)


def test_a_one_round_controllers_fill_runs_in_its_rounds_batch(world):
    """rti decides once, so nothing is reserved for later rounds: the fresh groups the rest of the budget buys start
    beside its round, and a synchronous driver generates both in one call; the budget is spent exactly."""
    groups, budget, calls, ran = _step_with_fresh_groups(world, "rti", 40, max_rounds=8)
    hints = sum(len(o.trajectories) for o in ran)
    assert hints == 4 * 2  # groups 0 and 1: rti_how_many = 4 each (2 and 4 have successes, 3 too little capacity)
    assert calls == [(("round", 0), hints + 32)]  # the 32 left: four fresh groups of 8, beside the round
    assert budget.remaining == 0 and budget.spent["base"] == 32 and len(groups) == 5 + 4


def test_the_fill_beside_the_last_allowed_round_takes_the_whole_rest(world):
    """With ``max_rounds`` = 1 no round follows the first, so the fill that starts beside it takes everything left,
    a smaller last group included: the step's rollouts after the base batch are one batch, never a serial tail."""
    for total in range(40, 48):  # every remainder of a group of 8
        groups, budget, calls, ran = _step_with_fresh_groups(world, "ladder", total, max_rounds=1)
        assert ran and [key for key, _ in calls] == [("round", 0)], (total, calls)
        assert budget.remaining < 2 and len(groups[-1].trajectories) >= 2


def test_a_cells_own_ladder(world):
    """controller.ladder_by_cell: a cell's groups climb the cell's own rungs (an empty list: no help), other cells
    controller.ladder; the budget rule is the same."""
    env, _, _ = world
    envs, runners = {"lookup": env}, {"lookup": ToolRunner(env)}
    for cell_rungs, want in ((["guided_step@violation"], "guided_step@violation"), ([], None)):
        cfg = _cfg("ladder", ladder_by_cell={"lookup/3": list(cell_rungs)})
        ctl = CONTROLLERS["ladder"](config=cfg)
        groups = _groups(world)
        ctl.begin_step(1, 10, StepBudget("rollouts", 1000), np.random.default_rng(0))
        keys = {d.group: d.intervention.key for d in ctl.decide(groups, 1000, "rollouts", make_menu(cfg, envs, runners))}
        assert set(keys.values()) == ({want} if want else set()), keys
    other = _cfg("ladder", ladder_by_cell={"lookup/4": []})  # another cell's rule leaves level 3 on controller.ladder
    ctl = CONTROLLERS["ladder"](config=other)
    ctl.begin_step(1, 10, StepBudget("rollouts", 1000), np.random.default_rng(0))
    decided = ctl.decide(_groups(world), 1000, "rollouts", make_menu(other, envs, runners))
    assert {d.intervention.key for d in decided} == {other.controller.ladder[0]}
