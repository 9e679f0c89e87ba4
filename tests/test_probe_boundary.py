"""The boundary probe (experiments/probe_boundary.py): its supervised capacity training, its rescue measure, its
report and its flags."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import probe_boundary as pb  # noqa: E402
from _probe import operator_keys, rollout_groups  # noqa: E402
from policy.engine import SamplingParams, TransformersEngine  # noqa: E402
from policy.learner import sft_loss  # noqa: E402
from policy.model import build_tiny_model  # noqa: E402
from policy.tokenizer import ChatRenderer, build_word_tokenizer  # noqa: E402
from rail.config import build_config  # noqa: E402
from rail.envs import ToolRunner, make_env  # noqa: E402
from rail.policy_setup import demonstration_batches, reference_trajectory, vocabulary  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    env = make_env("lookup", 0)
    tok = build_word_tokenizer(vocabulary({"lookup": env}))
    model = build_tiny_model(len(tok), hidden_size=32, layers=2, heads=2, kv_heads=1, intermediate_size=64,
                             max_positions=512, seed=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    cfg = build_config("smoke", sets=[{"env": {"families": ["lookup"]}, "warmstart": {"batch_size": 8}}])
    return env, ChatRenderer(tok), model.eval(), cfg


def test_sft_updates_follow_the_config():
    cfg = build_config("default")
    n, how = pb.default_sft_updates(cfg)
    assert n == 100 * 1 * 2  # 100 steps, one epoch, 128 rollouts in minibatches of 64
    assert "run.steps 100" in how and "learner.minibatch_size 64" in how
    cfg = build_config("default", sets=[{"run": {"steps": 10}, "learner": {"epochs": 3, "minibatch_size": 48}}])
    assert pb.default_sft_updates(cfg)[0] == 10 * 3 * 3  # ceil(128 / 48) = 3
    assert pb.beyond_levels(build_config("default")) == [3, 4]
    assert pb.beyond_levels(build_config("default", sets=[{"warmstart": {"levels": [1, 2, 3]}}])) == [4]


def test_cell_training_demonstrates_only_the_cell_cleanly(tiny):
    env, renderer, _, cfg = tiny
    c = pb.cell_sft_config(cfg, 3, 4)
    assert (c.warmstart.levels, c.warmstart.steps, c.warmstart.noise, c.warmstart.guided_share) == ([3], 4, 0.0, 0.0)
    assert cfg.warmstart.levels == [1, 2] and cfg.warmstart.noise == 0.4  # the config given is left alone
    batches = list(demonstration_batches(renderer, {"lookup": env}, c))
    assert len(batches) == 4
    for tr in (t for b in batches for t in b):  # reward 1: the action guide, not the imperfect demonstrator's
        assert (tr.family, tr.level, tr.reward) == ("lookup", 3, 1.0)
        assert "plan" not in renderer.decode(tr.prompt_ids)  # no guided demonstration
    guided = pb.cell_sft_config(cfg, 3, 4)
    guided.warmstart.guided_share = 1.0  # (what the check above would catch)
    assert any("plan" in renderer.decode(t.prompt_ids) for b in demonstration_batches(renderer, {"lookup": env}, guided)
               for t in b)


def test_sft_on_cell_learns_the_cell_and_leaves_the_model_alone(tiny):
    env, renderer, model, cfg = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    held = [reference_trajectory(env, t, renderer) for t in env.eval_tasks(1, 16)]  # never trained on
    with torch.no_grad():
        nll_before = float(sft_loss(model, held, renderer.pad))
    twin, losses = pb.sft_on_cell(model, renderer, "lookup", env, cfg, 1, 150)
    assert twin is not model and len(losses) == 150
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not all(torch.equal(v, before[k]) for k, v in twin.state_dict().items())
    with torch.no_grad():
        nll_after = float(sft_loss(twin, held, renderer.pad))
        assert float(sft_loss(model, held, renderer.pad)) == pytest.approx(nll_before)
    assert nll_after < 0.5 * nll_before, (nll_before, nll_after)
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])


class Recording:
    """An engine that remembers the groups each generate call asked for."""

    def __init__(self, engine):
        self.engine, self.groups = engine, []

    def generate(self, reqs, params, seed):
        self.groups.append({r.group for r in reqs})
        return self.engine.generate(reqs, params, seed=seed)


def test_rescue_acts_only_on_groups_without_a_success(tiny):
    env, renderer, model, cfg = tiny
    runner = ToolRunner(env)
    engine = TransformersEngine(model, renderer, batch_size=64)
    params = SamplingParams(1.0, 1.0, 12, 4)
    tasks = env.eval_tasks(2, 3)
    groups = rollout_groups(engine, params, env, runner, tasks, 2, seed=0)
    assert [len(g) for g in groups] == [2, 2, 2] and all(tr.group == i for i, g in enumerate(groups) for tr in g)
    groups[1][0].reward = 1.0  # a group with a success is not the rescue's to help
    rec = Recording(engine)
    ops, failed = pb.rescue_rates(rec, params, env, runner, tasks, groups, 3, 12, seed=1)
    assert failed == 2
    assert rec.groups and all(g <= {0, 2} for g in rec.groups)
    assert set(ops) <= set(operator_keys()) and "guided_step@start" not in ops  # a reference step only at a violation
    assert "rubric_hint@start" in ops and "resample@start" in ops  # the start is a branch point of every failure
    for v in ops.values():
        assert v["groups"] <= 2 and v["rollouts"] == 3 * v["groups"] and 0.0 <= v["success"] <= 1.0
        assert v["rescued_groups"] <= v["groups"]


def test_cell_record_marks_each_figure_against_its_target():
    ops = {"resample@start": {"success": 0.1, "rollouts": 8, "groups": 1, "rescued_groups": 1},
           "rubric_hint@violation": {"success": 0.35, "rollouts": 16, "groups": 2, "rescued_groups": 2},
           "action_guide@start": {"success": 0.35, "rollouts": 16, "groups": 2, "rescued_groups": 1}}
    good = pb.cell_record(0.7, 0.01, ops, 24)
    assert good["rescue"] == 0.35 and good["rescue_operator"] == "rubric_hint@violation"  # the first of equals
    assert good["passes"] == {"capacity": True, "unguided": True, "rescue": True}
    edge = pb.cell_record(0.6, 0.05, {"resample@start": dict(ops["resample@start"], success=0.3)}, 24)
    assert edge["passes"] == {"capacity": True, "unguided": False, "rescue": True}  # >= 0.6, < 0.05, >= 0.3
    bad = pb.cell_record(0.59, 0.0, {"resample@start": dict(ops["resample@start"], success=0.29)}, 24)
    assert bad["passes"] == {"capacity": False, "unguided": True, "rescue": False}
    none = pb.cell_record(0.9, 0.0, {}, 24)  # no failed group to act on: no rescue measured
    assert none["rescue"] is None and none["rescue_operator"] is None and not none["passes"]["rescue"]


def test_report_files_have_the_documented_shape(tmp_path):
    ops = {"guided_step@violation": {"success": 0.4, "rollouts": 8, "groups": 1, "rescued_groups": 1}}
    cells = {"calc L3": pb.cell_record(0.75, 0.02, ops, 24, failed_groups=1),
             "calc L4": pb.cell_record(0.25, 0.08, {}, 24, failed_groups=0)}
    config = {"seed": 0, "families": ["calc"], "levels": [3, 4], "warmstart_levels": [1, 2], "sft_updates": 200,
              "sft_updates_default": 200, "sft_updates_from": "x", "sft_batch_size": 32, "sft_lr": 0.003,
              "tasks": 24, "rollouts": 8, "eval_temperature": 0.7, "rollout_temperature": 0.7, "threads": 1,
              "warmstart": "cached"}
    report = pb.build_report(cells, config, ".venv/bin/python experiments/probe_boundary.py --threads 1", 12.34)
    out = tmp_path / "claim"
    jpath, mpath = pb.write_report(out, report)
    assert sorted(p.name for p in out.iterdir()) == ["boundary.json", "boundary.md"]  # no temporary file left
    data = json.loads(jpath.read_text())
    assert set(data) == {"cells", "targets", "config", "command", "seconds"}
    assert data["targets"] == {"capacity": 0.6, "unguided": 0.05, "rescue": 0.3} and data["seconds"] == 12.3
    c = data["cells"]["calc L3"]
    assert {"capacity", "unguided", "rescue", "rescue_operator", "operators", "tasks", "passes"} <= set(c)
    assert c["rescue_operator"] == "guided_step@violation" and c["passes"] == {"capacity": True, "unguided": True,
                                                                               "rescue": True}
    assert data["cells"]["calc L4"]["passes"] == {"capacity": False, "unguided": False, "rescue": False}
    md = mpath.read_text()
    assert "| calc L3 | 0.750 pass | 0.020 pass | 0.400 pass | guided_step@violation | 24 | 1 |" in md
    assert "| calc L4 | 0.250 FAIL | 0.080 FAIL | n/a FAIL | - | 24 | 0 |" in md
    assert "experiments/probe_boundary.py --threads 1" in md and "**capacity**" in md and "**rescue**" in md
    assert "calc L3  0.750 pass" in pb.text_table(report)
    assert "All three targets met: 1 of 2 cells (calc L3). Missed: calc L4 (capacity, unguided, rescue)." in md


@pytest.mark.parametrize("argv, message", [
    (["--families", "nosuch"], "not in env.families"),
    (["--tasks", "-1"], "--tasks -1: must be >= 0"),
    (["--rollouts", "-2"], "--rollouts -2: must be >= 0"),
    (["--sft-updates", "-3"], "--sft-updates -3"),
    (["--levels", "9"], "level 9"),
    (["--set", "budget.group_size=1"], "budget.group_size"),
    (["--set", "nosection"], "expected section.key=value"),
    (["--levels", "3", "3"], "appears twice"),
])
def test_bad_flags_are_refused_with_a_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        pb.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_flags_select_the_cells():
    a, cfg, families, levels = pb.parse_args(["--families", "kin", "calc", "--levels", "4", "--seed", "3",
                                              "--set", "env.families=['lookup', 'calc', 'kin']"])
    assert families == ["kin", "calc"] and levels == [4] and cfg.run.seed == 3
    a, cfg, families, levels = pb.parse_args([])
    assert families == ["kin"] and levels == [3, 4] and cfg.run.seed == 0
    assert (a.tasks, a.rollouts) == (cfg.eval.tasks_per_level, cfg.budget.group_size) == (48, 8)
