"""Intervention operators, learning from intervened rollouts (stripping, ratio, shift filter, composition) and
the fixed controllers' budget discipline, on the real environments and a tiny real transformers model."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from policy import grpo
from policy.engine import SamplingParams, TransformersEngine
from policy.learner import GRPOLearner, LearnerSettings, pad_training_views
from policy.model import build_tiny_model
from policy.records import Origin
from policy.tokenizer import ChatRenderer, build_word_tokenizer
from rail import interventions as ivs
from rail.controllers import CONTROLLERS
from rail.envs import Action, ToolRunner, make_env, rubric_status
from rail.envs.lookup import RELATIONS
from rail.interventions import Intervention
from rail.policy_setup import reference_trajectory, vocabulary


@pytest.fixture(scope="module")
def env():
    return make_env("lookup", 0)


@pytest.fixture(scope="module")
def tok(env):
    return build_word_tokenizer(vocabulary({"lookup": env}))


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(len(tok), hidden_size=32, layers=2, heads=2, kv_heads=1, intermediate_size=64,
                            max_positions=512, seed=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)


@pytest.fixture(scope="module")
def task(env):
    (t,) = [t for t in env.sample_tasks(np.random.default_rng(3), [3], 20) if t.level == 3][:1]
    return t


def failed_at_second_call(env, task, renderer):
    """A hand-made failure: the first lookup right, the second with a wrong relation, then consistent."""
    guide = list(task.action_guide)
    rel = guide[1].args[1]
    other = next(r for r in RELATIONS if r != rel)
    actions = [guide[0], Action("lookup", (guide[1].args[0], other)), *guide[2:]]
    tr = reference_trajectory(env, task, renderer, actions=actions)
    tr.reward = env.reward(task, tr.steps)
    tr.rubric = rubric_status(env, task, tr.steps)
    return tr


def plan_for(iv, src, task, env):
    return ivs.plan(iv, 0, [src], task, ToolRunner(env), env.system_prompt(), "rollouts", 12)


# ------------------------------------------------------------------------------------------ operators
def test_failed_trajectory_and_source_choice(env, tok, task):
    r = ChatRenderer(tok)
    bad = failed_at_second_call(env, task, r)
    good = reference_trajectory(env, task, r)
    good.rubric = rubric_status(env, task, good.steps)
    assert bad.reward == 0.0 and bad.rubric.first_violated == 1 and bad.rubric.violated_turn == 1
    assert ivs.source_index([good, bad]) == 1  # the failed one, even though the success has more progress
    worse = failed_at_second_call(env, task, r)
    worse.rubric = rubric_status(env, task, worse.steps[:0])  # no progress at all
    assert ivs.source_index([worse, bad]) == 1
    assert ivs.source_index([good]) is None


@pytest.mark.parametrize("how, where, turn", [
    ("resample", "violation", 1), ("resample", "before", 0), ("resample", "start", 0),
    ("rubric_hint", "violation", 1), ("rubric_hint", "start", 0),
    ("action_guide", "start", 0), ("action_guide", "violation", 1), ("guided_step", "violation", 1),
])
def test_each_operator_builds_the_expected_requests(env, tok, task, how, where, turn):
    src = failed_at_second_call(env, task, ChatRenderer(tok))
    p = plan_for(Intervention(how, where, 3), src, task, env)
    assert p is not None and p.branch_turn == turn and p.item == 1 and p.cost == 3 and len(p.requests) == 3
    req = p.requests[0]
    assert req.prefix_turns == turn and (req.prefix is src) == (turn > 0)
    g = req.guidance
    if how == "resample":
        assert g is None
    elif how == "rubric_hint":
        assert g.hint == task.rubric[1].evidence and g.plan is None and g.inject is None
    elif how == "action_guide":  # up to and including the violated item
        assert g.plan == "plan : " + " ; ".join(a.render() for a in task.action_guide[:2])
    else:
        assert g.inject == task.action_guide[1].render()
    assert req.intervention["key"] == f"{how}@{where}" and req.intervention["branch_turn"] == turn


def test_illegal_interventions_are_refused(env, tok, task):
    r = ChatRenderer(tok)
    src = failed_at_second_call(env, task, r)
    assert plan_for(Intervention("guided_step", "before", 2), src, task, env) is None
    assert plan_for(Intervention("guided_step", "start", 2), src, task, env) is None
    good = reference_trajectory(env, task, r)
    good.reward, good.rubric = 1.0, rubric_status(env, task, good.steps)
    assert ivs.legal([good], [Intervention("resample", "start", 2)]) == []  # nothing failed: nothing to fix
    first = failed_at_second_call(env, task, r)
    first.rubric = rubric_status(env, task, first.steps[:0])  # violated at turn 0: no turn before it
    assert plan_for(Intervention("resample", "before", 2), first, task, env) is None


def test_a_task_without_rubric_or_action_guide_keeps_the_operators_that_need_neither(env, tok, task):
    """docs/environments.md, "Without rubrics or action guides": resampling from the start or the most uncertain
    turn (at any temperature) stays legal; the operators and branch points that need a violated item do not."""
    import dataclasses
    bare = dataclasses.replace(task, rubric=(), action_guide=())
    src = failed_at_second_call(env, task, ChatRenderer(tok))
    src.reward, src.rubric = env.reward(bare, src.steps), rubric_status(env, bare, src.steps)
    menu = ivs.menu_items([f"{h}@{w}" for h in ivs.HOWS for w in ivs.WHERES], [2], [0.7, 1.3], 0.7)
    assert sorted({iv.key for iv in ivs.legal([src], menu)}) == [
        "resample@entropy", "resample@entropy:1.3", "resample@start", "resample@start:1.3"]
    p = plan_for(Intervention("resample", "start", 2), src, bare, env)
    assert p is not None and p.item is None and all(r.guidance is None for r in p.requests)
    # the actguide controller's plans of a fixed length need an action guide only, not a rubric
    guided = dataclasses.replace(task, rubric=())
    assert ivs.legal([src], [Intervention("action_guide", "start", 2, plan_len=1)])
    assert plan_for(Intervention("action_guide", "start", 2, plan_len=1), src, guided, env).requests[0].guidance.plan


def test_token_costs_are_cheaper_for_late_branches(env, tok, task):
    src = failed_at_second_call(env, task, ChatRenderer(tok))
    src.n_generated = sum(1 for o in src.origin if o == Origin.POLICY)
    cost = {w: ivs.plan(Intervention("resample", w, 2), 0, [src], task, ToolRunner(env), env.system_prompt(),
                        "tokens", 12).cost for w in ("start", "violation")}
    assert 0 < cost["violation"] < cost["start"]


def test_intervened_rollouts_continue_the_prefix_and_train_without_guidance(env, tok, model, task):
    r = ChatRenderer(tok)
    eng = TransformersEngine(model, r)
    src = failed_at_second_call(env, task, r)
    params = SamplingParams(temperature=1.0, max_tokens_per_turn=12, max_turns=8)
    unguided_prompt = r.prompt(env.system_prompt(), task.prompt)
    plan_id = tok.convert_tokens_to_ids("plan")
    for how in ("rubric_hint", "action_guide", "guided_step", "resample"):
        p = plan_for(Intervention(how, "violation", 2), src, task, env)
        trs = eng.generate(p.requests, params, seed=1)
        for tr in trs:
            assert tr.intervention["how"] == how and tr.prefix_turns == 1
            assert tr.steps[0] is src.steps[0]  # the prefix is the source's first turn
            ids, mask, *_ = tr.training_view()
            assert ids[: len(unguided_prompt)] == unguided_prompt
            n_guidance = sum(o == Origin.GUIDANCE for o in tr.origin)
            assert len(ids) == len(unguided_prompt) + len(tr.ids) - n_guidance and plan_id not in ids
            assert (n_guidance > 0) == (how == "rubric_hint")
            assert (tr.prompt_ids != tr.train_prompt_ids) == (how == "action_guide")
            n_src = sum(1 for t in src.turn if t < 1)
            assert ids[len(unguided_prompt): len(unguided_prompt) + n_src - 8] == src.ids[: n_src - 8]
            if how == "guided_step":  # the injected call is context, executed, never trained
                inj = [k for k, o in enumerate(tr.origin) if o == Origin.INJECTED]
                assert inj and tr.steps[1].text == task.action_guide[1].render() and tr.steps[1].ok
                assert r.decode([tr.ids[k] for k in inj]).replace(" ", "") == task.action_guide[1].render().replace(" ", "")
                *_, inj_flags = pad_training_views([tr], r.pad)
                assert int(inj_flags.sum()) == len(inj)  # flagged as injected in the training view
            assert tr.context_shifted == (how in ("rubric_hint", "action_guide"))


# ------------------------------------------------------------------------------------------ shift and ratio
def test_shift_measure_by_hand():
    train = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, 0.0, 0.0]])
    beh = torch.tensor([[-0.5, -1.0, -9.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    s = grpo.shift_measure(train, beh, mask)
    assert s.tolist() == pytest.approx([(0.5 + 1.0) / 2, 2.0])
    assert grpo.shift_measure(train, beh, torch.zeros_like(mask)).tolist() == [0.0, 0.0]


def test_luffy_shaping_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.2]])).requires_grad_()
    old = torch.log(torch.tensor([[0.25, 0.2]]))
    adv, mask = torch.tensor([[1.0, 1.0]]), torch.ones(1, 2)
    off = torch.tensor([[True, False]])
    loss, _ = grpo.policy_loss(logp, old, adv, mask,
                               grpo.LossSettings(0.2, 0.28, "token_mean", shaping_gamma=0.1), guided=off)
    # token 0: -pi/(pi+g) = -0.5/0.6, unclipped; token 1: ratio 1 -> -1
    assert float(loss.detach()) == pytest.approx((-0.5 / 0.6 - 1.0) / 2)
    loss.backward()
    # d/dlogp of -pi/(pi+g) = -pi*g/(pi+g)^2, halved by the token mean
    assert float(logp.grad[0, 0]) == pytest.approx(-0.5 * 0.1 / 0.36 / 2)


def test_guided_sft_by_hand():
    # row 0 beat its group (A = +1): a guided token (pi 0.1 stripped, 0.9 when sampled) and an unguided one;
    # row 1 (A = -1): the same tokens, never fine-tuned on
    logp = torch.log(torch.tensor([[0.1, 0.5], [0.1, 0.5]])).requires_grad_()
    old = torch.log(torch.tensor([[0.9, 0.5], [0.9, 0.5]]))
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2)
    off = torch.tensor([[True, False], [True, False]])
    loss, st = grpo.policy_loss(logp, old, adv, mask,
                                grpo.LossSettings(0.2, 0.28, "token_mean", guided_sft=0.5), guided=off)
    r = 0.1 / 0.9
    # row 0: -min(r, clip(r)) = -r, plus -0.5 log 0.1; ratio 1 -> -1. row 1: -min(-r, -0.8) = 0.8; ratio 1 -> +1
    assert float(loss.detach()) == pytest.approx((-r - 0.5 * math.log(0.1) - 1.0 + 0.8 + 1.0) / 4)
    assert st["sft_tokens"] == 1.0
    loss.backward()
    # d/dlogp: -r from the ratio, -0.5 from the supervised term; row 1's guided token is clipped (no gradient)
    assert float(logp.grad[0, 0]) == pytest.approx((-r - 0.5) / 4)
    assert float(logp.grad[1, 0]) == 0.0
    # off by default: the same call without it is the plain clipped loss
    loss0, st0 = grpo.policy_loss(logp.detach(), old, adv, mask, grpo.LossSettings(0.2, 0.28, "token_mean"), guided=off)
    assert float(loss0) == pytest.approx((-r - 1.0 + 0.8 + 1.0) / 4) and st0["sft_tokens"] == 0.0
    with pytest.raises(ValueError, match="guided_sft"):
        grpo.policy_loss(logp, old, adv, mask, grpo.LossSettings(0.2, 0.28, "token_mean", guided_sft=-1.0), guided=off)


#: plain GRPO's learner (the defaults are rail's recipe: rationalization, guided replay, shaping, rehearsal),
#: with a constant learning rate and no shift filter, which the tests below switch on one at a time
PLAIN = dict(schedule="constant", shift_threshold=float("inf"), shaping_gamma=0.0, guided_sft=0.0,
             guided_replay=False, rehearsal=0.0)


def _learner(model, tok, **kw):
    return GRPOLearner(model, LearnerSettings(**{**PLAIN, "lr": 1e-3, "epochs": 1, "minibatch_size": 8, **kw}),
                       total_steps=10, pad_id=ChatRenderer(tok).pad)


def test_learner_shift_and_ratio_match_a_hand_forward_pass(env, tok, model, task):
    r = ChatRenderer(tok)
    eng = TransformersEngine(model, r)
    src = failed_at_second_call(env, task, r)
    p = plan_for(Intervention("action_guide", "start", 2, plan_len=3), src, task, env)
    trs = eng.generate(p.requests, SamplingParams(1.0, 1.0, 12, 8), seed=4)
    learner = _learner(model, tok)
    values = learner.shift_of(trs)
    for tr, v in zip(trs, values):
        ids, mask, lps, *_ = tr.training_view()
        flags = tr.offpolicy_flags()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        sel = [k for k in range(1, len(ids)) if flags[k]]
        assert sel and all(mask[k] for k in sel)
        by_hand = sum(lps[k] - float(lp[k - 1]) for k in sel) / len(sel)
        assert v == pytest.approx(by_hand, abs=1e-4)
        # the importance ratio the loss uses on those tokens: pi(y | stripped) / pi_behaviour(y | guided)
        ratio = [math.exp(float(lp[k - 1]) - lps[k]) for k in sel]
        assert math.exp(-by_hand) == pytest.approx(math.exp(sum(math.log(x) for x in ratio) / len(ratio)), rel=1e-4)


def failed_base_group(eng, env, task, renderer):
    """A source trajectory that failed at its second call, and four base rollouts of its group, all failed."""
    src = failed_at_second_call(env, task, renderer)
    src.group = 0
    base = eng.generate(plan_for(Intervention("resample", "start", 4), src, task, env).requests,
                        SamplingParams(1.0, 1.0, 12, 8), seed=2)
    for t in base:
        t.intervention, t.reward = None, 0.0
    return src, base


def test_shift_filter_drops_trajectories_over_the_threshold(env, tok, model, task):
    r = ChatRenderer(tok)
    eng = TransformersEngine(model, r)
    src, base = failed_base_group(eng, env, task, r)
    guided = eng.generate(plan_for(Intervention("action_guide", "start", 4, plan_len=4), src, task, env).requests,
                          SamplingParams(1.0, 1.0, 12, 8), seed=3)
    for k, t in enumerate(guided):
        t.reward = float(k % 2)
    learner = _learner(model, tok)
    shifts = learner.shift_of(guided)
    thr = sorted(shifts)[1] + 1e-9  # keeps the two smallest
    learner.s = LearnerSettings(**{**learner.s.__dict__, "shift_threshold": thr})
    batch = learner.prepare(base + guided)
    rejected = [t for t in guided if t.status == "shift_rejected"]
    assert len(rejected) == 2 and all(t.shift > thr for t in rejected)
    assert not any(t is b for t in rejected for b in batch.trajectories)
    assert batch.stats["shift_rejected"] == 2 and batch.stats["shift_accepted"] == 2
    assert all(t.shift is None for t in base)  # on-policy rollouts are not measured


def test_guided_replay_trains_each_guided_rollout_again_in_its_guided_context(env, tok, model, task):
    r = ChatRenderer(tok)
    eng = TransformersEngine(model, r)
    src, base = failed_base_group(eng, env, task, r)
    guided = eng.generate(plan_for(Intervention("rubric_hint", "violation", 4), src, task, env).requests,
                          SamplingParams(1.0, 1.0, 12, 8), seed=3)
    for k, t in enumerate(guided):
        t.reward = float(k % 2)
    hint = r.encode_turn(ivs.hint_text(task, src.rubric.first_violated))
    plain = _learner(model, tok).prepare(base + guided)
    assert not any(t.status == "guided_replay" for t in plain.trajectories)
    batch = _learner(model, tok, guided_replay=True).prepare(base + guided)
    adv = {id(t): a for t, a in zip(batch.trajectories, batch.advantages)}
    trained_guided = [t for t in guided if t.status == "trained"]
    replays = [(t, a) for t, a in zip(batch.trajectories, batch.advantages) if t.status == "guided_replay"]
    assert trained_guided and len(replays) == len(trained_guided) == batch.stats["guided_replay"]
    assert len(batch.trajectories) == len(plain.trajectories) + len(replays)

    def contains(seq, sub):
        return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))

    for (copy, a), orig in zip(replays, trained_guided):
        assert a == adv[id(orig)]  # the same advantage; the group baseline is the one computed without copies
        ids, mask, lps, turns, _ = copy.training_view()
        assert contains(ids, hint) and not contains(orig.training_view()[0], hint)  # guidance kept / stripped
        assert len(ids) == len(copy.prompt_ids) + len(copy.ids) and not any(copy.offpolicy_flags())
        assert sum(mask) == sum(orig.training_view()[1])  # the same policy tokens are trained
        with torch.no_grad():  # on-policy there: the recorded behaviour log-probs are the guided context's
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        own = [k for k in range(1, len(ids)) if mask[k] and turns[k] >= copy.prefix_turns]  # not the copied prefix
        assert own and max(abs(float(lp[k - 1]) - lps[k]) for k in own) < 1e-3


def test_mix_and_replace_composition_and_probes(env, tok, model, task):
    r = ChatRenderer(tok)
    eng = TransformersEngine(model, r)
    src = failed_at_second_call(env, task, r)
    trs = eng.generate(plan_for(Intervention("resample", "start", 6), src, task, env).requests,
                       SamplingParams(1.0, 1.0, 12, 8), seed=2)
    base, inter, probe = trs[:2], trs[2:5], trs[5:]
    for t in base:
        t.intervention, t.reward = None, 0.0
    for k, t in enumerate(inter):
        t.reward = float(k == 0)
    probe[0].intervention = {**probe[0].intervention, "probe": True}
    probe[0].reward = 1.0
    learner = _learner(model, tok, mask_all_tools_failed=False)
    mix = learner.prepare(base + inter + probe)
    assert len(mix.trajectories) == 5 and probe[0].status == "probe"
    # mix: the baseline is over 5 rewards [0, 0, 1, 0, 0]
    assert mix.advantages[2] == pytest.approx((1 - 0.2) / (math.sqrt(0.16 * 5 / 4) + 1e-6), rel=1e-4)
    rep = learner.prepare(base + inter + probe, compose="replace")
    assert len(rep.trajectories) == 3 and all(t.status == "replaced" for t in base)
    assert rep.stats["replaced"] == 2 and rep.stats["probes"] == 1


# ------------------------------------------------------------------------------------------ controllers
@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from rail.config import build_config, parse_set
    from rail.train import start_run

    out = tmp_path_factory.mktemp("ctl")
    cache = tmp_path_factory.mktemp("ws")
    cfg = build_config("smoke", sets=[{"run": {"out": str(out / "run")}, "tracking": {"uri": ""},
                                       "warmstart": {"cache_dir": str(cache)}},
                                      parse_set("budget.rollouts_per_step=24"), parse_set("learner.mask_all_tools_failed=false")])
    tr, _ = start_run(cfg, show_progress=False)
    # the tiny smoke policy solves nothing: make half the tasks pay every other rollout, the rest never
    calls = {"n": 0}
    for e in tr.envs.values():
        def reward(task, steps):
            calls["n"] += 1
            return float(zlib.crc32(task.id.encode()) % 2 == 0 and calls["n"] % 2 == 0)
        e.reward = reward
    return tr


@pytest.mark.parametrize("name", list(CONTROLLERS))
@pytest.mark.parametrize("unit", ["rollouts", "tokens"])
def test_every_controller_spends_exactly_the_budget_and_never_more(trainer, name, unit):
    cfg = trainer.cfg
    cfg.controller.name, cfg.budget.unit = name, unit
    cfg.budget.tokens_per_step = 24 * 30
    trainer.ledger.unit, trainer.ledger.per_step = unit, cfg.step_budget()
    trainer.controller = CONTROLLERS[name](config=cfg)
    spent_on_interventions = 0.0
    for step in (1, 2):
        m = trainer.step(step)
        spent_on_interventions += m["budget/step_intervention"]
        used = m["budget/step_base"] + m["budget/step_intervention"]
        assert used <= m["budget/step_limit"]
        if unit == "rollouts":
            assert used == m["budget/step_limit"], f"{name} left {m['budget/step_left']} unspent"
        else:
            assert m["budget/step_left"] < cfg.budget.group_size * cfg.max_rollout_tokens
    if name in ("none", "dapo"):  # dapo refills with fresh base groups
        assert spent_on_interventions == 0
    elif unit == "rollouts":  # (a token budget may be gone after the smoke policy's long base rollouts)
        assert spent_on_interventions > 0, f"{name} never intervened"
    cfg.budget.unit = "rollouts"
    trainer.ledger.unit, trainer.ledger.per_step = "rollouts", cfg.step_budget()


def test_rehearsal_adds_the_demonstrations_nll_and_lowers_it(env, tok, model, task):
    import copy

    from policy.learner import PreparedBatch, sft_loss
    from rail.interventions import hint_text

    r = ChatRenderer(tok)
    m = copy.deepcopy(model)
    demos = [reference_trajectory(env, task, r, hint=(0, hint_text(task, 0))), reference_trajectory(env, task, r)]
    calls = []

    def source(n):
        calls.append(n)
        return demos[:n]

    with pytest.raises(ValueError, match="rehearsal_source"):
        GRPOLearner(m, LearnerSettings(rehearsal=1.0), total_steps=1, pad_id=r.pad)
    learner = GRPOLearner(m, LearnerSettings(**{**PLAIN, "lr": 1e-2, "epochs": 1, "minibatch_size": 8,
                                                "rehearsal": 0.5, "rehearsal_batch": 2}),
                          total_steps=10, pad_id=r.pad, rehearsal_source=source)
    src = failed_at_second_call(env, task, r)
    with torch.no_grad():
        before = float(sft_loss(m, demos, r.pad))
    # one trajectory at advantage 0: the policy-gradient term is 0, the loss is the rehearsal term alone
    out = learner.update(PreparedBatch([src], [0.0], {}), torch.Generator().manual_seed(0))
    assert calls == [2]
    assert out["rehearsal_nll"] == pytest.approx(before, rel=1e-4)
    assert out["loss"] == pytest.approx(0.5 * before, rel=1e-4)
    with torch.no_grad():
        assert float(sft_loss(m, demos, r.pad)) < before  # the step moved towards the demonstrations


def test_rehearsal_source_is_guided_warm_start_levels_only_and_deterministic():
    from rail.config import build_config
    from rail.policy_setup import RehearsalSource

    cfg = build_config("smoke", sets=[{"env": {"families": ["lookup", "calc", "kin"]}}])
    envs = {f: make_env(f, 0) for f in cfg.env.families}
    r = ChatRenderer(build_word_tokenizer(vocabulary(envs)))
    src = RehearsalSource(r, envs, cfg)
    src.begin_step(3)
    a = src(6)
    src.begin_step(3)
    b = src(6)
    assert [t.ids for t in a] == [t.ids for t in b]  # a resumed step rehearses the same demonstrations
    src.begin_step(4)
    assert [t.ids for t in src(6)] != [t.ids for t in a]
    assert sorted({t.family for t in a}) == ["calc", "kin", "lookup"]
    for t in a:
        assert t.level in cfg.warmstart.levels or (t.family == "kin" and t.level == 0)  # nothing beyond
        text = r.tok.decode(t.prompt_ids + t.ids)
        assert "plan :" in text or text.count("<|im_start|> user") == 2, text  # guidance kept in the context
        assert t.reward == 1.0


# ------------------------------------------------------------------ RAIL's action dimensions: entropy, temperature
def _surprisal_by_turn(tr, per_turn: dict[int, float]):
    """``tr`` with each policy token's behaviour log-prob set to ``-per_turn[turn]``: a known uncertainty per turn."""
    tr.logprobs = [-per_turn.get(t, 0.0) if o == Origin.POLICY else 0.0 for o, t in zip(tr.origin, tr.turn)]
    return tr


def test_the_entropy_branch_point_is_the_most_uncertain_executed_turn(env, tok, task):
    src = failed_at_second_call(env, task, ChatRenderer(tok))
    assert src.n_turns >= 3
    _surprisal_by_turn(src, {0: 0.1, 1: 0.2, 2: 1.5})
    assert ivs.uncertain_turn(src) == 2
    p = plan_for(Intervention("resample", "entropy", 2), src, task, env)
    assert p.branch_turn == 2 and p.requests[0].prefix_turns == 2 and p.requests[0].prefix is src
    _surprisal_by_turn(src, {0: 0.9, 1: 0.2, 2: 0.9})  # a tie goes to the earliest turn: a branch from the start
    p = plan_for(Intervention("rubric_hint", "entropy", 2), src, task, env)
    assert p.branch_turn == 0 and p.requests[0].prefix is None and p.item == 1
    # it needs no rubric: without one, resampling and a fixed-length plan may branch there, a hint may not
    src.rubric = None
    _surprisal_by_turn(src, {0: 0.1, 1: 2.0})
    assert plan_for(Intervention("resample", "entropy", 2), src, task, env).branch_turn == 1
    assert plan_for(Intervention("action_guide", "entropy", 2, plan_len=1), src, task, env).item is None
    for iv in (Intervention("rubric_hint", "entropy", 2), Intervention("action_guide", "entropy", 2),
               Intervention("resample", "violation", 2)):
        assert plan_for(iv, src, task, env) is None


def test_an_interventions_temperature_is_part_of_the_action():
    iv = Intervention.parse("resample@entropy:1.30", 2)
    assert iv.temperature == 1.3 and iv.key == "resample@entropy:1.3" and iv.features()["temperature"] == 1.3
    assert "temperature" not in Intervention.parse("resample@entropy", 2).features()
    with pytest.raises(ValueError, match="temperature"):
        Intervention.parse("resample@start:hot", 2)
    with pytest.raises(ValueError, match="temperature"):
        Intervention("resample", "start", 2, temperature=0.0)
    items = ivs.menu_items(["resample@start", "rubric_hint@violation:0.5"], [2, 4], [0.7, 1.0, 1.3], 0.7)
    # every plain entry at each size and temperature (the rollout's own as None); a named temperature only at its own
    assert [iv.key for iv in items if iv.how_many == 2] == [
        "resample@start", "resample@start:1", "resample@start:1.3", "rubric_hint@violation:0.5"]
    assert len(items) == 8 and len({(iv.key, iv.how_many) for iv in items}) == 8
    assert [iv.key for iv in ivs.menu_items(["resample@start"], [2], [], 0.7)] == ["resample@start"]


def test_a_planned_temperature_reaches_the_requests_and_the_record(env, tok, task):
    src = failed_at_second_call(env, task, ChatRenderer(tok))
    p = plan_for(Intervention("rubric_hint", "violation", 3, temperature=1.3), src, task, env)
    assert [r.temperature for r in p.requests] == [1.3] * 3
    assert p.requests[0].intervention["temperature"] == 1.3 and p.requests[0].intervention["key"].endswith(":1.3")
    assert plan_for(Intervention("rubric_hint", "violation", 3), src, task, env).requests[0].temperature is None
