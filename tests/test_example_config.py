"""experiments/example.toml, the annotated example configuration: `rail train --config` accepts it, it names only
existing keys, every value is the default its comment states, and every key has a comment."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

from rail.config import Config, build_config, load_toml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "experiments" / "example.toml"


def _leaves(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def test_build_config_accepts_the_example():
    cfg = build_config("default", load_toml(EXAMPLE))
    assert cfg.controller.name == "rail" and cfg.budget.rollouts_per_step == 128


def test_the_example_names_only_existing_keys_each_at_its_default():
    raw = tomllib.loads(EXAMPLE.read_text(encoding="utf-8"))
    defaults = Config()
    sections = {f.name for f in dataclasses.fields(Config)}
    assert set(raw) <= sections, f"unknown sections: {set(raw) - sections}"
    keys = list(_leaves(raw))
    assert len(keys) >= 40
    for key, value in keys:
        section, name = key.split(".", 1)
        sec = getattr(defaults, section)
        assert name in {f.name for f in dataclasses.fields(sec)}, f"{key}: not a config field"
        default = getattr(sec, name)
        assert value == default, f"{key} = {value!r} in the example, but the default is {default!r}"


def test_every_key_of_the_example_has_a_comment_stating_its_default():
    text = EXAMPLE.read_text(encoding="utf-8")
    for line in text.splitlines():
        m = re.match(r"^(\w+) = (.+?)\s+# (.+)$", line)
        if m:
            assert "Default" in m.group(3), f"no default stated: {line}"
    # list-valued keys written over two lines carry their comment on the line above
    for name in ("menu", "ladder"):
        before = text.split(f"\n{name} = [", 1)[0].rsplit("\n", 1)[-1]
        assert before.startswith("# "), f"{name}: no comment above it"
