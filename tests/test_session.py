"""The controller seam (controller.session) driven directly with hand-made records, as another trainer would: the
context and menu a group becomes, decide and feedback, the shadowed ladder, escalation rounds, per-group
capacity, the reward computed from a group's outcomes, the pass-rate EMA, state round trips and resume
continuity. Nothing here imports rail or policy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from processes import run
from controller import Group, Intervention, Rollout, Session, SessionSettings, Settings, branch_source
from controller import reward as R
from controller import traces as T

KEYS = ("resample@violation", "rubric_hint@violation", "guided_step@violation")


def fail(progress=0.5, item=1, turn=2, lps=(-0.5, -1.5)) -> Rollout:
    return Rollout(0.0, False, progress, item, turn, tool_calls=2, tool_failures=1, logprobs=lps, tokens=10)


def win() -> Rollout:
    return Rollout(1.0, True, 1.0, None, None, tool_calls=2, logprobs=(-0.25,), tokens=8)


def menu(sizes=(2, 4), keys=KEYS) -> list[Intervention]:
    return [Intervention(f"{k}x{n}", k, n, float(n), {f"how={k.split('@')[0]}": 1.0, "how_many": float(n)})
            for k in keys for n in sizes]


def session(tmp_path=None, **kw) -> Session:
    bandit = kw.pop("bandit", Settings())
    return Session(SessionSettings(bandit=bandit, ladder=KEYS, group_size=4, **kw), seed=0,
                   trace_dir=None if tmp_path is None else tmp_path / "traces")


def events(tmp_path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "traces" / "decisions.dsjson").read_text().splitlines()]


def test_seam_imports_neither_torch_nor_rail():
    code = ("import sys, controller.session; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'rail', 'policy')]; assert not bad, bad")
    r = run([sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr


def test_a_group_becomes_a_context_and_bandit_actions(tmp_path):
    s = session(tmp_path)
    s.begin_step(5, 20, 64)
    base = [fail(0.25, item=1, turn=1), fail(0.75, item=2, turn=3, lps=(-1.0,)), win()]
    assert branch_source(base) == 1  # the failed rollout with the most progress
    s.add([Group("g0", "calc", 3, base, menu())])
    (c,) = s.decide(32)
    ran = [Rollout(1.0, True), Rollout(0.0, False)]
    if c.intervenes:
        s.ran(c.id, ran, c.intervention.cost)
    s.end_step()
    (e,) = events(tmp_path)
    ctx = e["c"]["s"]
    assert ctx["family"] == "calc" and ctx["level"] == "3" and ctx["family_level"] == "calc/3"
    assert ctx["successes"] == 1.0 and ctx["success_rate"] == pytest.approx(1 / 3)
    assert ctx["reward_spread"] == pytest.approx((2 / 9) ** 0.5)
    assert ctx["progress_mean"] == pytest.approx((0.25 + 0.75 + 1.0) / 3) and ctx["progress_max"] == 1.0
    assert ctx["violated_item"] == "2" and ctx["violated_turn"] == 3.0
    assert ctx["tool_failure_rate"] == pytest.approx(2 / 6)
    assert ctx["logprob_mean"] == pytest.approx((-0.5 - 1.5 - 1.0 - 0.25) / 4)  # over every policy token
    assert ctx["pass_rate"] == pytest.approx(1 / 3)  # a family/level seen for the first time: its own base
    assert ctx["train_progress"] == 5 / 20 and ctx["budget_left"] == 0.5
    assert (ctx["round"], ctx["tried"], ctx["last_tried"]) == (0.0, 0.0, "none")
    # doing nothing plus every intervention, each with its cost and share of the step budget as features
    assert e["_actions"] == ["none"] + [o.name for o in menu()]
    acts = [m["a"] for m in e["c"]["_multi"]]
    assert acts[0] == {"none": 1.0, "cost": 0.0}
    assert acts[2] == {"how=resample": 1.0, "how_many": 4.0, "cost_share": 4 / 64, "cost": 4.0}
    # a group with a success: the shadowed heuristic does nothing
    assert e["_h"] == [1.0] + [0.0] * 6


def test_decide_and_feedback_reward_the_signal_added_per_unit_of_cost(tmp_path):
    s = session(tmp_path)  # every cell is new and all-failed: headroom 1
    s.begin_step(0, 10, 64)
    s.add([Group(f"g{i}", "lookup", 4, [fail()] * 4, menu()) for i in range(6)])
    decisions = s.decide(64)
    assert [c.group for c in decisions] == [f"g{i}" for i in range(6)]
    assert sum(c.intervention.cost for c in decisions if c.intervenes) <= 64
    assert all(0 < c.propensity <= 1 and c.mode == "shadow" and c.round == 0 for c in decisions)
    for c in decisions:
        if c.intervenes:  # one success in every intervention
            s.ran(c.id, [Rollout(1.0, True)] + [Rollout(0.0, False)] * (c.intervention.size - 1), c.intervention.cost)
    s.end_step()
    evs = {e["EventId"]: e for e in events(tmp_path)}
    assert len(evs) == 6
    for c in decisions:
        e = evs[c.id]
        assert e["_label_probability"] == pytest.approx(c.propensity)
        if c.intervenes:
            n = c.intervention.size
            want = R.reward([0.0] * 4, [1.0] + [0.0] * (n - 1), cost=n, unit=2.0)
            assert -e["_label_cost"] == pytest.approx(want)
            assert e["_outcome"] == {"cost": float(n), "rollouts": n, "accepted": n, "successes": 1,
                                     "headroom": 1.0}
        else:  # doing nothing earns what fresh groups earn: these all failed, so nothing
            assert e["_outcome"] == {"opportunity": 0.0} and e["_label_cost"] == 0.0


def test_escalation_asks_again_for_groups_an_intervention_left_without_success(tmp_path):
    # live with a bandit that always explores uniformly would be random; shadow with a pure heuristic climbs
    s = session(tmp_path, bandit=Settings(heuristic_epsilon=1e-9))
    s.begin_step(0, 10, 100)
    s.add([Group("stuck", "kin", 3, [fail()] * 4, menu()),
           Group("rescued", "kin", 3, [fail()] * 4, menu()),
           Group("solved", "kin", 1, [win(), fail()], menu())])
    climbed = {"stuck": [], "rescued": []}
    for rnd in range(5):
        decisions = s.decide(100)
        if not any(c.intervenes for c in decisions):
            break
        assert all(c.round == rnd for c in decisions)
        for c in decisions:
            if c.intervenes:
                climbed[c.group].append(c.intervention.key)
                rescue = c.group == "rescued" and rnd == 1  # its second rung rescues it
                out = [Rollout(1.0, True), Rollout(0.0, False)] if rescue else [Rollout(0.0, False)] * 2
                s.ran(c.id, out, c.intervention.cost)
        asked = {c.group for c in decisions}
        if rnd == 0:
            assert asked == {"stuck", "rescued", "solved"}
        else:  # only the groups still without a success, once per round
            assert asked == ({"stuck", "rescued"} if rnd == 1 else {"stuck"})
    s.end_step()
    # the heuristic climbs the ladder one untried rung per round, at the ladder's size, and stops at its top
    assert climbed == {"stuck": list(KEYS), "rescued": list(KEYS[:2])}
    evs = [e for e in events(tmp_path) if e["EventId"].startswith("s0-stuck")]
    assert [e["c"]["s"]["tried"] for e in evs] == [0.0, 1.0, 2.0, 3.0]
    assert [e["c"]["s"]["last_tried"] for e in evs] == ["none", *KEYS]
    assert [e["_actions"][e["_labelIndex"]] for e in evs] == [f"{k}x2" for k in KEYS] + ["none"]
    # failed interventions earn nothing; stopping earns what fresh groups earn (the solved group's signal, at its
    # cell's headroom 1 - 1/2, per unit of a fresh group's cost)
    assert all(-e["_label_cost"] == 0.0 for e in evs[:3])
    opp = R.opportunity([[0.0] * 4, [0.0] * 4, [1.0, 0.0]], group_cost=4, unit=2.0, headrooms=[1.0, 1.0, 0.5])
    assert -evs[3]["_label_cost"] == pytest.approx(opp) == pytest.approx(1 / 12)
    # the reward of a later round is measured against everything the group had before it
    r0, r1 = [e for e in events(tmp_path) if e["EventId"].startswith("s0-rescued")]
    assert -r0["_label_cost"] == 0.0
    assert -r1["_label_cost"] == pytest.approx(R.reward([0.0] * 6, [1.0, 0.0], cost=2, unit=2.0))
    assert R.reward([0.0] * 6, [1.0, 0.0], cost=2, unit=2.0) != R.reward([0.0] * 4, [1.0, 0.0], cost=2, unit=2.0)


def test_an_rti_heuristic_hints_once(tmp_path):
    rti = Session(SessionSettings(ladder=("rubric_hint@violation",), ladder_size=4, heuristic_escalates=False,
                                  bandit=Settings(heuristic_epsilon=1e-9)), seed=0)
    rti.begin_step(0, 10, 100)
    rti.add([Group("g", "kin", 3, [fail()] * 4, menu())])
    (c,) = rti.decide(100)
    assert c.intervention.name == "rubric_hint@violationx4"
    rti.ran(c.id, [Rollout(0.0, False)] * 4, 4)
    (c,) = rti.decide(100)  # asked again, but RTI hints once: nothing
    assert not c.intervenes
    rti.end_step()


def test_capacity_caps_a_group_and_the_budget_caps_the_step(tmp_path):
    s = session(tmp_path, bandit=Settings(heuristic_epsilon=1e-9))  # the ladder acts, nearly deterministically
    s.begin_step(0, 10, 100)
    s.add([Group("g", "calc", 3, [fail()] * 4, menu(), capacity=5.0)])  # TRL: 5 free slots
    seen = []
    for _ in range(4):
        (c,) = s.decide(100)
        if not c.intervenes:
            break
        seen.append(c.intervention.cost)
        s.ran(c.id, [Rollout(0.0, False)] * c.intervention.size, c.intervention.cost)
    s.end_step()
    assert seen == [2.0, 2.0]  # a third rung would overflow the group's slots: only "none" was left
    assert events(tmp_path)[-1]["_actions"] == ["none"]
    s.begin_step(1, 10, 100)
    s.add([Group(f"g{i}", "calc", 3, [fail()] * 4, menu()) for i in range(10)])
    assert [c.intervention.cost for c in s.decide(7) if c.intervenes] == [2.0, 2.0, 2.0]
    s.end_step()


def test_filters_and_headroom_shape_the_reward(tmp_path):
    s = session(tmp_path, bandit=Settings(heuristic_epsilon=1e-9))
    s.begin_step(0, 10, 100)
    s.add([Group("warm", "calc", 2, [fail(), fail(), fail(), win()])])
    s.decide(100)
    s.end_step()
    assert s.pass_rate == {"calc/2": 0.25}
    s.begin_step(1, 10, 100)
    s.add([Group(g, "calc", 2, [fail()] * 4, [o for o in menu() if o.size == 2]) for g in "ab"])
    decisions = s.decide(100)
    assert all(c.intervenes for c in decisions)
    for c in decisions:
        s.ran(c.id, [Rollout(1.0, True), Rollout(1.0, True)], 2)
    # the learner's filter ran after the rounds: it dropped the first rollout of every intervention
    s.end_step(accepted={c.id: [False, True] for c in decisions})
    evs = events(tmp_path)[1:]
    assert len(evs) == 2
    for e in evs:
        want = R.reward([0.0] * 4, [1.0], cost=2, unit=2.0, headroom=0.75)  # 1 - the cell's recent pass rate
        assert -e["_label_cost"] == pytest.approx(want) and want > 0
        assert e["_outcome"]["accepted"] == 1 and e["_outcome"]["headroom"] == 0.75
        assert e["c"]["s"]["pass_rate"] == 0.25
    # an EMA: 0.9 of the last value and 0.1 of this step's base pass rate (two groups of the cell, in turn)
    assert s.pass_rate["calc/2"] == pytest.approx(0.9 * (0.9 * 0.25))


def test_misuse_gets_clear_errors():
    s = session()
    s.begin_step(0, 10, 100)
    s.add([Group("g", "calc", 1, [fail()] * 2, menu())])
    with pytest.raises(ValueError, match="already added"):
        s.add([Group("g", "calc", 1, [fail()] * 2)])
    with pytest.raises(ValueError, match="unique"):
        s.add([Group("h", "calc", 1, [fail()], menu() + menu()[:1])])
    (c,) = s.decide(100)
    with pytest.raises(KeyError):
        s.ran("nope", [], 1)
    with pytest.raises(RuntimeError, match="end_step"):
        s.begin_step(1, 10, 100)
    with pytest.raises(RuntimeError, match="in progress"):
        s.state_dict()
    if c.intervenes:
        s.ran(c.id, [Rollout(0.0, False)], 2)
        with pytest.raises(KeyError, match="already"):
            s.ran(c.id, [Rollout(0.0, False)], 2)
        with pytest.raises(ValueError, match="accepted flags"):
            s.end_step(accepted={c.id: [True, True]})
    with pytest.raises(ValueError, match="budget_unit"):
        SessionSettings(budget_unit="dollars")


def drive(s: Session, steps: range, seed: int = 0) -> None:
    """A toy trainer: 6 groups a step, levels 1-4, interventions succeed more often at low levels."""
    import random

    for step in steps:
        rng = random.Random(seed * 1000 + step)
        s.begin_step(step, 40, 64)
        groups = []
        for i in range(6):
            level = rng.randint(1, 4)
            base = [win() if rng.random() < 0.5 / level else fail(rng.random(), rng.randint(0, 3), rng.randint(0, 3))
                    for _ in range(4)]
            groups.append(Group(f"g{i}", ["calc", "kin"][i % 2], level, base, menu()))
        s.add(groups)
        for _ in range(4):
            decisions = s.decide(64)
            if not any(c.intervenes for c in decisions):
                break
            for c in decisions:
                if c.intervenes:
                    p = 0.6 if c.intervention.key == "guided_step@violation" else 0.2
                    s.ran(c.id, [Rollout(float(ok), ok) for ok in (rng.random() < p for _ in range(c.intervention.size))],
                          c.intervention.cost)
        s.end_step()


def test_state_round_trip_and_resume_continue_the_same_run(tmp_path):
    bandit = Settings(min_events=20, check_every=10)
    whole = Session(SessionSettings(bandit=bandit), seed=3, trace_dir=tmp_path / "whole")
    drive(whole, range(40))
    assert whole.ctl.learned > 100
    # the same run killed after step 25's checkpoint, with step 26 half-written to its trace, then resumed
    first = Session(SessionSettings(bandit=bandit), seed=3, trace_dir=tmp_path / "resumed")
    drive(first, range(25))
    first.save(tmp_path / "session.json")
    learned = first.ctl.learned
    drive(first, range(25, 27))
    back = Session.load(tmp_path / "session.json", trace_dir=tmp_path / "resumed")
    assert back.ctl.learned == learned < first.ctl.learned
    drive(back, range(25, 40))
    a = (tmp_path / "whole" / "decisions.dsjson").read_bytes()
    b = (tmp_path / "resumed" / "decisions.dsjson").read_bytes()
    assert a == b  # byte for byte: the same decisions, rewards and learn order
    assert back.ctl.bandit.weights_equal(whole.ctl.bandit) and back.mode == whole.mode
    assert back.pass_rate == whole.pass_rate and back.ctl.transitions == whole.ctl.transitions
    assert T.replay(tmp_path / "resumed" / "decisions.dsjson").weights_equal(whole.ctl.bandit)
    # an in-memory round trip too
    c = Session(SessionSettings(bandit=bandit), seed=3)
    c.load_state_dict(json.loads(json.dumps(whole.state_dict())))
    assert c.ctl.bandit.weights_equal(whole.ctl.bandit) and c.pass_rate == whole.pass_rate
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json"):
        Session.load(tmp_path / "bad.json")


def test_the_documented_loop_runs(tmp_path):
    """docs/controller.md's complete example of another trainer, run as written (paths moved to tmp_path)."""
    import re

    doc = (Path(__file__).parents[1] / "docs" / "controller.md").read_text()
    section = doc[doc.index("## Using the controller in another trainer"):doc.index("## How a decision is made")]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    script = tmp_path / "loop.py"
    script.write_text(code.replace("/tmp/toy", str(tmp_path / "toy")))
    r = run([sys.executable, str(script)], timeout=120)
    assert r.returncode == 0, r.stderr
    events = T.read(tmp_path / "toy" / "traces" / "decisions.dsjson")
    assert len(events) >= 20 * 8 and Session.load(tmp_path / "toy" / "controller.json").ctl.learned == len(events)


def test_a_learning_reward_counts_the_signal_as_far_as_the_policy_learns(tmp_path):
    """reward = "learning": a decision's reward is its signal reward times min(1, max(0, absorbed) / scale), the
    scale an EMA of the positive absorptions from the first on; without an absorption, the signal reward."""
    signal = R.reward([0.0] * 4, [1.0, 0.0], cost=2, unit=2.0)
    assert R.learning_reward([0.0] * 4, [1.0, 0.0], 2, 2.0, absorbed=0.01, scale=0.04) == pytest.approx(signal / 4)
    assert R.learning_reward([0.0] * 4, [1.0, 0.0], 2, 2.0, absorbed=0.08, scale=0.04) == pytest.approx(signal)
    assert R.learning_reward([0.0] * 4, [1.0, 0.0], 2, 2.0, absorbed=-0.3, scale=0.04) == 0.0
    with pytest.raises(ValueError, match="finite"):
        R.learning_reward([0.0], [1.0], 2, 2.0, absorbed=float("nan"), scale=0.04)
    s = session(tmp_path, bandit=Settings(heuristic_epsilon=1e-9), reward="learning")
    s.begin_step(0, 10, 100)
    s.add([Group(g, "calc", 3, [fail()] * 4, [o for o in menu() if o.size == 2]) for g in "abc"])
    ds = s.decide(100)
    assert all(d.intervenes for d in ds)
    for d in ds:
        s.ran(d.id, [Rollout(1.0, True), Rollout(0.0, False)], 2)
    s.end_step(absorbed={ds[0].id: 0.02, ds[1].id: 0.0})  # the third has none: rewarded by its signal
    evs = {e["EventId"]: e for e in events(tmp_path)}
    assert -evs[ds[0].id]["_label_cost"] == pytest.approx(signal) and evs[ds[0].id]["_outcome"]["absorbed"] == 0.02
    assert evs[ds[1].id]["_label_cost"] == 0.0 and evs[ds[1].id]["_outcome"]["absorbed"] == 0.0
    assert -evs[ds[2].id]["_label_cost"] == pytest.approx(signal) and "absorbed" not in evs[ds[2].id]["_outcome"]
    assert s.absorbed_scale == 0.02 and s.state_dict()["absorbed_scale"] == 0.02
