"""The learned controller library: bandit learning on a synthetic problem, shadow-to-live, estimators by hand,
the reward's edge cases, DSJson traces that VW parses and that replay to the same model, state and
determinism."""

from __future__ import annotations

import json
import math
import random

import pytest
import vowpal_wabbit_next as vw

from controller import Context, Intervention, LearnedController, Settings
from controller import estimators as E
from controller import reward as R
from controller import traces as T
from controller.vw import Bandit

BEST = {"a": "x", "b": "y", "c": "z"}


def act(name: str, features: dict, cost: float) -> Intervention:
    """A bandit action: an intervention named ``name`` with these action features and cost."""
    return Intervention(name, name, 1, cost, features)


def synthetic(heuristic, n_steps=375, mode="shadow", seed=0, trace_dir=None):
    """Three contexts, three interventions (cost 1) and doing nothing (reward 0.2): the best intervention
    depends on the context and pays 0.8 of the time, the others 0.1."""
    rng = random.Random(seed)
    ctl = LearnedController(Settings(mode=mode), seed=seed, trace_dir=trace_dir)
    rewards = []
    for t in range(n_steps):
        batch = []
        for j in range(4):
            kind = rng.choice("abc")
            acts = [act(name, {"op": name}, 1.0) for name in "xyz"]
            batch.append((kind, Context(f"t{t}g{j}", {"kind": kind}, acts, heuristic=heuristic(kind))))
        for (kind, g), d in zip(batch, ctl.decide([g for _, g in batch], budget=10)):
            assert d.group == g.group
            if not d.intervenes:
                r = 0.2
            else:
                r = float(rng.random() < (0.8 if BEST[kind] == d.intervention.name else 0.1))
            ctl.feedback(d.id, r)
            rewards.append(r)
    return ctl, rewards


def test_learns_the_context_dependent_best_intervention():
    ctl, rewards = synthetic(lambda k: None, mode="live")
    late = rewards[-600:]
    best, uniform = 0.8, (0.8 + 0.1 + 0.1 + 0.2) / 4
    regret, uniform_regret = best - sum(late) / len(late), best - uniform
    assert regret < 0.35 * uniform_regret, (regret, uniform_regret)
    for kind, want in BEST.items():
        acts = [act(n, {"op": n}, 1.0) for n in "xyz"]
        (d,) = LearnedController(ctl.s, seed=1).decide([Context("q", {"kind": kind}, acts)], 10)  # fresh: not learned
        ctx = Bandit.context_json({"kind": kind}, [{"none": 1.0, "cost": 0.0}, *({"op": n, "cost": 1.0} for n in "xyz")])
        pmf = ctl.bandit.predict(ctx)
        assert pmf.index(max(pmf)) == 1 + "xyz".index(want)


def test_poor_heuristic_is_replaced_and_optimal_one_is_kept():
    poor, _ = synthetic(lambda k: "x")
    assert poor.mode == "live" and poor.transitions[0]["from"] == "shadow"
    assert poor.transitions[0]["diff_lower"] > 0
    good, _ = synthetic(lambda k: BEST[k])
    assert good.mode == "shadow" and good.transitions == []


def test_decisions_respect_the_budget_and_log_nonzero_propensities():
    ctl = LearnedController(Settings(), seed=3)
    groups = [Context(f"g{i}", {"kind": "a"}, [act("big", {"op": "big"}, 6.0), act("small", {"op": "s"}, 2.0)],
                    heuristic="big") for i in range(5)]
    ds = ctl.decide(groups, budget=7)
    assert sum(d.intervention.cost for d in ds if d.intervenes) <= 7
    assert all(0 < d.propensity <= 1 for d in ds)
    with pytest.raises(ValueError, match="heuristic"):
        ctl.decide([Context("x", {}, [act("a", {}, 1.0)], heuristic="b")], 5)


def test_decisions_are_deterministic_given_seed_and_inputs():
    a, ra = synthetic(lambda k: "x", n_steps=60, seed=5)
    b, rb = synthetic(lambda k: "x", n_steps=60, seed=5)
    assert ra == rb and a.bandit.weights_equal(b.bandit)


# ------------------------------------------------------------------------------ estimators
def test_estimators_by_hand():
    r, p, pi = [1.0, 0.0, 1.0], [0.5, 0.25, 0.5], [1.0, 0.5, 0.0]
    assert E.ips(r, p, pi).value == pytest.approx((2.0 + 0.0 + 0.0) / 3)
    assert E.snips(r, p, pi).value == pytest.approx(2.0 / (2.0 + 2.0 + 0.0))
    chosen = [0, 1, 0]
    pif = [[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]]
    q = [[0.5, 0.5], [0.2, 0.4], [0.6, 0.1]]
    terms = [0.5 + 2 * (1 - 0.5), 0.3 + 2 * (0 - 0.4), 0.1 + 0]
    assert E.dr(r, p, chosen, pif, q).value == pytest.approx(sum(terms) / 3)
    est = E.ips([1.0, 0.0], [0.5, 0.5], [1.0, 1.0], alpha=0.05)
    sd = math.sqrt(((2 - 1) ** 2 + (0 - 1) ** 2) / 1)
    assert est.lower == pytest.approx(1 - 1.959964 * sd / math.sqrt(2), rel=1e-5)
    base = [[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]
    d = E.difference(r, p, chosen, pif, base, q)
    assert d.value == pytest.approx(E.dr(r, p, chosen, pif, q).value - E.dr(r, p, chosen, base, q).value)
    with pytest.raises(ValueError, match="p = 0"):
        E.ips([1.0], [0.0], [1.0])


# ------------------------------------------------------------------------------ reward
def test_reward_edge_cases():
    assert R.signal([0, 0, 0, 0]) == 0 and R.signal([1, 0, 1, 0]) == 1.0
    # an all-failed group rescued by one accepted success out of two
    before = [0.0] * 8
    assert R.reward(before, [1.0, 0.0], cost=2, unit=2) == pytest.approx(4 * 0.1 * 0.9)
    assert R.reward(before, [1.0, 0.0], cost=4, unit=2) == pytest.approx(4 * 0.1 * 0.9 / 2)  # per unit of cost
    # the same rescue rejected by the shift filter: nothing accepted, nothing gained
    assert R.reward(before, [], cost=2, unit=2) == 0.0
    # a group that already had signal gains nothing (and is never negative)
    assert R.reward([1, 0, 1, 0], [1.0, 1.0], cost=2, unit=2) == 0.0
    # replace: the intervened rollouts alone make the group
    assert R.reward(before, [1.0, 0.0], cost=2, unit=2, compose="replace") == 1.0
    assert 0 <= R.reward(before, [1.0] * 50 + [0.0] * 50, cost=1, unit=8) <= 1.0
    assert R.opportunity([[0, 0, 1, 1], [0, 0, 0, 0]], group_cost=4, unit=2) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        R.reward(before, [1.0], cost=0, unit=2)


def test_headroom_weights_signal_by_what_is_left_to_learn():
    before = [0.0] * 8
    rescue = 4 * 0.1 * 0.9  # one accepted success of two on a dead group, at the cheapest price
    # a cell the policy cannot solve yet (pass rate 0): the full gain; one it solves 3 times in 4: a quarter
    assert R.reward(before, [1.0, 0.0], cost=2, unit=2, headroom=1.0) == pytest.approx(rescue)
    assert R.reward(before, [1.0, 0.0], cost=2, unit=2, headroom=0.25) == pytest.approx(rescue / 4)
    # a solved cell teaches nothing however much signal the rescue made; the cap applies after the weight
    assert R.reward(before, [1.0, 0.0], cost=2, unit=2, compose="replace", headroom=0.0) == 0.0
    assert R.reward(before, [1.0, 0.0], cost=1, unit=4, compose="replace", headroom=0.5) == 1.0
    # a rescue the shift filter rejected is still worth nothing
    assert R.reward(before, [], cost=2, unit=2, headroom=1.0) == 0.0
    # doing nothing: each fresh group's signal counts at its own cell's headroom
    groups = [[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 0]]
    assert R.opportunity(groups, group_cost=4, unit=2, headrooms=[0.2, 1.0, 1.0]) == \
        pytest.approx((0.2 * 1.0 + 1.0 * 0.75 + 0.0) / 3 / 2)
    assert R.opportunity(groups, group_cost=4, unit=2) == R.opportunity(groups, 4, 2, headrooms=[1.0] * 3)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="headroom"):
            R.reward(before, [1.0], cost=2, unit=2, headroom=bad)
    with pytest.raises(ValueError, match="headroom"):
        R.opportunity(groups, group_cost=4, unit=2, headrooms=[1.0])


def test_feedback_rejects_nan_and_unknown_decisions():
    ctl = LearnedController(Settings(), seed=0)
    (d,) = ctl.decide([Context("g", {"k": "a"}, [act("x", {"op": "x"}, 1.0)])], 4)
    with pytest.raises(ValueError, match="finite"):
        ctl.feedback(d.id, float("nan"))
    with pytest.raises(KeyError):
        ctl.feedback("nope", 0.5)


# ------------------------------------------------------------------------------ traces and state
def test_trace_lines_parse_with_vw_and_replay_reproduces_the_model(tmp_path):
    ctl, _ = synthetic(lambda k: "x", n_steps=80, trace_dir=tmp_path)
    lines = (tmp_path / "decisions.dsjson").read_text().splitlines()
    assert len(lines) == 320
    ws = vw.Workspace(["--cb_explore_adf", "--quiet", "-q", "sa"])
    parser = vw.DSJsonFormatParser(ws)
    for line in lines:
        rec = json.loads(line)
        keys = list(rec)
        assert all(keys.index(k) < keys.index("c") for k in ("_label_cost", "_label_probability", "_labelIndex"))
        assert rec["a"][0] == rec["_labelIndex"] + 1 and all(p > 0 for p in rec["p"])
        assert rec["_mode"] in ("shadow", "live") and abs(sum(rec["p"]) - 1) < 1e-6
        ex = parser.parse_json(line)
        labelled = [e for e in ex[1:] if e.get_label().label is not None]
        assert len(ex) == len(rec["c"]["_multi"]) + 1 and len(labelled) == 1
        ws.learn_one(ex)
    assert T.replay(tmp_path / "decisions.dsjson").weights_equal(ctl.bandit)


def test_online_shortcuts_predict_what_separate_parses_predict(tmp_path):
    """Online, one parse of each event serves both workspaces and learning labels its examples in place (no
    labelled line is rendered and parsed again). Deciding one group at a time, a bandit that parses every trace
    line's context for each workspace on its own, predicting before it learns, reproduces every logged PMF and
    reward-model prediction exactly, and ends with the same weights."""
    rng = random.Random(1)
    ctl = LearnedController(Settings(mode="live", epsilon=0.2), seed=1, trace_dir=tmp_path)
    for t in range(300):
        kind = rng.choice("abc")
        acts = [act(f"{n}{k}", {"op": n, "size": float(k)}, float(k)) for n in "xyz" for k in (1, 3)]
        (d,) = ctl.decide([Context(f"g{t}", {"kind": kind, "t": t / 300}, [a for a in acts if rng.random() < 0.8])],
                          budget=rng.choice([2, 10]))
        best = d.intervenes and d.intervention.name[0] == BEST[kind]
        ctl.feedback(d.id, float(rng.random() < (0.8 if best else 0.2)))
    b = Bandit(epsilon=0.2)
    lines = (tmp_path / "decisions.dsjson").read_text().splitlines()
    for line in lines:
        rec = json.loads(line)
        assert b.predict(rec["c"]) == rec["_pi"] and b.scores(rec["c"]) == rec["_q"]
        b.learn(line)
    assert b.weights_equal(ctl.bandit) and len(lines) == 300


def test_state_round_trip_and_resume_truncates_the_trace(tmp_path):
    ctl, _ = synthetic(lambda k: "x", n_steps=30, trace_dir=tmp_path)
    ctl.save(tmp_path / "ctl.json")
    n = ctl.learned
    # a run killed after its checkpoint had appended more events; the resumed controller drops them
    extra, _ = synthetic(lambda k: "x", n_steps=35, trace_dir=tmp_path / "other")
    with open(tmp_path / "decisions.dsjson", "a") as f:
        f.write((tmp_path / "other" / "decisions.dsjson").read_text().splitlines()[0] + "\n")
    back = LearnedController.load(tmp_path / "ctl.json", trace_dir=tmp_path)
    assert back.bandit.weights_equal(ctl.bandit) and back.mode == ctl.mode and back.learned == n
    assert len((tmp_path / "decisions.dsjson").read_text().splitlines()) == n
    g = [Context("z", {"kind": "b"}, [act(m, {"op": m}, 1.0) for m in "xyz"], heuristic="x")]
    name = lambda d: d.intervention.name if d.intervenes else None  # noqa: E731
    assert [name(d) for d in back.decide(g, 5)] == [name(d) for d in ctl.decide(g, 5)]
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        LearnedController.load(tmp_path / "bad.json")


def test_trace_evaluation_and_corrupt_traces(tmp_path):
    synthetic(lambda k: "x", n_steps=100, trace_dir=tmp_path)
    res = T.evaluate(tmp_path / "decisions.dsjson", policies=["y"])
    pol = res["policies"]
    assert res["events"] == 400 and set(pol) >= {"learned", "heuristic", "none", "uniform", "y"}
    assert pol["none"]["snips"]["value"] == pytest.approx(0.2)  # doing nothing always pays 0.2
    assert pol["learned"]["dr"]["value"] > pol["heuristic"]["dr"]["value"]
    lines = (tmp_path / "decisions.dsjson").read_text().splitlines()
    (tmp_path / "cut.dsjson").write_text("\n".join(lines[:3]) + "\n" + lines[3][:40] + "\n")
    with pytest.raises(T.TraceError, match="cut.dsjson:4"):
        T.read(tmp_path / "cut.dsjson")
    rec = json.loads(lines[0])
    bad = {"c": rec["c"], **{k: v for k, v in rec.items() if k != "c"}}
    (tmp_path / "order.dsjson").write_text(json.dumps(bad) + "\n")
    with pytest.raises(T.TraceError, match="before"):
        T.read(tmp_path / "order.dsjson")


def test_example_trainer_loop_runs_and_resumes(tmp_path):
    """The documented example of another trainer driving the controller's seam runs, checkpoints mid-way and
    keeps its trace in learn order across the restart."""
    import sys

    from processes import ROOT, run

    script = ROOT / "experiments" / "custom_trainer_example.py"
    res = run([sys.executable, str(script), "--steps", "30", "--out", str(tmp_path)], timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    events = T.read(tmp_path / "traces" / "decisions.dsjson")
    assert out["events"] == len(events) >= 30 * 8  # every group every step, and again when it escalates
    assert {e["EventId"].split("-")[0] for e in events} == {f"s{i}" for i in range(30)}
    assert any(e["c"]["s"]["round"] > 0 for e in events)
    assert (tmp_path / "controller.json").exists()


def test_a_controller_reused_from_an_earlier_trace_starts_where_it_ended(tmp_path):
    """reuse(trace): the bandit is the trace's replay, the gate's window its last events; a controller whose source
    went live starts live from its first decision, one whose source stayed in shadow starts in shadow, and this
    run's own trace holds only its own events."""
    poor, _ = synthetic(lambda k: "x", trace_dir=tmp_path / "poor")
    assert poor.mode == "live"
    fresh = LearnedController(poor.s, seed=9, trace_dir=tmp_path / "new")
    info = fresh.reuse(tmp_path / "poor" / "decisions.dsjson")
    assert info["events"] == poor.learned and info["mode"] == "live" and fresh.mode == "live"
    assert fresh.bandit.weights_equal(T.replay(tmp_path / "poor" / "decisions.dsjson"))
    assert fresh.transitions[0]["from"] == "shadow" and fresh.transitions[0]["diff_lower"] > 0
    (d,) = fresh.decide([Context("g", {"kind": "a"}, [act(n, {"op": n}, 1.0) for n in "xyz"], heuristic="x")], 5)
    assert d.mode == "live"
    fresh.feedback(d.id, 0.5)
    assert len((tmp_path / "new" / "decisions.dsjson").read_text().splitlines()) == 1
    with pytest.raises(RuntimeError, match="first decision"):
        fresh.reuse(tmp_path / "poor" / "decisions.dsjson")
    good, _ = synthetic(lambda k: BEST[k], trace_dir=tmp_path / "good")
    again = LearnedController(good.s, seed=9)
    assert again.reuse(tmp_path / "good" / "decisions.dsjson")["mode"] == "shadow" and again.mode == "shadow"
