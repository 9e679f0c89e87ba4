"""Fault and bad-input cases (docs/faults.md): each gets a recovered run or one line naming the file or field
and the fix; never a traceback, a silently forked or corrupted run, or a finished step lost.

Runs share one finished smoke run (a module fixture) and copy it before damaging it; the few cases that need a
process of their own run the CLI on a cut-down smoke preset."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rail.config import Config, ConfigError, build_config, parse_set

ROOT = Path(__file__).resolve().parents[1]
RAIL = [sys.executable, "-m", "rail.cli"]


def cli(*args, cwd=None, env=None, timeout=300):
    return subprocess.run([*RAIL, *args], cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def one_line_error(r, *needles, rc=None):
    """The process failed with one ``rail: ...`` line on stderr that names every needle, and no traceback."""
    assert r.returncode != 0 and (rc is None or r.returncode == rc), (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("rail:")]
    assert len(lines) == 1, r.stderr[-2000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ---------------------------------------------------------------------------- config values
def _float_fields():
    cfg = Config()
    for sec in dataclasses.fields(Config):
        for f in dataclasses.fields(getattr(cfg, sec.name)):
            if f.type in ("float", float):
                yield f"{sec.name}.{f.name}", f.metadata.get("allow_inf", False)


@pytest.mark.parametrize("key,allow_inf", list(_float_fields()))
def test_every_float_field_refuses_nan_and_inf(key, allow_inf):
    # rollout.temperature=nan ran to the end, learner.lr=nan died in torch: every float is checked generically
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + " = nan: must be a finite number"):
        build_config("smoke", sets=[parse_set(f"{key}=nan")])
    if allow_inf:
        assert build_config("smoke", sets=[parse_set(f"{key}=inf")])
    else:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            build_config("smoke", sets=[parse_set(f"{key}=-inf")])


def test_negative_warmstart_steps_is_refused():
    with pytest.raises(ConfigError, match=r"warmstart\.steps = -5: must be >= 1"):
        build_config("smoke", sets=[parse_set("warmstart.steps=-5")])


@pytest.mark.parametrize("command", ["train", "ablate"])
def test_config_that_is_a_directory_or_not_utf8(tmp_path, command):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe[run]\n")
    one_line_error(cli(command, "--config", str(tmp_path)), str(tmp_path), "is a directory", rc=2)
    one_line_error(cli(command, "--config", str(bad)), str(bad), "not UTF-8", rc=2)


def test_mlflow_tracking_uri_from_the_environment_when_unset(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////tmp/elsewhere.db")
    assert build_config("smoke").tracking.uri == "sqlite:////tmp/elsewhere.db"
    assert build_config("smoke", sets=[parse_set("tracking.uri=''")]).tracking.uri == ""  # a chosen one wins
    assert build_config("smoke", {"tracking": {"uri": "sqlite:///x.db"}}).tracking.uri == "sqlite:///x.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert build_config("smoke").tracking.uri == Config().tracking.uri
