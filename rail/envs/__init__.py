"""Environment families and the registry the config and the trainer look names up in."""

from __future__ import annotations

from rail.envs.base import (
    Action,
    Environment,
    RubricItem,
    RubricStatus,
    Step,
    Task,
    ToolRunner,
    parse_action,
    rubric_status,
    safe_reward,
)
from rail.envs.calc import CalcEnv
from rail.envs.kin import KinEnv
from rail.envs.lookup import LookupEnv

ENVIRONMENTS = {"lookup": LookupEnv, "calc": CalcEnv, "kin": KinEnv}


def make_env(name: str, seed: int) -> Environment:
    """The environment family ``name`` with world seed ``seed``."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment '{name}'; valid: {', '.join(ENVIRONMENTS)}")
    return ENVIRONMENTS[name](seed=seed)


__all__ = [
    "Action", "CalcEnv", "ENVIRONMENTS", "Environment", "KinEnv", "LookupEnv", "RubricItem", "RubricStatus", "Step",
    "Task", "ToolRunner", "make_env", "parse_action", "rubric_status", "safe_reward",
]
