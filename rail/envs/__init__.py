"""Environment families and the registry the config and the trainer look names up in.

An ``env.families`` entry is a built-in name (:data:`ENVIRONMENTS`, the synthetic families; :data:`EXTRAS`, the
ones an optional extra provides) or an import path ``package.module:Class`` of your own environment, constructed
as ``Class(seed=env.seed, **env.options[entry])``. :func:`check_family` refuses a bad entry before anything runs
(the config's validation calls it), with a message naming the entry and what is missing.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys

from rail.envs.base import (
    MESSAGE,
    Action,
    Environment,
    Episode,
    EpisodeRunner,
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

#: The built-in synthetic families.
ENVIRONMENTS = {"lookup": LookupEnv, "calc": CalcEnv, "kin": KinEnv}
#: Built-in families an optional extra provides: name -> (import path, extra). Imported only when named.
EXTRAS = {"bfcl": ("rail.envs.bfcl:BfclEnv", "bfcl")}

#: What an environment class must have (docs/environments.md): methods, and pairs of which it needs one.
REQUIRED = ("system_prompt", "tools", "sample_tasks", "eval_tasks", "reward")
ONE_OF = (("execute", "start"), ("item_holds", "rubric_achieved"))


def _import(entry: str) -> type:
    """The object an import path ``package.module:Class`` names; the current directory is importable, as for
    ``python -m``, so ``experiments.my_env:MyEnv`` works from the repository root with the ``rail`` script too."""
    module_name, _, attr = entry.partition(":")
    if not module_name or not attr:
        raise ValueError(f"'{entry}': an import path is package.module:Class")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure to import is the entry's error
        raise ValueError(f"'{entry}': cannot import module '{module_name}' ({type(e).__name__}: {e})") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"'{entry}': module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    return obj


def family_class(entry: str) -> type:
    """The environment class of an ``env.families`` entry (ValueError naming the entry when there is none)."""
    if entry in ENVIRONMENTS:
        return ENVIRONMENTS[entry]
    if entry in EXTRAS:
        path, extra = EXTRAS[entry]
        try:
            return _import(path)
        except ValueError as e:
            raise ValueError(f"'{entry}' needs the {extra} extra ({e}); install it with pip install -e \".[{extra}]\" "
                             f"and pip install --no-deps -r requirements-{extra}.txt (docs/environments.md)") from None
    if ":" not in entry:
        raise ValueError(f"unknown environment '{entry}'; valid: {', '.join([*ENVIRONMENTS, *EXTRAS])}, "
                         "or an import path package.module:Class")
    return _import(entry)


def check_family(entry: str, options: dict | None = None) -> type:
    """The class of ``entry`` after checking, without constructing it, that it satisfies the protocol and takes
    ``options`` as keyword arguments; ValueError naming the entry and what is missing otherwise."""
    cls = family_class(entry)
    if not isinstance(cls, type):
        raise ValueError(f"'{entry}' is a {type(cls).__name__}, not an environment class")
    missing = [m for m in REQUIRED if not callable(getattr(cls, m, None))]
    missing += [" or ".join(pair) for pair in ONE_OF if not any(callable(getattr(cls, m, None)) for m in pair)]
    if missing:
        raise ValueError(f"'{entry}' is not an environment: {cls.__qualname__} lacks {', '.join(missing)} "
                         "(the protocol: docs/environments.md)")
    try:
        inspect.signature(cls).bind(seed=0, **(options or {}))
    except TypeError as e:
        call = ", ".join(["seed=...", *(f"{k}=..." for k in options or {})])
        raise ValueError(f"'{entry}' cannot be constructed as {cls.__qualname__}({call}): {e}") from None
    return cls


def make_env(entry: str, seed: int, options: dict | None = None) -> Environment:
    """The environment family ``entry`` with world seed ``seed`` and keyword ``options``."""
    env = check_family(entry, options)(seed=seed, **(options or {}))
    levels = getattr(env, "levels", None)
    if not levels or not all(isinstance(lv, int) for lv in levels):
        raise ValueError(f"'{entry}' is not an environment: its levels are {levels!r}, not a non-empty tuple of ints")
    return env


def make_envs(families, seed: int, options: dict | None = None) -> dict[str, Environment]:
    """``{entry: environment}`` for ``env.families``, ``env.seed`` and ``env.options``."""
    return {f: make_env(f, seed, (options or {}).get(f)) for f in families}


__all__ = [
    "Action", "CalcEnv", "ENVIRONMENTS", "EXTRAS", "Environment", "Episode", "EpisodeRunner", "KinEnv", "LookupEnv",
    "MESSAGE", "RubricItem", "RubricStatus", "Step", "Task", "ToolRunner", "check_family", "family_class", "make_env",
    "make_envs", "parse_action", "rubric_status", "safe_reward",
]
