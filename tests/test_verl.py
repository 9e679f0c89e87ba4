"""rail's verl adapter on CPU (tier ``verl``): verl's own types from the installed package (AgentLoopBase,
AgentLoopOutput, TokenOutput, DataProto), rail's agent loop on a real transformers model behind verl's
``generate`` signature, and the step hook spending a batch of ``rollout.n`` slots per uid. verl's Ray workers,
vLLM/SGLang servers and trainer need GPUs and are not run here (docs/integrations.md)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.verl

N = 4  # rollout.n


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from rail.config import build_config
    from rail.envs import make_env
    from rail.policy_setup import make_policy

    sets = ["controller.ladder=['rubric_hint@violation', 'action_guide@start']",
            "controller.menu=['rubric_hint@violation', 'action_guide@start', 'resample@violation']",
            "controller.how_many=[2]", "env.levels=[1]", "eval.levels=[1]", "rollout.max_turns=3",
            f"warmstart.cache_dir='{tmp_path_factory.mktemp('verl-ws')}'"]
    from rail.config import parse_set

    cfg = build_config("smoke", sets=[parse_set(s) for s in sets])
    envs = {f: make_env(f, cfg.env.seed) for f in cfg.env.families}
    model, tok, _ = make_policy(cfg, envs)
    return {"preset": "smoke", "set": sets}, cfg, model, tok


class CpuServer:
    """verl's LLM server interface (``generate(request_id, *, prompt_ids, sampling_params) -> TokenOutput``) on a
    transformers model, sampling with rail's own sampler; it stands in for the vLLM/SGLang servers verl starts on
    GPUs."""

    def __init__(self, model, seed: int = 0):
        self.model, self.gen = model.eval(), torch.Generator().manual_seed(seed)

    async def generate(self, request_id, *, prompt_ids, sampling_params, **_):
        from policy.engine import sample_tokens
        from verl.workers.rollout.replica import TokenOutput

        ids, lps, stop = list(prompt_ids), [], set(sampling_params.get("stop_token_ids", []))
        out = []
        with torch.no_grad():
            for _ in range(int(sampling_params["max_tokens"])):
                logits = self.model(input_ids=torch.tensor([ids])).logits[:, -1]
                tok, lp = sample_tokens(logits, float(sampling_params.get("temperature", 1.0)),
                                        float(sampling_params.get("top_p", 1.0)), self.gen)
                out.append(int(tok[0]))
                lps.append(float(lp[0]))
                ids.append(int(tok[0]))
                if out[-1] in stop:
                    break
        return TokenOutput(token_ids=out, log_probs=lps)


def _loop(node, model, tok):
    from omegaconf import OmegaConf

    from rail.integrations.verl import RailAgentLoop
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    conf = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": 512, "response_length": 512}},
                             "data": {}, "rail": node})
    return RailAgentLoop(trainer_config=DictConfigWrap(conf), server_manager=CpuServer(model), tokenizer=tok,
                         processor=None, dataset_cls=None, data_config=DictConfigWrap(conf.data))


def _collate(outputs, inputs):
    """verl's AgentLoopWorker output in miniature: padded tensors and the input rows' fields plus extra_fields."""
    from verl.protocol import DataProto

    def pad(rows, left=False, w=512):  # rollout.prompt_length / response_length: every call pads to the same width
        return torch.tensor([([0] * (w - len(r)) + r) if left else (r + [0] * (w - len(r))) for r in rows])

    nt = {k: v.copy() for k, v in inputs.non_tensor_batch.items()}
    nt["rail"] = np.array([o.extra_fields["rail"] for o in outputs], dtype=object)
    return DataProto.from_dict(
        tensors={"prompts": pad([o.prompt_ids for o in outputs], left=True),
                 "responses": pad([o.response_ids for o in outputs]),
                 "response_mask": pad([o.response_mask for o in outputs]),
                 "rm_scores": torch.tensor([o.reward_score for o in outputs])},
        non_tensors=nt, meta_info={"timing": {"agent_loop/generate_sequences/mean": 0.1}})


def test_records_cross_ray_as_json(setup):
    from policy.engine import RolloutRequest, SamplingParams, TransformersEngine
    from policy.records import Guidance
    from policy.tokenizer import ChatRenderer
    from rail.envs import ToolRunner
    from rail.integrations.verl import task_from_dict, task_to_dict, trajectory_from_dict, trajectory_to_dict
    from rail.rounds import score

    _, cfg, model, tok = setup
    env = __import__("rail.envs", fromlist=["make_env"]).make_env("lookup", 0)
    (task,) = env.sample_tasks(np.random.default_rng(0), [2], 1)
    assert task_from_dict(json.loads(json.dumps(task_to_dict(task)))) == task
    engine = TransformersEngine(model, ChatRenderer(tok))
    req = RolloutRequest(task=task, env=ToolRunner(env), system=env.system_prompt(), guidance=Guidance(hint="x y"))
    (t,) = engine.generate([req], SamplingParams(max_tokens_per_turn=8, max_turns=4), seed=0)
    score([t], [("lookup", task)], {"lookup": env})
    back = trajectory_from_dict(json.loads(json.dumps(trajectory_to_dict(t))))
    assert back.training_view() == t.training_view() and back.steps == t.steps and back.rubric == t.rubric
    assert back.guidance == t.guidance and back.reward == t.reward


def test_agent_loop_runs_a_base_and_an_intervened_sample(setup):
    from policy.records import Origin
    from rail.integrations.verl import plan_to_dict, rows, trajectory_from_dict
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

    node, cfg, model, tok = setup
    loop = _loop(node, model, tok)
    row = rows(cfg, 1, seed=3)[0]
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    out = asyncio.run(loop.run(params, **row))
    assert isinstance(out, AgentLoopOutput)
    base = trajectory_from_dict(out.extra_fields["rail"])
    assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs) > 0
    assert out.reward_score == base.reward and base.n_turns >= 1

    # an intervened sample: a hint at the start, stripped from what verl trains on
    req = loop.request(row)
    req.guidance = __import__("policy.records", fromlist=["Guidance"]).Guidance(hint="lookup the answer")
    out2 = asyncio.run(loop.run(params, **row, rail_plan=json.dumps(plan_to_dict(req))))
    guided = trajectory_from_dict(out2.extra_fields["rail"])
    assert guided.prompt_ids != guided.train_prompt_ids  # it was sampled with the hint
    assert out2.prompt_ids == base.train_prompt_ids == out.prompt_ids  # verl trains on the unguided prompt
    assert out2.response_ids == [x for x, o in zip(guided.ids, guided.origin) if o != Origin.GUIDANCE]


def test_step_hook_fills_every_slot_and_the_controller_learns(setup, tmp_path):
    from controller import traces
    from rail.integrations.verl import RailSteps, rail_config, rows
    from verl.protocol import DataProto

    node, cfg, model, tok = setup
    loop = _loop(node, model, tok)
    params = {"temperature": 1.0, "top_p": 1.0, "logprobs": True}
    data = rows(cfg, 3, seed=1)
    reps = [r for r in data for _ in range(N)]
    uids = [f"u{i}" for i in range(len(data)) for _ in range(N)]
    prompts = DataProto.from_dict(non_tensors={
        "rail_task": np.array([r["rail_task"] for r in reps], dtype=object),
        "agent_name": np.array([r["agent_name"] for r in reps], dtype=object),
        "uid": np.array(uids, dtype=object)}, meta_info={"global_steps": 1})
    sizes = []

    async def generate(batch: DataProto) -> DataProto:
        sizes.append(len(batch))
        outs = [await loop.run(params, **{k: v[i] for k, v in batch.non_tensor_batch.items()})
                for i in range(len(batch))]
        return _collate(outs, batch)

    steps = RailSteps(rail_config(node), N, tmp_path / "rail")
    out = asyncio.run(steps.step(prompts, generate, total_steps=2))
    assert len(out) == len(prompts) and list(out.non_tensor_batch["uid"]) == uids  # every slot, in verl's order
    assert out.meta_info["timing"]["agent_loop/generate_sequences/mean"] == pytest.approx(0.1 * len(sizes))
    assert sizes[0] == len(data) * steps.slots.n_base and sum(sizes) == len(prompts)
    assert torch.equal(out.batch["rm_scores"],
                       torch.tensor([d["reward"] for d in out.non_tensor_batch["rail"]], dtype=torch.float32))
    state = steps.slots.summary()["controller_state"]
    assert state["events"] >= len(data)  # one decision per group in round 0, more when it escalates
    assert traces.replay(state["trace"]).weights_equal(steps.slots.controller.ctl.bandit)
    assert (tmp_path / "rail" / "state" / "step_000001.json").is_file()
    assert json.loads((tmp_path / "rail" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1

    # verl resumed at step 2 in a new process: the state saved after step 1 comes back
    again = RailSteps(rail_config(node), N, tmp_path / "rail")
    prompts.meta_info["global_steps"] = 2
    asyncio.run(again.step(prompts, generate, total_steps=2))
    assert again.slots.calls == 2
    assert again.slots.summary()["controller_state"]["events"] > state["events"]
    assert len(traces.read(state["trace"])) == again.slots.summary()["controller_state"]["events"]
