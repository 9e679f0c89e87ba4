"""rail inside TRL's real GRPOTrainer (tier ``trl``): training steps, slots, guidance stripping, the controller's
trace and its state across a resumed run (rail/integrations/trl.py, docs/integrations.md)."""

from __future__ import annotations

import json
import math
import os

import pytest

from rail.config import ConfigError, build_config

pytestmark = pytest.mark.trl
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

G = 4  # num_generations: 2 base slots and 2 for interventions per group (controller.base_share 0.5)
TASKS = 4  # the dataset's tasks; the policy has memorized the first three


def _cfg(**controller):
    """The smoke model on level-1 tasks; a ladder whose first rungs carry guidance (a hint, a plan)."""
    c = {"ladder": ["rubric_hint@violation", "action_guide@start"],
         "menu": ["rubric_hint@violation", "action_guide@start", "resample@violation"], "how_many": [2],
         **controller}
    return build_config("smoke", sets=[{"warmstart": {"enabled": False}, "env": {"levels": [1]}, "controller": c}])


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """A policy whose groups have a spread (GRPO moves the weights only where a group's rewards differ): the
    smoke model fine-tuned on the reference trajectories of three of the dataset's four tasks, a few steps at a
    time, until at least two of them succeed in between 25 % and 75 % of sampled attempts (measured with rail's
    engine at the trainer's temperature, so the test does not hang on one machine's rounding); the fourth task's
    groups fail, and the controller intervenes on them."""
    import torch

    from policy.engine import RolloutRequest, SamplingParams, TransformersEngine
    from policy.learner import sft_loss
    from policy.model import save_policy
    from policy.tokenizer import ChatRenderer
    from rail.envs import ToolRunner
    from rail.integrations.trl import RailTRL
    from rail.policy_setup import make_policy, reference_trajectory

    rail = RailTRL(_cfg())
    rail.dataset(TASKS)
    model, tok, _ = make_policy(rail.cfg, rail.envs)
    renderer = ChatRenderer(tok)
    tasks = list(rail.tasks.values())
    demos = [reference_trajectory(rail.envs[f], t, renderer) for f, t in tasks[:3]]
    r = rail.cfg.rollout
    runners = {f: ToolRunner(rail.envs[f], r.tool_format) for f in rail.envs}
    requests = [RolloutRequest(task=t, env=runners[f], system=rail.envs[f].system_prompt(), group=k)
                for k, (f, t) in enumerate(tasks[:3]) for _ in range(20)]
    params = SamplingParams(0.7, 1.0, r.max_tokens_per_turn, r.max_turns)

    def success() -> list[float]:
        trajs = TransformersEngine(model, renderer).generate(requests, params, seed=1)
        return [sum(rail.envs[tasks[k][0]].reward(tasks[k][1], tr.steps) for tr in trajs if tr.group == k) / 20
                for k in range(3)]

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    rates = []
    for _ in range(60):
        for _ in range(5):
            loss = sft_loss(model, demos, renderer.pad)
            opt.zero_grad()
            loss.backward()
            opt.step()
        rates = success()
        if sum(0.25 <= x <= 0.75 for x in rates) >= 2:
            break
    assert sum(0.25 <= x <= 0.75 for x in rates) >= 2, f"no fine-tuning step left two tasks half solved: {rates}"
    out = tmp_path_factory.mktemp("trl-policy")
    save_policy(model, tok, out)
    return out


def _trainer(rail, policy_dir, out: str, max_steps: int):
    from trl import GRPOConfig, GRPOTrainer

    from policy.model import load_policy

    model, tok = load_policy(policy_dir)
    args = GRPOConfig(output_dir=out, max_steps=max_steps, seed=0, use_cpu=True, bf16=False, report_to=[],
                      gradient_checkpointing=False, logging_steps=1, save_steps=1, num_generations=G,
                      per_device_train_batch_size=TASKS * G, learning_rate=3e-3, temperature=0.7, beta=0.0,
                      disable_tqdm=True, shuffle_dataset=False)  # every step sees the same prompts, resumed or not
    return GRPOTrainer(model=model, reward_funcs=rail.reward, args=args, train_dataset=rail.dataset(TASKS),
                       processing_class=tok, rollout_func=rail.rollout_func, callbacks=[rail.callback])


def _spy(monkeypatch):
    """Every rollout_func result with the trajectories behind it, as the adapter hands them to TRL."""
    import rail.integrations.trl as adapter

    seen = []
    real = adapter._trl_batch

    def spy(slots, g):
        out = real(slots, g)
        seen.append((slots, out))
        return out

    monkeypatch.setattr(adapter, "_trl_batch", spy)
    return seen


def test_grpo_trainer_trains_with_rail_and_resumes_its_controller(tmp_path, policy_dir, monkeypatch):
    import torch

    from controller import traces
    from policy.records import Origin
    from rail.integrations.trl import STATE_FILE, RailTRL

    seen = _spy(monkeypatch)
    rail = RailTRL(_cfg())
    out = str(tmp_path / "run")
    trainer = _trainer(rail, policy_dir, out, max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()

    # a few steps train: finite losses, every parameter tensor moved
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert len(changed) == len(before), f"unchanged: {set(before) - set(changed)}"

    # every group has exactly num_generations members; prompts are the unguided prompt; guidance is stripped
    renderer = rail._renderer
    guided = 0
    for slots, batch in seen:
        assert all(len(members) == G for members in slots)
        assert len(batch["prompt_ids"]) == len(slots) * G
        rows = [t for members in slots for t in members]
        for t, p, c, m, lp in zip(rows, batch["prompt_ids"], batch["completion_ids"], batch["env_mask"],
                                  batch["logprobs"]):
            fam, task = next(v for v in rail.tasks.values() if v[1].id == t.task_id)
            unguided = renderer.prompt(rail.envs[fam].system_prompt(), task.prompt, rail.runners[fam].tools)
            assert p == unguided
            assert c == [tok for tok, o in zip(t.ids, t.origin) if o != Origin.GUIDANCE]
            assert m == [1 if o == Origin.POLICY else 0 for o in t.origin if o != Origin.GUIDANCE]
            assert len(lp) == len(c)
            if t.guidance is not None and (t.guidance.plan or t.guidance.hint):
                guided += 1
                assert t.prompt_ids != unguided or Origin.GUIDANCE in t.origin  # it was sampled with guidance
    assert guided > 0, "no rollout was sampled under a hint or plan: the stripping was not exercised"

    # the controller decided, and its trace parses with VW and replays to the live model
    state = rail.summary()["controller_state"]
    assert state["events"] > 0
    assert len(traces.read(state["trace"])) == state["events"]
    assert traces.replay(state["trace"]).weights_equal(rail.controller.ctl.bandit)
    saved = json.loads((tmp_path / "run" / "checkpoint-1" / STATE_FILE).read_text())
    assert saved["calls"] == 1 and saved["controller"]["learned"]["learned"] > 0

    # resumed from checkpoint-1, the second step makes the same decisions: the trace is the same, byte for byte
    full_trace = open(state["trace"]).read()
    seen.clear()
    rail2 = RailTRL(_cfg())
    trainer2 = _trainer(rail2, policy_dir, out, max_steps=2)
    trainer2.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1"))
    assert rail2.calls == 2 and len(seen) == 1
    assert open(rail2.summary()["controller_state"]["trace"]).read() == full_trace
    assert rail2.summary()["controller_state"]["events"] == state["events"]


def test_fixed_slots_refuse_what_cannot_fit(tmp_path):
    from rail.integrations.trl import RailTRL
    from rail.train import RunError

    with pytest.raises(ConfigError, match="controller.name = 'dapo'"):
        RailTRL(_cfg(name="dapo"))
    cfg = _cfg()
    cfg.budget.unit = "tokens"
    with pytest.raises(ConfigError, match="budget.unit"):
        RailTRL(cfg)
    rail = RailTRL(_cfg())
    with pytest.raises(RunError, match="callbacks=\\[rail.callback\\]"):
        rail.rollout_func([], None)
    ds = rail.dataset(3)
    p = [ds[0]["prompt"]] * G + [ds[1]["prompt"]] * (G - 1)
    with pytest.raises(RunError, match="multiple of num_generations"):
        rail._groups_of(p, G)
    with pytest.raises(RunError, match="not one prompt repeated"):
        rail._groups_of([ds[0]["prompt"]] * (G - 1) + [ds[1]["prompt"]], G)
    with pytest.raises(RunError, match="RailTRL.dataset"):
        rail._groups_of([[{"role": "user", "content": "hello"}]] * G, G)
    with pytest.raises(RunError, match="checkpoint-5/rail_controller.json cannot be read"):
        rail.begin(tmp_path, seed=0, num_generations=G, global_step=5)  # resumed without the controller's state
