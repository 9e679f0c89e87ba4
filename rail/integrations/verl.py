"""rail's interventions and learned controller in verl 0.9: an agent loop and the step hook (docs/integrations.md).

verl (GPUs, Ray, vLLM or SGLang servers) is installed by its user, without its dependency pins where they clash
with the rest of a rail install: ``pip install --no-deps -r requirements-verl.txt``. Two pieces:

* :class:`RailAgentLoop`, registered with verl's ``@register("rail_agent")``: one sample's multi-turn episode on
  verl's LLM server (token in, token out) with rail's environments, tool-call format and chat rendering
  (``policy.engine.RolloutState``, the same episode rail's own engines step). A sample row carries its task
  (``rail_task``) and, for an intervened rollout, the plan to apply (``rail_plan``: the prefix of the failed rollout
  to branch from, the hint, plan or injected step, what :func:`rail.interventions.plan` made). The output strips
  the guidance as the TRL adapter does: ``prompt_ids`` is the unguided prompt, ``response_ids`` hold no guidance
  token, ``response_mask`` is 1 on the tokens the policy sampled, ``response_logprobs`` are the behaviour
  log-probs under the guided context, ``reward_score`` is the verifier's, and ``extra_fields["rail"]`` holds the
  trajectory for the hook.
* :class:`RailAgentLoopManager`, verl's ``AgentLoopManager`` with one method more around
  ``generate_sequences``: the hook where a step's scored groups reach the controller. verl hands it every prompt
  ``rollout.n`` times (one ``uid`` per group); :class:`RailSteps` spends those slots as the TRL adapter spends
  ``num_generations`` (:mod:`rail.integrations.slots`: base slots, the controller's rounds on free slots of failed
  groups, the fill) and returns the batch in the order it came, so verl's GRPO groups by ``uid`` as ever. Select
  it with ``actor_rollout_ref.rollout.agent.agent_loop_manager_class=rail.integrations.verl.RailAgentLoopManager``
  (verl's classic trainer, ``trainer.use_v1=false``).

Both read rail's settings from the ``rail`` node of verl's config (``+rail.preset=default``,
``+rail.set=[controller.name=rail, ...]``, ``+rail.out=...``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Awaitable, Callable
from uuid import uuid4

import numpy as np

from policy.engine import RolloutRequest, RolloutState
from policy.fileio import write_text_atomic
from policy.records import Guidance, Origin, Trajectory
from policy.tokenizer import ChatRenderer
from rail.config import Config, build_config, parse_set
from rail.envs import Action, RubricItem, RubricStatus, Step, Task, ToolRunner, make_envs
from rail.integrations.slots import Slots, check
from rail.tracking import JsonlTracker
from rail.rounds import score
from rail.rundir import RunError
from verl.experimental.agent_loop.agent_loop import (AgentLoopBase, AgentLoopManager, AgentLoopMetrics,
                                                     AgentLoopOutput, register)
from verl.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto
from verl.utils.ray_utils import auto_await

log = logging.getLogger("rail")

AGENT = "rail_agent"
TRAINER = "verl"


def rail_config(node: Any) -> Config:
    """rail's Config from the ``rail`` node of verl's config: ``preset`` (default ``default``), ``set`` (a list of
    ``section.key=value``, as ``rail train --set``), ``toml`` (a rail config file)."""
    from omegaconf import OmegaConf

    from rail.config import load_toml

    node = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node or {})

    toml = load_toml(node["toml"]) if node.get("toml") else None
    cfg = build_config(str(node.get("preset", "default")), toml, [parse_set(str(s)) for s in node.get("set") or []])
    check(cfg, TRAINER)
    return cfg


# ---------------------------------------------------------------------- records as JSON (samples cross Ray actors)
def task_to_dict(task: Task) -> dict:
    return asdict(task)


def task_from_dict(d: dict) -> Task:
    def act(a: dict) -> Action:
        return Action(a["tool"], tuple(a["args"]))

    return Task(d["id"], d["family"], int(d["level"]), d["prompt"], d["answer"],
                tuple(RubricItem(r["description"], r["kind"], act(r["action"]), r.get("result"), r.get("evidence", ""))
                      for r in d["rubric"]),
                tuple(act(a) for a in d["action_guide"]))


def trajectory_to_dict(t: Trajectory) -> dict:
    """Everything a trajectory holds, as JSON-able values (the hook reads it back; a branch copies its prefix)."""
    d = {k: v for k, v in t.__dict__.items() if k not in ("steps", "rubric", "guidance")}
    d["steps"] = [{"text": s.text, "action": None if s.action is None else [s.action.tool, list(s.action.args)],
                   "observation": s.observation, "ok": s.ok, "done": s.done} for s in t.steps]
    d["rubric"] = None if t.rubric is None else asdict(t.rubric)
    d["guidance"] = None if t.guidance is None else asdict(t.guidance)
    return d


def trajectory_from_dict(d: dict) -> Trajectory:
    d = dict(d)
    steps = [Step(s["text"], None if s["action"] is None else Action(s["action"][0], tuple(s["action"][1])),
                  s["observation"], s["ok"], s["done"]) for s in d.pop("steps")]
    rb, g = d.pop("rubric"), d.pop("guidance")
    rubric = None if rb is None else RubricStatus(tuple(rb["holds"]), rb["first_violated"], rb["violated_turn"],
                                                  tuple(rb["achieved_turn"]))
    return Trajectory(**d, steps=steps, rubric=rubric, guidance=None if g is None else Guidance(**g))


def plan_to_dict(req: RolloutRequest) -> dict:
    """What an intervened sample must apply: the prefix to branch from, the guidance, what was done."""
    return {"prefix": None if req.prefix is None else trajectory_to_dict(req.prefix),
            "prefix_turns": req.prefix_turns, "guidance": None if req.guidance is None else asdict(req.guidance),
            "intervention": req.intervention}


def rows(cfg: Config, n: int, seed: int = 0) -> list[dict]:
    """``n`` training samples for verl's RLHFDataset (write them to parquet): the chat ``prompt`` (verl tokenizes it;
    the agent loop renders its own, with the tools), ``agent_name``, the task as JSON, ``data_source``,
    ``reward_model`` and ``extra_info.index``."""
    envs = make_envs(cfg.env.families, cfg.env.seed, cfg.env.options)
    rng = np.random.default_rng([seed, 7])
    out = []
    for i in range(n):
        fam = cfg.env.families[int(rng.integers(len(cfg.env.families)))]
        (task,) = envs[fam].sample_tasks(rng, cfg.env.levels, 1)
        out.append({"prompt": [{"role": "system", "content": envs[fam].system_prompt()},
                               {"role": "user", "content": task.prompt}],
                    "agent_name": AGENT, "rail_task": json.dumps(task_to_dict(task)), "data_source": f"rail/{fam}",
                    "reward_model": {"style": "rule", "ground_truth": task.answer},
                    "extra_info": {"index": i, "level": task.level}})
    return out


# ---------------------------------------------------------------------- the agent loop
#: ``generate(context_ids) -> (token ids, log-probs or None)``: one assistant turn from the LLM server
Turn = Callable[[list[int]], Awaitable[tuple[list[int], list[float] | None]]]


async def run_episode(req: RolloutRequest, renderer: ChatRenderer, generate: Turn, max_turns: int) -> Trajectory:
    """One request's episode, turn by turn on ``generate``: rail's :class:`~policy.engine.RolloutState` (prompt, copied
    prefix, guidance, an injected step, tool execution) with the turns sampled elsewhere. A turn the server cut
    before the end-of-turn token is closed with an untrained one, as rail's engine does."""
    ep, eot, clock = RolloutState(req, renderer), renderer.end_of_turn, [0.0]
    ep.inject(renderer, max_turns, clock)
    while not ep.finished:
        ids, lps = await generate(ep.context())
        turn, text = ep.traj.n_turns, []
        lps = lps if lps is not None else [0.0] * len(ids)
        for tok, lp in zip(ids, lps):
            ep.push(tok, Origin.POLICY, lp, turn)
            if tok == eot:
                break
            text.append(tok)
        else:
            ep.push(eot, Origin.TOOL, 0.0, turn)
        ep.end_turn(renderer.decode(text), renderer, max_turns, clock)
    t = ep.traj
    t.n_generated = sum(1 for o, k in zip(t.origin, t.turn) if o == Origin.POLICY and k >= t.prefix_turns)
    return t


def agent_output(t: Trajectory, metrics: AgentLoopMetrics | None = None) -> AgentLoopOutput:
    """verl's AgentLoopOutput of a scored trajectory: its training view (guidance stripped) split at the prompt."""
    ids, mask, lps, _, _ = t.training_view()
    p = len(t.context_prompt_ids)
    return AgentLoopOutput(prompt_ids=ids[:p], response_ids=ids[p:], response_mask=mask[p:], response_logprobs=lps[p:],
                           reward_score=float(t.reward), num_turns=2 * t.n_turns,
                           metrics=metrics or AgentLoopMetrics(), extra_fields={"rail": trajectory_to_dict(t)})


_SETUPS: dict = {}


def _setup(node: Any, tokenizer) -> tuple:
    """(config, environments, tool runners, renderer) for a worker process: verl makes an agent loop per sample, and
    an environment's world is built once, not per sample."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node or {})
    key = (json.dumps(plain, sort_keys=True, default=str), id(tokenizer))
    if key not in _SETUPS:
        cfg = rail_config(plain)
        envs = make_envs(cfg.env.families, cfg.env.seed, cfg.env.options)
        _SETUPS[key] = (cfg, envs, {f: ToolRunner(e, cfg.rollout.tool_format) for f, e in envs.items()},
                        ChatRenderer(tokenizer))
    return _SETUPS[key]


@register(AGENT)
class RailAgentLoop(AgentLoopBase):
    """One sample's episode with rail's environment, base or intervened (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cfg, self.envs, self.runners, self.renderer = _setup(self.config.get("rail"), self.tokenizer)

    def request(self, kwargs: dict) -> RolloutRequest:
        """The sample's rollout request: its task, and the plan of an intervened sample."""
        task = task_from_dict(json.loads(kwargs["rail_task"]))
        if task.family not in self.envs:
            raise RunError(f"rail_task {task.id}: family {task.family!r} is not in rail's env.families "
                           f"{self.cfg.env.families}; set +rail.set=[env.families=[...]] to the dataset's")
        plan = kwargs.get("rail_plan") or ""
        plan = json.loads(plan) if plan else {}
        prefix = plan.get("prefix")
        return RolloutRequest(task=task, env=self.runners[task.family], system=self.envs[task.family].system_prompt(),
                              prefix=None if prefix is None else trajectory_from_dict(prefix),
                              prefix_turns=int(plan.get("prefix_turns", 0)),
                              guidance=Guidance(**plan["guidance"]) if plan.get("guidance") else None,
                              intervention=plan.get("intervention"))

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        req = self.request(kwargs)
        params = {**sampling_params, "max_tokens": self.cfg.rollout.max_tokens_per_turn,
                  "stop_token_ids": [self.renderer.end_of_turn]}
        rid = uuid4().hex  # one sticky session per episode: its turns share the server's prefix cache

        async def turn(context: list[int]):
            out = await self.server_manager.generate(request_id=rid, prompt_ids=context, sampling_params=params)
            return list(out.token_ids), out.log_probs

        t = await run_episode(req, self.renderer, turn, self.cfg.rollout.max_turns)
        score([t], [(req.task.family, req.task)], self.envs)
        return agent_output(t)


# ---------------------------------------------------------------------- the step hook
class RailSteps:
    """The controller over a step's batch of slots: ``await step(prompts, generate)`` with ``generate`` any async
    ``DataProto -> DataProto`` that runs :class:`RailAgentLoop` on every row (verl's agent loop workers)."""

    def __init__(self, cfg: Config, n: int, out: str | Path, save_every: int = 0):
        self.out = Path(out)
        self.slots = Slots(cfg, n, self.out, TRAINER)
        self.save_every = int(save_every)  # verl's trainer.save_freq: states kept for every checkpoint it can resume
        self.step_done = 0  # the last step whose state is saved
        self._tracker = None  # <out>/metrics.jsonl, opened by the first step

    def _resume(self, step: int) -> None:
        """Before the first step this process runs: a fresh trace and metrics for a fresh run, or the state saved
        after step ``step - 1`` when verl resumed from its checkpoint at ``step``."""
        if self._tracker is not None and step - 1 == self.step_done:
            return
        if step <= 1:
            trace = self.out / "traces" / "decisions.dsjson"
            if trace.exists():
                log.warning("%s: a fresh run replaces the trace of the run before it", trace)
                trace.unlink()
        else:
            path = self.out / "state" / f"step_{step - 1:06d}.json"
            try:
                self.slots.load_state_dict(json.loads(path.read_text()))
            except (OSError, ValueError) as e:
                raise RunError(f"resuming at step {step}: {path} cannot be read ({e}); RailAgentLoopManager writes "
                               "it after every step under +rail.out") from None
        self.step_done = step - 1
        self._tracker = JsonlTracker(self.out / "metrics.jsonl", resume_step=self.step_done)

    def _save(self, step: int) -> None:
        states = self.out / "state"
        write_text_atomic(states / f"step_{step:06d}.json", json.dumps(self.slots.state_dict()))
        self.step_done = step
        for old in sorted(states.glob("step_*.json"))[:-2]:  # the last two, and every checkpoint's
            k = int(old.stem.split("_")[1])
            if not (self.save_every and k % self.save_every == 0):
                old.unlink()

    def groups(self, prompts: DataProto) -> list[list[int]]:
        """Row indices of each group: ``rollout.n`` consecutive rows of one uid."""
        uids, g = prompts.non_tensor_batch["uid"], self.slots.g
        if len(uids) % g or any(len(set(uids[i:i + g])) != 1 for i in range(0, len(uids), g)):
            raise RunError(f"the rollout batch is not groups of actor_rollout_ref.rollout.n = {g} consecutive rows "
                           "of one uid (verl's trainer repeats each prompt n times, interleaved)")
        return [list(range(i, i + g)) for i in range(0, len(uids), g)]

    async def step(self, prompts: DataProto, generate: Callable[[DataProto], Awaitable[DataProto]],
                   total_steps: int = 1) -> DataProto:
        """The step's rollouts for ``prompts`` (``rollout.n`` rows per uid), in their order; ``prompts.meta_info``
        names the step (``global_steps``)."""
        step = int(prompts.meta_info.get("global_steps", self.step_done + 1))
        self._resume(step)
        groups = self.groups(prompts)
        tasks = []
        for rows_ in groups:
            task = task_from_dict(json.loads(prompts.non_tensor_batch["rail_task"][rows_[0]]))
            tasks.append((task.family, task))
        made: list[DataProto] = []
        where: dict[int, tuple[int, int]] = {}  # id(trajectory) -> (output, row)

        async def gen(requests: list[RolloutRequest], key: tuple) -> list[Trajectory]:
            sub = prompts.select_idxs([groups[r.group][0] for r in requests])
            sub.non_tensor_batch["rail_plan"] = np.array(
                ["" if r.prefix is None and r.guidance is None else json.dumps(plan_to_dict(r)) for r in requests],
                dtype=object)
            out = await generate(sub)
            trajs = []
            for j, (r, d) in enumerate(zip(requests, out.non_tensor_batch["rail"])):
                t = trajectory_from_dict(d)
                t.group = r.group
                where[id(t)] = (len(made), j)
                trajs.append(t)
            made.append(out)
            return trajs

        views, ran, slots = await self.slots.step(tasks, step, total_steps, self.slots.cfg.run.seed, gen)
        # no shift filter here: the manager has no policy forward pass (docs/integrations.md)
        metrics = self.slots.finish(views, ran, slots)
        offsets = np.cumsum([0] + [len(o) for o in made])
        order = [int(offsets[where[id(t)][0]] + where[id(t)][1]) for s in slots for t in s]
        metas = [o.meta_info for o in made]
        for o in made:  # each call's timing differs; verl's concat insists overlapping meta_info agrees
            o.meta_info = {}
        batch = DataProto.concat(made).select_idxs(np.array(order))
        batch.meta_info = {**metas[0], "timing": _sum_timing(m.get("timing", {}) for m in metas)}
        self._save(step)
        self._tracker.log_metrics(metrics, step)
        return batch


def _sum_timing(timings) -> dict:
    """The timing of a step's generation calls together (verl logs ``timing_s/*`` from it)."""
    out: dict = {}
    for t in timings:
        for k, v in t.items():
            out[k] = out.get(k, 0.0) + v if isinstance(v, (int, float)) else v
    return out


class RailAgentLoopManager(AgentLoopManager):
    """verl's agent loop manager with rail's slots around ``generate_sequences`` (validation batches pass through)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        node = config.get("rail") or {}
        out = node.get("out") or str(Path(config.trainer.default_local_dir) / "rail")
        self.rail = RailSteps(rail_config(node), int(config.actor_rollout_ref.rollout.n), out,
                              save_every=int(config.trainer.get("save_freq", 0) or 0))

    @auto_await
    async def generate_sequences(self, prompts: DataProto) -> DataProto:
        if prompts.meta_info.get("validate", False):
            return await AgentLoopManager.generate_sequences(self, prompts)

        async def generate(batch: DataProto) -> DataProto:
            batch.meta_info = dict(prompts.meta_info)
            padded, pad = pad_dataproto_to_divisor(batch, len(self.agent_loop_workers))
            out = await AgentLoopManager.generate_sequences(self, padded)
            return unpad_dataproto(out, pad)

        total = int(self.config.actor_rollout_ref.actor.optim.get("total_training_steps") or 1)
        return await self.rail.step(prompts, generate, total)
