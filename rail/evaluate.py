"""Held-out evaluation: unguided success rate (pass@1) by task family and level.

The rows are the tasks' ``family`` names: a family's name, or one row per category of an environment that has
several (``bfcl/base``, ``bfcl/miss_param``, ...). Pools may be finite (``bfcl`` holds a few dozen held-out tasks
of each level), so a cell can hold fewer than ``eval.tasks_per_level`` tasks; :func:`task_counts` says how many,
and :func:`overall` gives each row's success over all its tasks.
"""

from __future__ import annotations

from policy.engine import RolloutEngine, RolloutRequest, SamplingParams
from rail.config import Config
from rail.envs import Environment, ToolRunner, safe_reward


def held_out(envs: dict[str, Environment], cfg: Config) -> list[tuple[str, object]]:
    """``(family entry, task)`` for every held-out task an evaluation runs, in a fixed order."""
    return [(fam, task) for fam in cfg.env.families for level in cfg.eval.levels
            for task in envs[fam].eval_tasks(level, cfg.eval.tasks_per_level)]


def task_counts(envs: dict[str, Environment], cfg: Config) -> dict[str, dict[str, int]]:
    """``{row: {level: number of held-out tasks}}`` of an evaluation."""
    out: dict[str, dict[str, int]] = {}
    for _, task in held_out(envs, cfg):
        row = out.setdefault(task.family, {})
        row[str(task.level)] = row.get(str(task.level), 0) + 1
    return out


def evaluate(engine: RolloutEngine, envs: dict[str, Environment], cfg: Config, seed: int) -> dict[str, dict[str, float]]:
    """``{row: {level: success_rate}}`` on the held-out pools (levels as strings, as in summary.json)."""
    runners = {fam: ToolRunner(envs[fam], cfg.rollout.tool_format) for fam in cfg.env.families}
    tasks = held_out(envs, cfg)
    requests = [RolloutRequest(task=task, env=runners[fam], system=envs[fam].system_prompt()) for fam, task in tasks]
    params = SamplingParams(temperature=cfg.eval.temperature, top_p=1.0,
                            max_tokens_per_turn=cfg.rollout.max_tokens_per_turn, max_turns=cfg.rollout.max_turns)
    trajs = engine.generate(requests, params, seed=seed)
    totals: dict[tuple[str, str], list[float]] = {}
    for (fam, task), tr in zip(tasks, trajs):  # a verifier failure scores 0
        totals.setdefault((task.family, str(task.level)), []).append(safe_reward(envs[fam], task, tr.steps)[0])
    out: dict[str, dict[str, float]] = {}
    for (row, lv), rs in totals.items():
        out.setdefault(row, {})[lv] = sum(rs) / len(rs)
    return out


def overall(result: dict[str, dict[str, float]], counts: dict[str, dict[str, int]]) -> dict[str, float]:
    """Each row's success over all its held-out tasks (the cells weighted by their task counts)."""
    out = {}
    for row, rates in result.items():
        n = {lv: counts.get(row, {}).get(lv, 0) for lv in rates}
        total = sum(n.values())
        if total:
            out[row] = sum(rates[lv] * n[lv] for lv in rates) / total
    return out


def mean_over(result: dict[str, dict[str, float]], levels) -> float:
    """Mean success over families and the given levels (those present)."""
    vals = [rates[str(lv)] for rates in result.values() for lv in levels if str(lv) in rates]
    return sum(vals) / len(vals) if vals else float("nan")


def eval_metrics(result: dict[str, dict[str, float]], counts: dict[str, dict[str, int]] | None = None) -> dict[str, float]:
    m = {f"eval/{fam}/level_{lv}": v for fam, rates in result.items() for lv, v in rates.items()}
    if counts is not None:
        m.update({f"eval/{row}/all": v for row, v in overall(result, counts).items()})
    return m
