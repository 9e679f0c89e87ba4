"""A training task mix that changes mid-run (``env.shift_step``, ``env.shift_levels``, ``env.shift_families``): the
config's rules, the draws (the same as without a shift before it, from the new mix after it, the same after a
resume), and the per family/level choice metrics that show what the controller did with it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from rail.config import Config, ConfigError, build_config, parse_set
from rail.envs import make_envs
from rail.train import Trainer, task_mix


def cfg_with(*sets: str, preset: str = "smoke") -> Config:
    return build_config(preset, sets=[parse_set(s) for s in sets])


# ---------------------------------------------------------------------------- config
def test_defaults_are_no_shift():
    e = Config().env
    assert (e.shift_step, e.shift_levels, e.shift_families) == (0, [], [])
    assert task_mix(build_config(), 100) == (["kin"], [1, 2, 3, 4])


@pytest.mark.parametrize("sets, needle", [
    (["env.shift_step=-1"], "env.shift_step = -1"),
    (["env.shift_levels=[3]"], "env.shift_step = 0"),
    (["env.shift_families=['calc']"], "env.shift_step = 0"),
    (["env.shift_step=4", "env.shift_levels=[3]"], "env.shift_step = 4 is after the last step"),
    (["env.shift_step=2"], "nothing changes"),
    (["env.shift_step=2", "env.shift_levels=[3, 2, 1]"], "nothing changes at env.shift_step"),
    (["env.shift_step=2", "env.shift_levels=[0]"], "env.shift_levels = [0]"),
    (["env.shift_step=2", "env.shift_levels=[3, 3]"], "appears twice"),
    (["env.shift_step=2", "env.shift_families=['nope']"], "env.shift_families: nope not in env.families"),
    (["env.shift_step=2", "env.shift_families=['calc', 'calc']"], "env.shift_families"),
    (["env.shift_step=2", "env.shift_levels=[6]", "rollout.max_turns=6"], "env.shift_levels: rollout.max_turns"),
])
def test_shift_errors_name_the_field(sets, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]")):
        cfg_with(*sets)


def test_task_mix_changes_at_the_shift_step():
    cfg = cfg_with("env.shift_step=2", "env.shift_levels=[3]")
    fams = ["lookup", "calc", "kin"]
    assert task_mix(cfg, 1) == (fams, [1, 2, 3])  # the smoke preset's env.levels
    assert task_mix(cfg, 2) == task_mix(cfg, 3) == (fams, [3])
    cfg = cfg_with("env.shift_step=3", "env.shift_families=['kin']")
    assert task_mix(cfg, 2) == (fams, [1, 2, 3]) and task_mix(cfg, 3) == (["kin"], [1, 2, 3])


# ---------------------------------------------------------------------------- the draws
def _sampler(cfg: Config):
    """What Trainer._sample_tasks reads: the config and the environments (no model needed)."""
    return SimpleNamespace(cfg=cfg, envs=make_envs(cfg.env.families, cfg.env.seed, cfg.env.options))


def _draws(cfg: Config, step: int, n: int = 12, stream: tuple = ()) -> list[tuple[str, str, int]]:
    return [(fam, t.id, t.level) for fam, t in Trainer._sample_tasks(_sampler(cfg), step, n, stream)]


def test_draws_before_the_shift_are_those_of_a_run_without_one_and_after_it_the_new_mix():
    plain = cfg_with("run.steps=8")
    shifted = cfg_with("run.steps=8", "env.shift_step=5", "env.shift_levels=[3]", "env.shift_families=['calc', 'kin']")
    for step in range(1, 5):
        for stream in ((), (5, 0, 16), (6,), (6, 1)):  # the base batch, a refill, the fills
            assert _draws(shifted, step, stream=stream) == _draws(plain, step, stream=stream)
    for step in range(5, 9):
        d = _draws(shifted, step, n=40)
        assert {lv for _, _, lv in d} == {3} and {f for f, _, _ in d} == {"calc", "kin"}
        assert d != _draws(plain, step, n=40)
        # a resumed run reads its config back from config.json and draws the same at every step after the shift
        back = build_config("smoke", json.loads(json.dumps(shifted.to_dict())))
        assert _draws(back, step, n=40) == d
        assert _draws(back, step, n=8, stream=(5, 1, 20)) == _draws(shifted, step, n=8, stream=(5, 1, 20))
    # levels only: every family still, at the new levels only
    lv_only = cfg_with("run.steps=8", "env.shift_step=5", "env.shift_levels=[3]")
    d = _draws(lv_only, 6, n=40)
    assert {lv for _, _, lv in d} == {3} and {f for f, _, _ in d} == {"lookup", "calc", "kin"}


# ---------------------------------------------------------------------------- a real run, killed and resumed
class _Recorder:
    """Wraps Trainer._sample_tasks to record every draw by (step, stream)."""

    def __init__(self, monkeypatch, fail_at: int | None = None):
        self.draws: dict[tuple, list] = {}
        orig, orig_step, rec = Trainer._sample_tasks, Trainer.step, self

        def sample(trainer, step, n, stream=()):
            out = orig(trainer, step, n, stream)
            rec.draws[(step, tuple(stream))] = [(f, t.id, t.level) for f, t in out]
            return out

        def step(trainer, k):
            if fail_at is not None and k == fail_at:
                raise RuntimeError(f"stopped at step {k}")
            return orig_step(trainer, k)

        monkeypatch.setattr(Trainer, "_sample_tasks", sample)
        monkeypatch.setattr(Trainer, "step", step)


def _smoke(tmp_path: Path, name: str, cache: Path) -> Config:
    return cfg_with(f"run.out='{tmp_path / name}'", "tracking.uri=''", f"warmstart.cache_dir='{cache}'",
                    "run.threads=1", "run.steps=3", "run.checkpoint_every=2", "eval.every=100",
                    "env.shift_step=2", "env.shift_levels=[3]", "controller.name='ladder'")


def test_a_run_resumed_after_the_shift_draws_what_the_uninterrupted_run_drew(tmp_path, monkeypatch):
    from rail.train import resume_run, start_run

    cache = tmp_path / "warmstart"
    rec = _Recorder(monkeypatch)
    trainer, straight = start_run(_smoke(tmp_path, "straight", cache), show_progress=False)
    trainer.run()
    ref = rec.draws
    assert ref and {lv for (step, _), d in ref.items() if step >= 2 for _, _, lv in d} == {3}
    assert {lv for (step, _), d in ref.items() if step == 1 for _, _, lv in d} > {3}

    monkeypatch.undo()
    rec = _Recorder(monkeypatch, fail_at=3)
    trainer, killed = start_run(_smoke(tmp_path, "killed", cache), show_progress=False)
    with pytest.raises(RuntimeError, match="stopped at step 3"):
        trainer.run()
    assert (killed / "checkpoints").is_dir() and not (killed / "summary.json").exists()
    before = dict(rec.draws)
    monkeypatch.undo()
    rec = _Recorder(monkeypatch)
    trainer, _ = resume_run(killed, show_progress=False)
    assert trainer.state.step == 2  # the checkpoint after the shift
    trainer.run()
    assert {k: v for k, v in before.items() if k[0] <= 2} == {k: v for k, v in ref.items() if k[0] <= 2}
    assert {k: v for k, v in rec.draws.items() if k[0] == 3} == {k: v for k, v in ref.items() if k[0] == 3}

    # the choice metrics say which family and level each step's groups came from, and what was done to them
    rows = [json.loads(ln) for ln in (straight / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "groups/count" in r}
    for step, r in steps.items():
        cells = {k.split("/")[2] for k in r if k.startswith("choice/") and k.endswith("/groups")}
        assert cells and (cells == {"level_3"} if step >= 2 else True), (step, cells)
        n = sum(v for k, v in r.items() if k.startswith("choice/") and k.endswith("/groups"))
        assert n == r["groups/count"]
        dec = sum(v for k, v in r.items() if k.startswith("choice/") and "@" in k)
        assert dec == r["intervention/decisions"]
        for k, v in r.items():
            if k.startswith("choice/") and k.endswith("/intervened"):
                assert 0 <= v <= r[k[: -len("intervened")] + "groups"]
    assert any(v > 0 for r in steps.values() for k, v in r.items() if k.endswith("/intervened"))  # ladder acted


def test_a_shifted_mix_a_family_cannot_draw_is_refused_before_anything_is_trained(tmp_path, monkeypatch):
    import rail.train as train
    from rail.rundir import RunError

    real = train.make_envs

    def make_envs(families, seed, options):
        envs = real(families, seed, options)
        calc = envs["calc"]
        draw = calc.sample_tasks

        def sample_tasks(rng, levels, n):  # a finite pool without level 3 training tasks
            if 3 in levels:
                raise ValueError("calc: no training task of level 3")
            return draw(rng, levels, n)
        calc.sample_tasks = sample_tasks
        return envs

    monkeypatch.setattr(train, "make_envs", make_envs)
    cfg = cfg_with(f"run.out='{tmp_path / 'run'}'", "tracking.uri=''", "env.levels=[1, 2]", "env.shift_step=2",
                   "env.shift_levels=[3]")
    with pytest.raises(RunError, match=r"env\.shift_families / env\.shift_levels: calc: no training task of level 3"):
        Trainer(cfg, tmp_path / "run")
