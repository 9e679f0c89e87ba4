"""End-to-end: config validation, smoke training, budget accounting, checkpoints, resume after SIGKILL, eval."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from processes import RAIL, ROOT, launch, rail, run, wait_for
from rail.budget import BudgetExceeded, BudgetLedger, StepBudget
from rail.config import Config, ConfigError, build_config, config_markdown, parse_set
from rail.train import RunError, start_run



@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmstart"))


def smoke(tmp_path: Path, cache_dir: str, *sets: str, uri: str = "") -> Config:
    extra = [parse_set(s) for s in sets]
    return build_config("smoke", sets=[{"run": {"out": str(tmp_path / "run")}, "tracking": {"uri": uri},
                                        "warmstart": {"cache_dir": cache_dir}}, *extra])


def cli(*args, cwd=None, timeout=240):
    return rail(*args, cwd=cwd, timeout=timeout)


# ---------------------------------------------------------------------------- config
def test_bad_group_size_is_rejected_before_anything_runs(tmp_path):
    out = tmp_path / "bad"
    r = cli("train", "--preset", "smoke", "--set", "budget.group_size=1", "--out", str(out), "--tracking-uri", "")
    assert r.returncode != 0
    assert "group_size" in r.stderr
    assert not out.exists()


@pytest.mark.parametrize("sets, needle", [
    (["budget.rollouts_per_step=3"], "rollouts_per_step"),
    (["budget.unit=bananas"], "budget.unit"),
    (["learner.loss_agg=sum"], "learner.loss_agg"),
    (["learner.nope=1"], "learner.nope"),
    (["env.families=['chess']"], "env.families"),
    (["rollout.max_turns=3"], "rollout.max_turns"),
    (["budget.total=10"], "budget.total"),
    (["run.steps=abc"], "run.steps"),
    (["controller.name=oracle"], "controller.name"),
    (["learner.guided_sft=-1"], "learner.guided_sft"),
    (["learner.rehearsal=-0.5"], "learner.rehearsal"),
    (["learner.rehearsal_batch=0"], "learner.rehearsal_batch"),
    (["controller.menu=['resample@start', 'rubric_hint@violation']"], "controller.ladder"),
    (["controller.temperatures=[0.0]"], "controller.temperatures"),
    (["controller.temperatures=[1.3]"], "controller.temperatures"),  # the shadowed ladder's rungs are off the menu
    (["controller.menu=['resample@start:hot']"], "controller.menu"),
    (["warmstart.target=1.5"], "warmstart.target"),
    (["warmstart.max_steps=5"], "warmstart.max_steps"),
    (["warmstart.check_tasks=0"], "warmstart.check_tasks"),
    (["controller.ladder_by_cell={'chess/3' = []}"], "controller.ladder_by_cell"),
])
def test_config_errors_name_the_field(sets, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        build_config("smoke", sets=[parse_set(s) for s in sets])


def test_precedence_defaults_preset_toml_flags(tmp_path):
    toml = {"run": {"steps": 7}, "learner": {"lr": 1e-4}}
    cfg = build_config("smoke", toml, [parse_set("learner.lr=5e-4")])
    assert cfg.run.steps == 7 and cfg.learner.lr == 5e-4 and cfg.budget.group_size == 4  # smoke preset
    assert build_config().run.steps == Config().run.steps


def test_every_config_field_is_documented():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for line in config_markdown().splitlines():
        if line.startswith("| `"):
            key = line.split("`")[1]
            assert f"`{key}`" in doc, f"docs/configuration.md does not describe {key}"


# ---------------------------------------------------------------------------- budget
def test_step_budget_refuses_overspending():
    b = StepBudget("rollouts", 16)
    b.charge("base", 12)
    with pytest.raises(BudgetExceeded):
        b.charge("intervention", 5)
    b.charge("intervention", 4)
    assert b.remaining == 0
    ledger = BudgetLedger("rollouts", 16, total=40)
    for _ in range(2):
        s = ledger.open_step()
        s.charge("base", s.limit)
        ledger.close_step(s)
    assert ledger.open_step().limit == 8 and ledger.exhausted(10)


# ---------------------------------------------------------------------------- training
def test_smoke_run_trains_and_writes_everything(tmp_path, cache_dir):
    db = tmp_path / "mlflow.db"
    # The smoke policy is too small to solve tasks (its tool calls mostly fail, and every group would have
    # zero variance); a verifier that pays every other rollout gives every group a spread to learn from.
    cfg = smoke(tmp_path, cache_dir, "learner.mask_all_tools_failed=false", "controller.name=none", uri=f"sqlite:///{db}")
    trainer, out = start_run(cfg, show_progress=False)
    calls = [0]

    def alternating(task, steps):
        calls[0] += 1
        return float(calls[0] % 2)
    for env in trainer.envs.values():
        env.reward = alternating
    before = [p.detach().clone() for p in trainer.model.parameters()]
    summary = trainer.run()
    changed = sum(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
    assert changed == len(before), "every parameter should move during training"
    s = json.loads((out / "summary.json").read_text())
    assert s == json.loads(json.dumps(summary))
    assert s["steps"] == 3 and s["wall_seconds"] > 0
    assert s["budget"]["unit"] == "rollouts" and s["budget"]["per_step"] == 16
    assert s["budget"]["spent"]["base"] == 48 and s["budget"]["spent"]["intervention"] == 0
    for k in ("initial", "final"):
        assert set(s["eval"][k]) == {"lookup", "calc", "kin"}
        assert set(s["eval"][k]["lookup"]) == {"1", "2", "3"}
    assert [h["step"] for h in s["eval"]["history"]] == [0, 2, 3]
    assert [h["budget_spent"] for h in s["eval"]["history"]] == [0, 32, 48]
    # what the controller chose, per family and level: every group of every step counted once, none intervened on
    assert [sum(c["steps"][str(k)][0] for c in s["choices"].values() if str(k) in c["steps"]) for k in (1, 2, 3)] == [4] * 3
    assert not any(c["help"] for c in s["choices"].values())
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [ln for ln in lines if "rollout/reward_mean" in ln]
    assert [ln["step"] for ln in steps] == [1, 2, 3]
    assert all(math.isfinite(ln["loss/loss"]) for ln in steps) and all(ln["groups/trained_trajectories"] > 0 for ln in steps)
    assert all(ln["budget/step_base"] + ln["budget/step_intervention"] <= 16 for ln in steps)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000003"
    import mlflow
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("rail").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["budget.group_size"] == "4"
    assert "rollout/reward_mean" in runs[0].data.metrics


def test_token_budget_is_never_exceeded(tmp_path, cache_dir):
    cfg = smoke(tmp_path, cache_dir, "budget.unit='tokens'", "budget.tokens_per_step=300")
    trainer, out = start_run(cfg, show_progress=False)
    trainer.run()
    steps = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [ln for ln in steps if "budget/step_base" in ln]
    assert steps and all(0 < ln["budget/step_base"] <= 300 for ln in steps)


def test_tracking_failure_does_not_stop_training(tmp_path, cache_dir):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg = smoke(tmp_path, cache_dir, uri=f"sqlite:///{blocker}/mlflow.db")
    with pytest.warns(UserWarning, match="MLflow tracking disabled"):
        trainer, out = start_run(cfg, show_progress=False)
        trainer.run()
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


def test_broken_verifier_gives_reward_0_counted_and_the_step_goes_on(tmp_path, cache_dir):
    cfg = smoke(tmp_path, cache_dir)
    trainer, _ = start_run(cfg, show_progress=False)
    for env in trainer.envs.values():  # whichever family the step draws first
        env.reward = lambda task, steps: float("nan")
    with pytest.warns(UserWarning, match="verifier returned nan.*reward 0"):
        m = trainer.step(1)
    assert m["errors/reward"] == m["rollout/count"] + m["intervention/rollouts"] > 0  # every rollout scored
    assert m["rollout/reward_mean"] == 0.0 and math.isfinite(m["loss/lr"])


def test_existing_run_directory_is_not_overwritten(tmp_path, cache_dir):
    cfg = smoke(tmp_path, cache_dir)
    start_run(cfg, show_progress=False)[0].run()
    with pytest.raises(RunError, match="rail resume"):
        start_run(cfg, show_progress=False)


# ---------------------------------------------------------------------------- checkpoints and resume
def _kill_after_checkpoint(args: list[str], out: Path, step_name: str) -> None:
    p = launch([*RAIL, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = out / "checkpoints" / "latest"
    wait_for(lambda: latest.exists() and latest.read_text().strip() >= step_name, p, f"the checkpoint {step_name}")
    os.kill(p.pid, signal.SIGKILL)
    p.wait()


def test_sigkill_then_resume_finishes_the_same_run(tmp_path, cache_dir):
    out = tmp_path / "killed"
    common = ["--preset", "smoke", "--tracking-uri", "", "--no-progress", "--set", f"warmstart.cache_dir='{cache_dir}'",
              "--set", "run.steps=6", "--set", "run.checkpoint_every=2", "--set", "eval.every=100"]
    _kill_after_checkpoint(["train", *common, "--out", str(out)], out, "step_000002")
    assert not (out / "summary.json").exists()
    r = cli("resume", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 6 and s["budget"]["spent"]["total"] == 6 * 16
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()
             if "rollout/reward_mean" in ln]
    assert steps == [1, 2, 3, 4, 5, 6]  # lines written after the checkpoint by the killed run were dropped
    # the resumed run draws what an uninterrupted one draws: same rewards step by step
    ref = tmp_path / "straight"
    r = cli("train", *common, "--out", str(ref))
    assert r.returncode == 0, r.stderr
    rew = lambda d: [json.loads(ln)["rollout/reward_mean"] for ln in (d / "metrics.jsonl").read_text().splitlines()
                     if "rollout/reward_mean" in ln]
    assert rew(out)[:3] == rew(ref)[:3]
    assert json.loads((ref / "summary.json").read_text())["budget"]["spent"] == s["budget"]["spent"]
    # the learned controller resumed too: its trace holds one line per decision, as the uninterrupted run's
    trace = lambda d: (d / "traces" / "decisions.dsjson").read_text().splitlines()
    assert len(trace(out)) == len(trace(ref)) > 0
    assert [json.loads(x)["_learn_seq"] for x in trace(out)] == list(range(len(trace(out))))


def test_smoke_trace_parses_with_vw_and_replays_to_the_checkpointed_controller(tmp_path, cache_dir):
    import vowpal_wabbit_next as vw

    from controller.traces import replay
    from controller.vw import Bandit

    cfg = smoke(tmp_path, cache_dir, "run.steps=4", "eval.quick_every=1")
    trainer, out = start_run(cfg, show_progress=False)
    summary = trainer.run()
    assert [q["step"] for q in summary["eval"]["quick"]] == [1, 3]  # between the full evaluations (every 2)
    lines = (out / "traces" / "decisions.dsjson").read_text().splitlines()
    assert lines
    ws = vw.Workspace(["--cb_explore_adf", "--quiet", "-q", "sa"])
    parser = vw.DSJsonFormatParser(ws)
    for line in lines:
        ws.learn_one(parser.parse_json(line))
    saved = json.loads((out / "checkpoints" / "step_000004" / "state.json").read_text())["controller"]["learned"]
    assert replay(out / "traces" / "decisions.dsjson").weights_equal(Bandit(state=saved["bandit"]))
    # escalation: a decision in round r > 0 follows an intervention on the same group in round r - 1 of the same
    # step that left it without a success, and the heuristic it shadows never repeats a rung tried on the group
    events = [json.loads(ln) for ln in lines]
    by_key = {}
    for e in events:
        step_group = e["EventId"].split("#")[0]
        by_key[(step_group, int(e["c"]["s"]["round"]))] = e
    later = [(k, e) for k, e in by_key.items() if k[1] > 0]
    assert later, "the smoke run escalated no group"
    for (sg, rnd), e in later:
        prev = by_key[(sg, rnd - 1)]
        chosen = prev["_actions"][prev["_labelIndex"]]
        assert chosen != "none" and prev["_outcome"]["successes"] == 0, (sg, rnd, chosen, prev["_outcome"])
        assert e["c"]["s"]["tried"] == rnd and e["c"]["s"]["last_tried"] == chosen.split("x")[0]
        h = [a for a, x in zip(e["_actions"], e["_h"]) if x == 1.0]
        tried = {by_key[(sg, k)]["_actions"][by_key[(sg, k)]["_labelIndex"]].split("x")[0] for k in range(rnd)}
        assert h and h[0].split("x")[0] not in tried
    # every intervention's outcome records the headroom of its family/level: 1 - the pass rate its context saw
    ran = [e for e in events if "headroom" in e["_outcome"]]
    assert ran and all(e["_outcome"]["headroom"] == pytest.approx(1 - e["c"]["s"]["pass_rate"], abs=1e-6)
                       for e in ran)
    r = cli("traces", "evaluate", str(out), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["events"] == len(lines) and "learned" in res["policies"]
    assert cli("traces", "evaluate", str(tmp_path / "nowhere")).returncode == 2
    # every name this run logged (base, intervention, shift, controller, eval, summary) is defined in the docs
    logged = {k for ln in (out / "metrics.jsonl").read_text().splitlines() for k in json.loads(ln) if k != "step"}
    assert any(k.startswith("controller/") for k in logged) and "shift/measured" in logged
    missing = sorted(k for k in logged if _generic(k) not in documented_metrics())
    assert not missing, f"logged but not defined in docs/metrics.md: {missing}"


def test_a_run_starts_from_an_earlier_runs_controller(tmp_path, cache_dir):
    """rail train --controller-from RUN (controller.init_from): the learned controller replays RUN's trace and the
    summary says so; its own trace holds only its own decisions; a path without a trace is refused before
    anything runs."""
    first = smoke(tmp_path / "a", cache_dir, "run.steps=2")
    start_run(first, show_progress=False)[0].run()
    src = Path(first.run.out)
    n = len((src / "traces" / "decisions.dsjson").read_text().splitlines())
    out = tmp_path / "b"
    r = cli("train", "--preset", "smoke", "--out", str(out), "--tracking-uri", "", "--no-progress",
            "--controller-from", str(src), "--set", f"warmstart.cache_dir='{cache_dir}'", "--set", "run.steps=2")
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    reused = s["controller_state"]["reused"]
    assert reused["events"] == n and reused["trace"] == str(src / "traces" / "decisions.dsjson")
    assert f"started from {src / 'traces' / 'decisions.dsjson'} ({n} decisions replayed" in r.stdout
    assert len((out / "traces" / "decisions.dsjson").read_text().splitlines()) == s["controller_state"]["events"]
    bad = cli("train", "--preset", "smoke", "--controller-from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "c"))
    assert bad.returncode == 2 and "--controller-from" in bad.stderr and not (tmp_path / "c").exists()


def test_the_learning_reward_measures_what_the_policy_absorbs(tmp_path, cache_dir, monkeypatch):
    """controller.reward = 'learning': every intervention that ran gets an absorption (0 without a trained rollout)
    in its trace outcome, and one that absorbed nothing earns nothing. (The smoke model solves nothing, so a
    verifier that passes every other rollout it scores, and no mask on rollouts whose tool calls all failed, give
    the groups something to train on.)"""
    import itertools

    import rail.rounds

    n = itertools.count()
    monkeypatch.setattr(rail.rounds, "safe_reward", lambda env, task, steps: (float(next(n) % 2), None))
    cfg = smoke(tmp_path, cache_dir, "run.steps=3", "controller.reward='learning'", "controller.heuristic_epsilon=0.5",
                "learner.mask_all_tools_failed=false")
    trainer, out = start_run(cfg, show_progress=False)
    trainer.run()
    events = [json.loads(ln) for ln in (out / "traces" / "decisions.dsjson").read_text().splitlines()]
    ran = [e for e in events if "cost" in e["_outcome"]]
    assert ran and all("absorbed" in e["_outcome"] for e in ran)
    assert any(e["_outcome"]["absorbed"] != 0.0 for e in ran)
    assert all(e["_label_cost"] == 0.0 for e in ran if e["_outcome"]["absorbed"] <= 0)


def documented_metrics() -> set[str]:
    """Metric names in docs/metrics.md tables; `a/b/x`, `…/y` expands to a/b/y."""
    import re
    names = set()
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        prev = None
        for tok in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if tok.startswith("…/") and prev:
                tok = prev.rsplit("/", 1)[0] + tok[1:]
            if "/" in tok:
                names.add(tok)
                prev = tok
    return names


def _generic(name: str) -> str:
    """A logged name in the docs' placeholder form."""
    import re
    name = re.sub(r"^intervention/[a-z_]+@[a-z]+/", "intervention/<key>/", name)
    name = re.sub(r"^choice/[^/]+/level_\d+/[a-z_]+@[a-z]+$", "choice/<family>/level_<L>/<key>", name)
    name = re.sub(r"^choice/[^/]+/level_\d+/", "choice/<family>/level_<L>/", name)
    name = re.sub(r"^eval/[a-z_/]+/level_\d+$", "eval/<family>/level_<L>", name)
    name = re.sub(r"^quick/[a-z_/]+/level_\d+$", "quick/<family>/level_<L>", name)
    return re.sub(r"^eval/[a-z_/]+/all$", "eval/<family>/all", name)


def test_eval_checkpoint_cli(tmp_path, cache_dir):
    cfg = smoke(tmp_path, cache_dir)
    trainer, out = start_run(cfg, show_progress=False)
    trainer.run()
    r = cli("eval", str(out), "--json", "--tasks-per-level", "2")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert set(res) == {"lookup", "calc", "kin"} and all(0.0 <= v <= 1.0 for d in res.values() for v in d.values())


# ---------------------------------------------------------------------------- architecture
def test_dependency_direction():
    checks = [
        # controller/ is torch-free
        "import sys, controller; assert 'torch' not in sys.modules",
        # policy/ imports nothing from controller/ or rail/
        "import sys, policy.engine, policy.learner, policy.checkpoint, policy.model; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('controller', 'rail')]; assert not bad, bad",
        # the CLI and config parse before torch is imported
        "import sys, rail.cli, rail.config; assert 'torch' not in sys.modules",
    ]
    for code in checks:
        r = run([sys.executable, "-c", code])
        assert r.returncode == 0, (code, r.stderr)


def test_the_summary_says_what_the_controller_learned():
    from rail.report import _learned, learned

    steps = 20
    choices = {  # kin L3: helped throughout with hints; lookup L1: helped early, then left alone from step 8 on
        "kin L3": {"steps": {str(k): [2, 2 if k <= 5 else 1] for k in range(1, steps + 1)},
                   "help": {"rubric_hint@start": [30, 120], "resample@violation": [5, 10]}},
        "lookup L1": {"steps": {str(k): [3, 1 if k <= 7 else 0] for k in range(1, steps + 1)},
                      "help": {"resample@violation:1.3": [7, 14]}},
        "calc L1": {"steps": {str(k): [1, 0] for k in range(1, steps + 1)}, "help": {}},
    }
    rows = {r["cell"]: r for r in learned(choices, steps)}
    assert set(rows) == {"kin L3", "lookup L1"}  # a cell it never helped is not a finding
    k, lk = rows["kin L3"], rows["lookup L1"]
    assert (k["first"], k["last"], k["help"], k["stopped_after"]) == (1.0, 0.5, "rubric_hint@start", None)
    assert k["help_share"] == 30 / 35 and k["rollouts_each"] == 4.0
    assert (lk["first"], lk["last"], lk["stopped_after"]) == (1 / 3, 0.0, 7)
    e = {"initial": {"kin": {"3": 0.0}, "lookup": {"1": 0.5}}, "final": {"kin": {"3": 0.4}, "lookup": {"1": 0.9}}}
    text = "\n".join(_learned(choices, e, steps))
    assert "stopped after step 7" in text and "still helping" in text and "0.00->0.40" in text
    assert "rubric_hint@start (86% of 35, 4.0 rollouts each)" in text
