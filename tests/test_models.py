"""Your own model: tool schemas and tool-call formats, a byte-level BPE checkpoint with a tools-aware chat
template (experiments/make_tiny_model.py), the warm start and a smoke run on it, and the importance-sampling
correction between the engine's and the learner's log-probs."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from policy.engine import RolloutRequest, SamplingParams, TransformersEngine
from policy.grpo import LossSettings, policy_loss
from policy.learner import GRPOLearner, LearnerSettings
from policy.model import load_policy
from policy.records import Origin
from policy.tokenizer import ChatRenderer
from rail.config import ConfigError, build_config, parse_set, validate
from rail.envs import Action, ToolRunner, make_env
from rail.envs.toolcalls import FORMATS, arguments_of, get_format
from rail.policy_setup import reference_trajectory
from rail.train import start_run

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("lookup", "calc", "kin")


def _make_tiny():
    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "experiments" / "make_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    _make_tiny().build(out)
    return out


# ---------------------------------------------------------------------------- tool formats
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_reference_call_renders_and_parses_back(family, fmt):
    env = make_env(family, 0)
    runner = ToolRunner(env, fmt)
    rng = np.random.default_rng(0)
    for task in env.sample_tasks(rng, env.levels, 20):
        for a in task.action_guide:
            text = runner.render(a)
            assert runner.format.parse(text, runner.tools) == a, (fmt, text)
            assert runner.step(task, text).ok


def test_schemas_name_and_type_the_arguments():
    env = make_env("calc", 0)
    (calc, answer) = env.tools()
    assert calc["type"] == "function" and calc["function"]["name"] == "calc"
    params = calc["function"]["parameters"]
    assert list(params["properties"]) == ["a", "op", "b"] and params["required"] == ["a", "op", "b"]
    assert params["properties"]["op"]["enum"] == ["+", "-", "*"]
    assert arguments_of(Action("calc", ("12", "+", "7")), env.tools()) == {"a": 12, "op": "+", "b": 7}
    assert answer["function"]["parameters"]["properties"]["number"]["type"] == "integer"


@pytest.mark.parametrize("text", [
    "",
    "lookup(e1, mother)",  # the builtin grammar is not a hermes call
    "<tool_call>{\"name\": \"lookup\", \"arguments\": {\"entity\": \"e1\"}}</tool_call>",  # missing argument
    "<tool_call>{\"name\": \"lookup\", \"arguments\": {\"entity\": \"e1\", \"relation\": \"boss\", \"x\": 1}}</tool_call>",
    "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>",  # not a listed tool
    "<tool_call>{\"name\": \"lookup\", \"arguments\": {\"entity\": 3, \"relation\": \"boss\"}}</tool_call>",  # type
    "<tool_call>{\"name\": \"answer\", \"arguments\": {\"entity\": \"e1\"}}</tool_call>" * 2,  # two calls
    "<tool_call>{\"name\": \"answer\", \"arguments\": {\"entity\": \"e1\"}",  # unterminated
    "<tool_call>{'name': 'answer', 'arguments': {'entity': 'e1'}}</tool_call>",  # Python, not JSON
    "<tool_call>" + "[" * 100_000 + "</tool_call>",  # deep nesting
])
def test_malformed_hermes_calls_become_error_observations(text):
    env = make_env("lookup", 0)
    runner = ToolRunner(env, "hermes")
    (task,) = env.sample_tasks(np.random.default_rng(0), [1], 1)
    step = runner.step(task, text)
    assert step.action is None and not step.ok and not step.done and step.observation.startswith("error")


def test_json_format_accepts_arguments_as_a_json_string_and_text_around_hermes_blocks():
    env = make_env("lookup", 0)
    fmt, tools = get_format("json"), env.tools()
    call = {"name": "lookup", "arguments": json.dumps({"entity": "e4", "relation": "boss"})}
    assert fmt.parse(json.dumps(call), tools) == Action("lookup", ("e4", "boss"))
    text = 'I will look it up.\n<tool_call>\n{"name": "answer", "arguments": {"entity": "e9"}}\n</tool_call>'
    assert get_format("hermes").parse(text, tools) == Action("answer", ("e9",))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_python_in_a_tool_call_is_never_executed(tmp_path, fmt):
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    texts = {
        "builtin": [f"lookup({payload}, mother)", f"answer({payload})", payload],
        "hermes": [f'<tool_call>{{"name": "lookup", "arguments": {{"entity": "{payload}", "relation": "boss"}}}}'
                   "</tool_call>", f"<tool_call>{payload}</tool_call>", f'<tool_call>{{"name": {payload}}}</tool_call>'],
        "json": [f'{{"name": "answer", "arguments": {{"entity": "{payload}"}}}}', payload],
    }[fmt]
    for family in ("lookup", "calc"):
        env = make_env(family, 0)
        runner = ToolRunner(env, fmt)
        (task,) = env.sample_tasks(np.random.default_rng(0), [1], 1)
        for text in texts:
            step = runner.step(task, text)
            assert env.reward(task, [step]) == 0.0
    assert not marker.exists()


# ---------------------------------------------------------------------------- the tiny BPE checkpoint
def test_tiny_model_is_a_byte_level_bpe_qwen2_with_a_tools_template(tiny_dir):
    model, tok = load_policy(tiny_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert type(tok.backend_tokenizer.model).__name__ == "BPE"
    env = make_env("lookup", 0)
    ids = ChatRenderer(tok).prompt(env.system_prompt(), "start at e1 .", env.tools())
    text = tok.decode(ids)
    assert "<tools>" in text and '"name": "lookup"' in text and "<tool_call>" in text
    # the template lists tools only when asked
    assert "<tools>" not in tok.decode(ChatRenderer(tok).prompt(env.system_prompt(), "start at e1 ."))


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_rendering_equals_the_templates_rendering(tiny_dir, family):
    """What the engine builds token by token (prompt, each turn's tokens, tool suffixes) is exactly what the chat
    template renders for the whole conversation, and every piece tokenises back to the same ids."""
    _, tok = load_policy(tiny_dir)
    r = ChatRenderer(tok)
    env = make_env(family, 0)
    runner = ToolRunner(env, "hermes")
    for task in env.sample_tasks(np.random.default_rng(1), env.levels[:3], 6):
        tr = reference_trajectory(env, task, r, tool_format="hermes")
        messages = [{"role": "system", "content": env.system_prompt()}, {"role": "user", "content": task.prompt}]
        for step in tr.steps:
            messages.append({"role": "assistant", "content": step.text})
            if not step.done:
                messages.append({"role": "tool", "content": step.observation})
        full = r._ids(messages, generation_prompt=False, tools=runner.tools)
        assert tr.prompt_ids + tr.ids + r._after_turn == full
        assert tok.encode(tok.decode(tr.prompt_ids + tr.ids), add_special_tokens=False) == tr.prompt_ids + tr.ids


def test_sampled_turns_decode_to_the_text_the_environment_executes(tiny_dir):
    model, tok = load_policy(tiny_dir)
    r = ChatRenderer(tok)
    env = make_env("calc", 0)
    runner = ToolRunner(env, "hermes")
    reqs = [RolloutRequest(task=t, env=runner, system=env.system_prompt())
            for t in env.sample_tasks(np.random.default_rng(2), [1, 2], 8)]
    for tr in TransformersEngine(model, r).generate(reqs, SamplingParams(1.0, 1.0, 24, 3), seed=0):
        for t, step in enumerate(tr.steps):
            sampled = [i for i, o, k in zip(tr.ids, tr.origin, tr.turn) if k == t and o == Origin.POLICY
                       and i != r.end_of_turn]
            assert tok.decode(sampled, skip_special_tokens=True) == step.text
            # the prompt tokenises back to the same ids; a sampled turn is kept as sampled, never re-tokenised
            assert tok.encode(tok.decode(tr.prompt_ids), add_special_tokens=False) == tr.prompt_ids


def test_smoke_run_trains_a_bpe_checkpoint_in_hermes_format_with_interventions(tmp_path, tiny_dir):
    """End to end on the BPE checkpoint in its own format, all three families. The warm start is the smoke
    preset's (20 steps): too short for a random model to write well-formed calls itself, so the ladder's first
    rung is a guided step, a reference call written in the hermes format and executed; hints and plans follow."""
    cfg = build_config("smoke", sets=[{"run": {"out": str(tmp_path / "run"), "steps": 2}, "tracking": {"uri": ""},
                                       "warmstart": {"cache_dir": str(tmp_path / "ws"), "batch_size": 8},
                                       "model": {"path": str(tiny_dir)},
                                       # short episodes: a random model writes to the turn limit every turn
                                       "rollout": {"max_turns": 3}, "env": {"levels": [1, 2]},
                                       "eval": {"tasks_per_level": 2, "levels": [1, 2]},
                                       # every group fails, so only the rehearsal term trains: keep them
                                       "learner": {"drop_zero_variance": False}},
                                      parse_set("rollout.tool_format='hermes'"), parse_set("controller.name='ladder'"),
                                      parse_set('controller.ladder=["guided_step@violation", "rubric_hint@violation", '
                                                '"action_guide@start"]')])
    assert cfg.rollout.max_tokens_per_turn == 64  # 0 resolves by tool format
    trainer, out = start_run(cfg, show_progress=False)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    s = trainer.run()
    assert s["model"]["source"] == str(tiny_dir) and s["model"]["warmstart"].startswith("trained")
    tc = s["tool_calls"]
    assert tc["calls"] > 0 and tc["calls"] - tc["failed"] > 0, tc  # well-formed hermes calls were executed
    ops = s["interventions"]["by_operator"]
    assert ops["guided_step@violation"]["rollouts"] > 0 and ops["rubric_hint@violation"]["rollouts"] > 0, ops
    assert set(s["eval"]["final"]) == set(FAMILIES)
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the GRPO steps updated the model
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "rollout/reward_mean" in x]
    assert len(steps) == 2 and all(not m.get("loss/skipped") and math.isfinite(m["loss/loss"]) for m in steps)
    # the checkpoint under model.path was not written to: the warm-started model lives in the cache
    assert load_policy(tiny_dir)[0].state_dict()["model.norm.weight"].eq(1).all()


# ---------------------------------------------------------------------------- engine vs learner log-probs
def test_truncated_importance_weight_scales_the_policy_gradient_term():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = logp.detach().clone()
    adv = torch.ones(1, 3)
    mask = torch.ones(1, 3)
    w = torch.tensor([[1.0, 0.5, 3.0]])
    plain, _ = policy_loss(logp, old, adv, mask, LossSettings(0.2, 0.2, "token_mean"))
    weighted, _ = policy_loss(logp, old, adv, mask, LossSettings(0.2, 0.2, "token_mean"), is_weight=w)
    # at ratio 1 each token's term is -A: the weighted mean is -(1 + 0.5 + 3) / 3
    assert plain.item() == pytest.approx(-1.0) and weighted.item() == pytest.approx(-4.5 / 3)
    with pytest.raises(ValueError):
        policy_loss(logp, old, adv, mask, LossSettings(0.2, 0.2, "token_mean"), is_weight=torch.ones(1, 2))


def test_recompute_replaces_engine_logprobs_and_truncates_the_ratio(tiny_dir):
    model, tok = load_policy(tiny_dir)
    r = ChatRenderer(tok)
    env = make_env("lookup", 0)
    reqs = [RolloutRequest(task=t, env=ToolRunner(env, "hermes"), system=env.system_prompt())
            for t in env.sample_tasks(np.random.default_rng(3), [1], 4)]
    trajs = TransformersEngine(model, r).generate(reqs, SamplingParams(1.0, 1.0, 8, 2), seed=0)
    exact = [list(t.logprobs) for t in trajs]
    # the engine's log-prob was: the learner's, 5x less likely (ratio 5, truncated to 3), 10x more likely (0.1)
    shifts = {0: 0.0, 1: math.log(5.0), 2: -math.log(10.0)}
    for t in trajs:
        pol = [k for k, o in enumerate(t.origin) if o == Origin.POLICY]
        for j, k in enumerate(pol):
            t.logprobs[k] -= shifts[j % 3]
    learner = GRPOLearner(model, LearnerSettings(old_logprobs="recompute", tis_cap=3.0, rehearsal=0.0), total_steps=1,
                          pad_id=r.pad)
    stats = learner.recompute_logprobs(trajs)
    for t, ex in zip(trajs, exact):
        pol = [k for k, o in enumerate(t.origin) if o == Origin.POLICY]
        for j, k in enumerate(pol):
            assert t.logprobs[k] == pytest.approx(ex[k], abs=1e-5)  # the learner's own log-prob
            assert t.engine_logprobs[k] == pytest.approx(ex[k] - shifts[j % 3], abs=1e-6)
            assert t.is_weights[k] == pytest.approx(min(math.exp(shifts[j % 3]), 3.0), rel=1e-4)
        assert all(w == 1.0 for w, o in zip(t.is_weights, t.origin) if o != Origin.POLICY)
    assert stats["tis_ratio_max"] == pytest.approx(5.0, rel=1e-3)
    assert 0 < stats["tis_truncated_share"] < 1


# ---------------------------------------------------------------------------- config
def test_model_config_fields_are_checked():
    with pytest.raises(ConfigError, match="rollout.tool_format"):
        validate(build_config("smoke", sets=[parse_set("rollout.tool_format='xml'")]))
    with pytest.raises(ConfigError, match="learner.tis_cap"):
        validate(build_config("smoke", sets=[parse_set("learner.tis_cap=0.5")]))
    with pytest.raises(ConfigError, match="rollout.engine"):
        validate(build_config("smoke", sets=[parse_set("rollout.engine='sglang'")]))
    cfg = build_config("smoke")
    validate(cfg)
    assert cfg.rollout.max_tokens_per_turn == 12  # builtin format
