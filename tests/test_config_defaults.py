"""One set of defaults: every field of the libraries' settings classes (the learner's ``LearnerSettings``, the
controller's ``Settings`` and ``SessionSettings``) is either a config field of the same name whose default is
read from the class (``F(SETTING, ...)`` in rail/config.py, never written twice), or listed below as not coming
from the config, with where its value comes from instead. And the trainer builds the settings from the config
by name."""

from __future__ import annotations

import ast
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from controller import SessionSettings, Settings
from policy.settings import LearnerSettings
from rail.config import Config, ControllerConfig, LearnerConfig, build_config
from rail.settings import settings_from

ROOT = Path(__file__).resolve().parents[1]

#: settings class -> (the config section it is built from, {field: where its value comes from instead})
SOURCES = {
    LearnerSettings: (LearnerConfig, {
        "temperature": "rollout.temperature",
        "max_tokens": "rollout.max_turns x rollout.max_tokens_per_turn (Config.max_rollout_tokens)",
    }),
    Settings: (ControllerConfig, {
        "clip_p": "the library's own (VW's --clip_p); not configurable from rail",
        "bits": "the library's own (VW's hash bits); not configurable from rail",
        "alpha": "the library's own (the gate's one-sided level); not configurable from rail",
    }),
    SessionSettings: (ControllerConfig, {
        "bandit": "controller.Settings, itself built from [controller]",
        "ladder_size": "controller.ladder_how_many, or controller.rti_how_many with controller.shadow = 'rti'",
        "heuristic_escalates": "controller.shadow ('rti': false)",
        "group_size": "budget.group_size",
        "unit": "min(controller.how_many)",
        "budget_unit": "budget.unit",
        "compose": "controller.compose, whose 'auto' resolves to the controller's own",
        "pass_rate_weight": "the library's own (the pass-rate EMA); not configurable from rail",
    }),
}


def _default(f):
    d = f.default if f.default is not MISSING else f.default_factory()
    return list(d) if isinstance(d, tuple) else d


def _config_defaults_written_in_config() -> dict[str, dict[str, str]]:
    """Section class -> {field: the source of its default} for every field of LearnerConfig and ControllerConfig
    whose default rail/config.py writes itself (not ``F(SETTING, ...)``)."""
    tree = ast.parse((ROOT / "rail" / "config.py").read_text(encoding="utf-8"))
    out: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in ("LearnerConfig", "ControllerConfig"):
            out[node.name] = {}
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.value, ast.Call) and item.value.args:
                    first = item.value.args[0]
                    if not (isinstance(first, ast.Name) and first.id == "SETTING"):
                        out[node.name][item.target.id] = ast.unparse(first)
    return out


@pytest.mark.parametrize("cls", list(SOURCES), ids=lambda c: c.__name__)
def test_every_setting_comes_from_a_config_field_of_its_name_and_default_or_is_listed(cls):
    section, elsewhere = SOURCES[cls]
    config = {f.name: f for f in fields(section)}
    names = {f.name for f in fields(cls)}
    assert set(elsewhere) <= names, f"listed but not fields of {cls.__name__}: {sorted(set(elsewhere) - names)}"
    for f in fields(cls):
        if f.name in elsewhere:
            continue
        assert f.name in config, (f"{cls.__name__}.{f.name} has no config field {section.__name__}.{f.name}: add one "
                                  f"with F(SETTING, doc), or list where its value comes from in SOURCES")
        assert _default(config[f.name]) == _default(f), f"{section.__name__}.{f.name}: a default of its own"


def test_a_shared_default_is_written_once_in_the_settings_class():
    written = _config_defaults_written_in_config()
    for cls, (section, elsewhere) in SOURCES.items():
        shared = {f.name for f in fields(cls)} - set(elsewhere)
        twice = {n: src for n, src in written[section.__name__].items() if n in shared}
        assert not twice, f"{section.__name__} writes defaults {cls.__name__} already has: {twice}; use F(SETTING, doc)"


def test_the_learner_is_built_from_the_config_by_name():
    from rail.train import learner_settings

    cfg = build_config(sets=[{"learner": {"lr": 1e-4, "rehearsal": 0.0, "shift_threshold": float("inf"),
                                          "old_logprobs": "recompute"}, "rollout": {"temperature": 0.5}}])
    s = learner_settings(cfg)
    assert (s.lr, s.rehearsal, s.shift_threshold, s.old_logprobs) == (1e-4, 0.0, float("inf"), "recompute")
    assert s.temperature == 0.5 and s.max_tokens == cfg.max_rollout_tokens
    assert learner_settings(cfg, schedule="constant").schedule == "constant"
    assert learner_settings(cfg, temperature=1.0).temperature == 1.0  # overrides replace any field
    # at the defaults, the settings are the class's own defaults
    d = Config()
    assert learner_settings(d) == LearnerSettings(temperature=d.rollout.temperature, max_tokens=d.max_rollout_tokens)


def test_the_learned_controller_is_built_from_the_config_by_name():
    from rail.controllers import RailController

    assert settings_from(Settings, Config().controller) == Settings()
    cfg = build_config(sets=[{"controller": {"lr": 0.25, "mode": "live", "window": 50, "ladder": ["resample@violation"]}}])
    ctl = RailController(config=cfg)
    assert (ctl.settings.lr, ctl.settings.mode, ctl.settings.window) == (0.25, "live", 50)
    assert ctl.session.s.bandit is ctl.settings and ctl.session.s.ladder == ("resample@violation",)
    with pytest.raises(TypeError, match="no field nope"):
        settings_from(Settings, cfg.controller, nope=1)
