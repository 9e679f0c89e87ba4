"""Held-out evaluation: unguided success rate (pass@1) by family and level."""

from __future__ import annotations

from policy.engine import RolloutEngine, RolloutRequest, SamplingParams
from rail.config import Config
from rail.envs import Environment, ToolRunner, safe_reward


def evaluate(engine: RolloutEngine, envs: dict[str, Environment], cfg: Config, seed: int) -> dict[str, dict[str, float]]:
    """``{family: {level: success_rate}}`` on the held-out pools (levels as strings, as in summary.json)."""
    requests, keys = [], []
    for fam in cfg.env.families:
        env, runner = envs[fam], ToolRunner(envs[fam], cfg.rollout.tool_format)
        for level in cfg.eval.levels:
            for task in env.eval_tasks(level, cfg.eval.tasks_per_level):
                requests.append(RolloutRequest(task=task, env=runner, system=env.system_prompt()))
                keys.append((fam, str(level)))
    params = SamplingParams(temperature=cfg.eval.temperature, top_p=1.0,
                            max_tokens_per_turn=cfg.rollout.max_tokens_per_turn, max_turns=cfg.rollout.max_turns)
    trajs = engine.generate(requests, params, seed=seed)
    totals: dict[tuple[str, str], list[float]] = {}
    for (fam, lv), req, tr in zip(keys, requests, trajs):
        totals.setdefault((fam, lv), []).append(safe_reward(envs[fam], req.task, tr.steps)[0])  # a failure: 0
    out: dict[str, dict[str, float]] = {}
    for (fam, lv), rs in totals.items():
        out.setdefault(fam, {})[lv] = sum(rs) / len(rs)
    return out


def mean_over(result: dict[str, dict[str, float]], levels) -> float:
    """Mean success over families and the given levels (those present)."""
    vals = [rates[str(lv)] for rates in result.values() for lv in levels if str(lv) in rates]
    return sum(vals) / len(vals) if vals else float("nan")


def eval_metrics(result: dict[str, dict[str, float]]) -> dict[str, float]:
    return {f"eval/{fam}/level_{lv}": v for fam, rates in result.items() for lv, v in rates.items()}
