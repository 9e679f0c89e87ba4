"""`rail ablate` and `rail report`: the ablation files, a real smoke ablation tracked in a SQLite MLflow store
(one parent run, nested children), skipping finished pairs, resuming a killed one, recording a failed one, and
the report (markdown, JSON, PNG figures)."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from processes import RAIL, ROOT, launch, rail, wait_for
from rail.lab.ablate import MANAGED, dump_toml, load_ablation, plan_jobs, shared_view
from rail.config import ConfigError, build_config
from rail.cli import main

ABLATIONS = sorted((ROOT / "experiments" / "ablations").glob("*.toml"))
CONTROLLERS = ROOT / "experiments" / "ablations" / "controllers.toml"
REQUIRED = ("final_beyond", "final_beyond_ci", "final_easy", "auc_beyond", "budget_to_match_none",
            "zero_variance_share", "acceptance", "wall_seconds")


def deep_merge(*dicts: dict) -> dict:
    out: dict = {}
    for d in dicts:
        for section, values in d.items():
            out.setdefault(section, {}).update(copy.deepcopy(values))
    return out


def ablate(*args, cache: Path, timeout=600, **kw):
    return rail("ablate", *args, "--set", f"warmstart.cache_dir={cache}", timeout=timeout, **kw)


def mlflow_runs(db: Path):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{db}")
    exps = client.search_experiments()
    runs = client.search_runs([e.experiment_id for e in exps], max_results=1000)
    return client, runs


# ---------------------------------------------------------------------------- the ablation files
def test_every_ablation_file_parses_and_every_arm_builds(tmp_path):
    assert ABLATIONS, "experiments/ablations/ holds no ablation file"
    for path in ABLATIONS:
        text = path.read_text()
        assert text.startswith("#") and "rail ablate --config" in text.split("[ablation]")[0], \
            f"{path.name} must open with a comment saying what it tests and the command that runs it"
        ab = load_ablation(path)
        lines = text.splitlines()
        for arm in ab.arms:
            i = next(k for k, ln in enumerate(lines) if ln.strip() == f"[arms.{arm}]")
            assert lines[i - 1].startswith("#"), f"{path.name}: [arms.{arm}] needs a comment saying what it tests"
        for preset in sorted({"default", *ab.presets}):
            jobs = plan_jobs(ab, preset, tmp_path)
            for job in jobs:
                # the same arm, built by rail.config.build_config from the file's tables alone
                toml = deep_merge(ab.base, ab.presets.get(preset, {}).get("overrides", {}), ab.arms[job.arm])
                cfg = build_config(preset, toml, [{"run": {"seed": job.seed}}])
                assert cfg.controller == job.cfg.controller and cfg.learner == job.cfg.learner
                assert shared_view(cfg) == shared_view(job.cfg)
            ref = shared_view(jobs[0].cfg)
            assert all(shared_view(j.cfg) == ref for j in jobs), "arms may differ only in [controller] and [learner]"
            assert {j.seed for j in jobs} == set(ab.seeds_for(preset))
            # the job file rail ablate writes reads back to the same config
            tables = jobs[-1].cfg.to_dict()
            assert build_config("default", __import__("tomllib").loads(dump_toml(tables))) == jobs[-1].cfg


def test_controllers_ablation_has_the_required_arms():
    ab = load_ablation(CONTROLLERS)
    names = {a: build_config("smoke", deep_merge(ab.base, t)).controller for a, t in ab.arms.items()}
    for c in ("none", "dapo", "rti", "actguide", "ladder", "random", "rail"):
        assert names[c].name == c
    reduced = {a: c for a, c in names.items() if c.name == "rail" and a != "rail"}
    how = lambda c: {m.split("@")[0] for m in c.menu}
    where = lambda c: {m.split("@")[1] for m in c.menu}
    assert any(c.menu == ["resample@start"] and len(c.how_many) > 1 for c in reduced.values()), "how-many-only arm"
    assert any(len(where(c)) == 1 and len(how(c)) == 4 and len(c.how_many) == 1 for c in reduced.values()), "how-only arm"
    assert any(len(how(c)) == 1 and len(where(c)) == 3 and len(c.how_many) == 1 for c in reduced.values()), "where-only arm"
    for a, c in reduced.items():  # shadow mode acts inside the reduced action space
        assert set(c.ladder) <= set(c.menu) and c.ladder_how_many in c.how_many, a
    assert ab.seeds_for("smoke") == [0] and len(ab.seeds_for("default")) >= 3


@pytest.mark.parametrize("body, needles", [
    ('[arms.a]\ncontroller.nope = 1\n', ["[arms.a]", "controller.nope"]),
    ('[arms.a]\ncontroller.name = "oracle"\n', ["[arms.a]", "controller.name"]),
    ('[arms.a]\nbudget.rollouts_per_step = 64\n', ["[arms.a]", "budget", "[base]"]),
    ('[arms.a]\ncontroller.name = "none"\n[base.run]\nseed = 3\n', ["[base]", "run.seed"]),
    ('[arms.a]\ncontroller.name = "none"\n[base.learner]\nlr = "fast"\n', ["[base]", "learner.lr"]),
    ('[arms.a]\ncontroller.name = "none"\n[preset.huge.run]\nsteps = 9\n', ["preset.huge", "preset"]),
    ('[arms.a]\ncontroller.name = "none"\n[extra]\nx = 1\n', ["[extra]"]),
    ('[arms.a]\ncontroller.name = "none"\n[arms.b]\ncontroller.menu = ["hint@start"]\n', ["[arms.b]", "controller.menu"]),
])
def test_bad_ablation_file_is_one_clear_line_and_exit_2(tmp_path, capsys, body, needles):
    bad = tmp_path / "bad.toml"
    bad.write_text('[ablation]\nname = "bad"\n' + body)
    out = tmp_path / "out"
    rc = main(["ablate", "--config", str(bad), "--out", str(out), "--preset", "smoke", "--tracking-uri", ""])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("rail: config error:") and err.count("\n") == 1, err
    assert str(bad) in err or "preset" in err
    for n in needles:
        assert n in err, (n, err)
    assert not out.exists()


def test_arms_may_set_the_learner_and_share_everything_else(tmp_path):
    f = tmp_path / "learners.toml"
    f.write_text('[ablation]\nname = "learners"\nseeds = 2\n'
                 '[arms.plain]\ncontroller.name = "ladder"\n'
                 '[arms.shaped]\ncontroller.name = "ladder"\nlearner.shaping_gamma = 0.3\nlearner.rehearsal = 0.5\n')
    jobs = plan_jobs(load_ablation(f), "smoke", tmp_path / "out")
    by_arm = {(j.arm, j.seed): j.cfg for j in jobs}
    assert by_arm["plain", 0].learner.shaping_gamma == 0.1 and by_arm["shaped", 1].learner.shaping_gamma == 0.3
    assert by_arm["shaped", 0].learner.rehearsal == 0.5 and by_arm["plain", 0].learner.rehearsal == 1.0
    assert shared_view(by_arm["plain", 0]) == shared_view(by_arm["shaped", 1])  # budget, env, eval: the same
    assert by_arm["plain", 0].budget == by_arm["shaped", 0].budget


def test_bad_flags_exit_2(tmp_path, capsys):
    for args, needle in ((["--arms", "none,nope"], "nope"), (["--set", "run.out=x"], "run.out"),
                         (["--seeds", "0"], "--seeds")):
        rc = main(["ablate", "--config", str(CONTROLLERS), "--out", str(tmp_path / "o"), "--preset", "smoke", *args])
        err = capsys.readouterr().err
        assert rc == 2 and needle in err, err
    assert set(MANAGED) >= {"run.seed", "run.out"}


# ---------------------------------------------------------------------------- report arithmetic
def _fake_run(d: Path, arm: str, seed: int, beyond: list[float], easy: list[float], controller: str) -> None:
    """A child run directory with the files the trainer writes (summary.json, metrics.jsonl, config.json)."""
    d.mkdir(parents=True)
    hist = [{"step": 2 * i, "budget_spent": 32 * i,
             "success": {"calc": {"1": easy[i], "3": beyond[i]}}} for i in range(len(beyond))]
    summary = {"controller": controller, "wall_seconds": 10.0 + seed, "steps": 4,
               "budget": {"unit": "rollouts", "per_step": 16, "total": 0, "group_size": 4,
                          "spent": {"base": 64, "intervention": 0, "total": 64}},
               "eval": {"initial": hist[0]["success"], "final": hist[-1]["success"], "history": hist,
                        "easy_levels": [1], "beyond_levels": [3], "easy_initial": easy[0], "easy_final": easy[-1],
                        "beyond_initial": beyond[0], "beyond_final": beyond[-1]},
               "interventions": {"acceptance_rate": 0.5, "budget_share": 0.25}}
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "config.json").write_text(json.dumps({"controller": {"name": controller}, "env": {"families": ["calc"]},
                                               "eval": {"tasks_per_level": 10}}))
    rows = [{"step": s, "groups/zero_variance_share": 0.5, "time/generate_s": 1.0, "time/score_s": 0.0,
             "time/controller_s": 0.5, "time/update_s": 0.5, "budget/spent_total": 16.0 * s,
             "intervention/budget_share": 0.25 if controller != "none" else 0.0,
             **({"intervention/rubric_hint@violation/decisions": 2.0,
                 "intervention/rubric_hint@violation/rollouts": 8.0} if controller != "none" else {}),
             **({"controller/seconds": 0.2 * s} if controller == "rail" else {})} for s in range(1, 5)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_numbers_from_known_runs(tmp_path):
    from scipy import stats

    from rail.lab.ablation_report import write_report

    root = tmp_path / "abl"
    for seed, (b_none, b_rail) in enumerate([(0.1, 0.3), (0.1, 0.5)]):
        _fake_run(root / "none" / f"seed{seed}", "none", seed, [0.0, 0.0, b_none], [0.2, 0.3, 0.4], "none")
        _fake_run(root / "rail" / f"seed{seed}", "rail", seed, [0.0, 0.2, b_rail], [0.2, 0.4, 0.5], "rail")
    rep = write_report(root)
    r, n = rep["arms"]["rail"], rep["arms"]["none"]
    assert r["final_beyond"] == pytest.approx(0.4)
    # t(0.975, 1 dof) x sd(0.3, 0.5) / sqrt(2) = t x 0.1 = 1.27: 0.4 ± 1.27, clipped to a rate's [0, 1]; 2 seeds
    assert r["final_beyond_ci"] == [0.0, 1.0] and r["n_seeds"] == 2 and r["few_seeds"] is True
    lo, hi = n["final_easy_ci"]  # none's easy finals 0.4 and 0.4: no spread
    assert lo == pytest.approx(0.4) and hi == pytest.approx(0.4)
    # trapezoid over budget 0, 32, 64 normalised by 64: seed 0 (0+.2)/2*.5 + (.2+.3)/2*.5 = 0.175; seed 1 0.225
    assert r["auc_beyond"] == pytest.approx(0.2)
    assert n["auc_beyond"] == pytest.approx(0.025)
    assert rep["none_final_easy"] == pytest.approx(0.4)
    assert r["budget_to_match_none"] == 32 and n["budget_to_match_none"] == 64
    assert r["zero_variance_share"] == 0.5 and r["acceptance"] == 0.5
    assert r["controller_overhead"] == pytest.approx(0.8 / 8.0) and n["controller_overhead"] == 0.0
    assert r["wall_seconds"] == pytest.approx(10.5)
    assert r["choices"]["rubric_hint@violation"] == {"decisions": 8.0, "rollouts": 32.0}
    assert rep["verdict"]["beats_all_mean"] is True
    assert rep["verdict"]["vs"]["none"]["final_beyond_diff"] == pytest.approx(0.3)
    vn = rep["versus_none"]["vs"]["rail"]  # per-seed differences 0.2 and 0.4 beyond, 0.1 and 0.1 easy
    assert vn["final_beyond_diff"] == pytest.approx(0.3) and vn["paired_seeds"] == [0, 1]
    lo, hi = vn["final_beyond_diff_ci"]  # 0.3 ± t x 0.1, the top clipped to a difference of rates' 1
    assert lo == pytest.approx(0.3 - stats.t.ppf(0.975, 1) * 0.1, rel=1e-6) and hi == 1.0
    assert vn["n"] == 2 and vn["few_seeds"] is True
    assert vn["final_easy_diff_ci"] == pytest.approx([0.1, 0.1])
    assert rep["versus_none"]["above_ci"] == [] and rep["versus_none"]["text"].startswith("**Not enough seeds**")
    assert rep["arms_order"] == ["none", "rail"]
    assert (root / "report.md").read_text().count("| `rail` | rail |") == 1
    # each level beyond the boundary on its own, and its paired difference from none (0.2 and 0.4 -> +0.30)
    assert r["final_beyond_cells"] == {"calc L3": pytest.approx(0.4)} and n["final_beyond_cells"] == {"calc L3": pytest.approx(0.1)}
    assert r["per_seed"]["1"]["final_beyond_cells"] == {"calc L3": 0.5}
    md = (root / "report.md").read_text()
    assert "| arm | seeds | calc L3 |" in md and "| `rail` | 2 | 0.40 (+0.30) |" in md and "| `none` | 2 | 0.10 |" in md


def test_report_pairs_the_learned_controller_over_other_action_spaces(tmp_path):
    """Expressiveness: arms with the learned controller's name are paired against it (arm − rail), fixed arms
    are not, and the markdown says which ones end below it."""
    from rail.lab.ablation_report import write_report

    root = tmp_path / "abl"
    for seed, (b_rail, b_how, b_full) in enumerate([(0.5, 0.1, 0.45), (0.7, 0.2, 0.75), (0.6, 0.15, 0.6)]):
        _fake_run(root / "none" / f"seed{seed}", "none", seed, [0.0, 0.0, 0.05], [0.2, 0.3, 0.4], "none")
        for arm, b in (("rail", b_rail), ("rail_how", b_how), ("rail_full", b_full)):
            _fake_run(root / arm / f"seed{seed}", "rail", seed, [0.0, 0.1, b], [0.2, 0.4, 0.5], "rail")
    rep = write_report(root)
    vl = rep["versus_learned"]
    assert vl["learned"] == "rail" and set(vl["vs"]) == {"rail_how", "rail_full"}
    how = vl["vs"]["rail_how"]  # per-seed differences -0.4, -0.5, -0.45
    assert how["final_beyond_diff"] == pytest.approx(-0.45) and how["final_beyond_diff_ci"][1] < 0
    assert how["final_easy_diff_ci"] == pytest.approx([0.0, 0.0]) and how["paired_seeds"] == [0, 1, 2]
    full = vl["vs"]["rail_full"]  # -0.05, +0.05, 0: not told apart
    assert full["final_beyond_diff"] == pytest.approx(0.0, abs=1e-12) and full["final_beyond_diff_ci"][0] < 0 < full["final_beyond_diff_ci"][1]
    md = (root / "report.md").read_text()
    assert "## The learned controller over other action spaces" in md and "below it (interval below 0): `rail_how`" in md
    assert "not told apart from it: `rail_full`" in md and "| `rail_how` | -0.450 |" in md
    # an ablation without such arms has no section
    import shutil
    for arm in ("rail_how", "rail_full"):
        shutil.rmtree(root / arm)
    assert write_report(root)["versus_learned"] is None
    assert "over other action spaces" not in (root / "report.md").read_text()


# ---------------------------------------------------------------------------- a real smoke ablation
@pytest.fixture(scope="module")
def smoke_ablation(tmp_path_factory):
    """The whole controllers ablation (every arm, 1 seed) with the smoke preset, on 2 workers."""
    tmp = tmp_path_factory.mktemp("ablate")
    out, db, cache = tmp / "abl", tmp / "mlflow.db", tmp / "warmstart"
    t0 = time.time()
    r = ablate("--config", str(CONTROLLERS), "--preset", "smoke", "--workers", "2", "--out", str(out),
               "--tracking-uri", f"sqlite:///{db}", cache=cache)
    return {"out": out, "db": db, "cache": cache, "result": r, "seconds": time.time() - t0}


def test_smoke_ablation_runs_every_arm_nested_in_one_parent_run(smoke_ablation):
    out, r = smoke_ablation["out"], smoke_ablation["result"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ab = load_ablation(CONTROLLERS)
    state = json.loads((out / "ablation.json").read_text())
    assert set(state["jobs"]) == {f"{a}/seed0" for a in ab.arms}
    assert all(e["status"] == "finished" and e["returncode"] == 0 for e in state["jobs"].values())
    assert state["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)
    # the seed's warm start was trained by its first job only; the others waited for its cache, not for the job
    assert r.stdout.count("(trains the warm start)") == 1, r.stdout
    # every arm: same budget, same shared config; the job file is a rail train --config TOML
    spent, shared = set(), []
    for arm in ab.arms:
        run = out / arm / "seed0"
        s = json.loads((run / "summary.json").read_text())
        assert s["controller"] == ab.arms[arm]["controller"]["name"]
        spent.add(s["budget"]["spent"]["total"])
        cfg = json.loads((run / "config.json").read_text())
        assert cfg["run"]["threads"] == state["threads"] and cfg["tracking"]["parent_run_id"] == state["parent_run_id"]
        cfg.pop("controller")
        for k in ("name", "out"):
            cfg["run"].pop(k)
        shared.append(cfg)
        assert (out / arm / "seed0.toml").is_file() and (out / arm / "seed0.stdout.log").is_file()
    assert spent == {48} and all(c == shared[0] for c in shared)
    # MLflow: one parent, a nested child per (arm, seed) with per-step metrics and artifacts
    client, runs = mlflow_runs(smoke_ablation["db"])
    parents = [x for x in runs if "mlflow.parentRunId" not in x.data.tags]
    assert len(parents) == 1 and parents[0].info.run_id == state["parent_run_id"]
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["rail.ablation.dir"] == str(out.resolve())
    children = [x for x in runs if x.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(x.info.run_name for x in children) == sorted(f"controllers-{a}-seed0" for a in ab.arms)
    for ch in children:
        assert ch.info.status == "FINISHED", ch.info.run_name
        assert ch.data.tags["rail.arm"] in ab.arms and ch.data.tags["rail.seed"] == "0"
        assert ch.data.params["controller.name"] == ab.arms[ch.data.tags["rail.arm"]]["controller"]["name"]
        hist = client.get_metric_history(ch.info.run_id, "budget/spent_total")
        assert sorted({(m.step, m.value) for m in hist if m.step > 0}) == [(1, 16.0), (2, 32.0), (3, 48.0)]
        assert "summary/beyond_final" in ch.data.metrics
        assert {a.path for a in client.list_artifacts(ch.info.run_id)} >= {"config.json", "summary.json"}
    ladder = next(c for c in children if c.data.tags["rail.arm"] == "ladder")
    assert any(k.startswith("intervention/") and k.endswith("/decisions") and ":" in k for k in ladder.data.metrics)
    arts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"report.md", "report.json", "learning_curves.png", "ablation.json", "ablation.toml"} <= arts
    assert "report/rail/final_beyond" in parent.data.metrics


def test_smoke_ablation_report(smoke_ablation, capsys):
    import numpy as np
    from matplotlib.image import imread

    out = smoke_ablation["out"]
    ab = load_ablation(CONTROLLERS)
    assert main(["report", str(out)]) == 0
    # the same report, found through the MLflow parent run id
    parent = json.loads((out / "ablation.json").read_text())["parent_run_id"]
    assert main(["report", parent, "--tracking-uri", f"sqlite:///{smoke_ablation['db']}"]) == 0
    assert str(out.resolve() / "report.md") in capsys.readouterr().out
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["arms"]) == set(ab.arms)
    for arm, v in rep["arms"].items():
        for k in REQUIRED:
            assert k in v, (arm, k)
        assert v["final_beyond_ci"] is None and v["few_seeds"] is True  # one seed: no interval
        assert 0.0 <= v["final_beyond"] <= 1.0 and 0.0 <= v["zero_variance_share"] <= 1.0
        assert v["wall_seconds"] > 0 and v["budget_spent"] == 48
        assert v["budget_to_match_none"] is None or 0 <= v["budget_to_match_none"] <= 48
    assert rep["arms"]["none"]["acceptance"] == 0.0 and rep["arms"]["none"]["controller_overhead"] == 0.0
    assert rep["arms"]["rail"]["controller_overhead"] > 0.0
    assert rep["budget"]["equal"] is True
    md = (out / "report.md").read_text()
    assert "beat the fixed heuristics beyond the boundary" in md and rep["verdict"]["text"] in md
    assert "higher than plain GRPO" in md and rep["versus_none"]["text"] in md
    assert re.search(r"\*\*(Yes|No|Not shown|Not enough seeds)\*\*", rep["verdict"]["text"])
    assert rep["verdict"]["answer"] == "not enough seeds"  # one seed decides nothing
    assert rep["missing"] == [] and rep["jobs_planned"] == len(ab.arms)
    for arm in ab.arms:
        assert f"| `{arm}` |" in md
    assert rep["figures"]
    for name in rep["figures"]:
        png = out / name
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
        img = imread(png)
        assert img.shape[0] > 200 and img.shape[1] > 300 and float(np.std(img[..., :3])) > 0.02, name
        assert f"]({name})" in md


def test_rerun_skips_finished_resumes_killed_and_records_a_failed_arm(smoke_ablation):
    """On the smoke ablation's directory: a job is started again and the whole ablation (workers too) is
    SIGKILLed once that job has checkpointed; the rerun skips a finished pair, resumes the killed one, and
    records a pair whose resume fails for real (none of its checkpoints is whole) while the others finish."""
    import shutil

    out, db, cache = smoke_ablation["out"], smoke_ablation["db"], smoke_ablation["cache"]
    args = ["--config", str(CONTROLLERS), "--preset", "smoke", "--workers", "2", "--out", str(out),
            "--arms", "none,ladder,dapo", "--tracking-uri", f"sqlite:///{db}"]
    none_summary = out / "none" / "seed0" / "summary.json"
    before = none_summary.stat().st_mtime_ns
    (out / "ladder" / "seed0" / "summary.json").unlink()
    for ck in (out / "ladder" / "seed0" / "checkpoints").glob("step_*"):
        (ck / "manifest.json").unlink()
    dapo = out / "dapo" / "seed0"
    shutil.rmtree(dapo)
    p = launch([*RAIL, "ablate", *args, "--set", f"warmstart.cache_dir={cache}"], stdout=subprocess.DEVNULL,
               stderr=subprocess.DEVNULL, new_session=True)
    latest = dapo / "checkpoints" / "latest"
    wait_for(lambda: latest.is_file() and latest.read_text().strip() == "step_000002", p, "dapo's checkpoint of step 2")
    os.killpg(p.pid, signal.SIGKILL)  # step 3 and the final evaluation are still to come
    p.wait()
    assert latest.is_file() and not (dapo / "summary.json").exists()

    r = ablate(*args, cache=cache)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "FAILED ladder/seed0" in r.stdout
    state = json.loads((out / "ablation.json").read_text())
    jobs = state["jobs"]
    assert jobs["none/seed0"]["action"] == "skip" and jobs["none/seed0"]["attempts"] == 1
    assert none_summary.stat().st_mtime_ns == before
    d = jobs["dapo/seed0"]
    assert d["action"] == "resume" and d["status"] == "finished" and d["attempts"] == 3  # start, start (killed), resume
    s = json.loads((dapo / "summary.json").read_text())
    assert s["steps"] == 3 and s["budget"]["spent"]["total"] == 48
    steps = [json.loads(ln)["step"] for ln in (dapo / "metrics.jsonl").read_text().splitlines()
             if "groups/zero_variance_share" in ln]
    assert steps == [1, 2, 3]  # lines past the checkpoint were dropped, step 3 was logged once
    bad = jobs["ladder/seed0"]
    assert bad["status"] == "failed" and bad["returncode"] == 1
    assert any("no usable checkpoint" in ln and "manifest.json is missing" in ln for ln in bad["stderr_tail"]), \
        bad["stderr_tail"]
    assert state["failed"] == ["ladder/seed0"]
    assert state["arms"] == list(load_ablation(CONTROLLERS).arms)  # a rerun on a subset keeps every arm
    rep = json.loads((out / "report.json").read_text())
    assert "ladder" not in rep["arms"] and rep["arms_missing"] == ["ladder"]
    assert rep["failed"][0]["job"] == "ladder/seed0" and "dapo" in rep["arms"] and "rail" in rep["arms"]
    assert rep["missing"] == [{"arm": "ladder", "seed": 0, "state": "failed"}]
    md = (out / "report.md").read_text()
    assert f"**Missing: 1 of {rep['jobs_planned']} jobs — `ladder` seed 0 failed.**" in md
    assert "## Failed jobs" in md and "manifest.json is missing" in md
    # MLflow: still one parent; the restarted dapo job is one new child, resumed in place, and finished
    _, runs = mlflow_runs(db)
    assert sum("mlflow.parentRunId" not in x.data.tags for x in runs) == 1
    children = [x for x in runs if "mlflow.parentRunId" in x.data.tags]
    assert len(children) == len(load_ablation(CONTROLLERS).arms) + 1
    new = [x for x in children if x.info.run_id == d["mlflow_run_id"]]
    assert len(new) == 1 and new[0].info.status == "FINISHED" and new[0].info.run_name == "controllers-dapo-seed0"


def test_world_per_seed_gives_each_seed_its_own_world(tmp_path):
    """ablation.world_per_seed = true: a job's env.seed is its run seed (five seeds, five worlds); arms of a seed
    share it, and nothing else may set it."""
    path = tmp_path / "w.toml"
    path.write_text('[ablation]\nname = "w"\nseeds = 3\nworld_per_seed = true\n\n'
                    '[arms.none]\ncontroller.name = "none"\n\n[arms.ladder]\ncontroller.name = "ladder"\n')
    jobs = plan_jobs(load_ablation(path), "smoke", tmp_path / "out")
    assert {(j.arm, j.seed, j.cfg.env.seed) for j in jobs} == {(a, s, s) for a in ("none", "ladder") for s in range(3)}
    with pytest.raises(ConfigError, match="world_per_seed"):
        plan_jobs(load_ablation(path), "smoke", tmp_path / "out", sets=[{"env": {"seed": 4}}])
    path.write_text(path.read_text().replace("[arms.none]", "[base.env]\nseed = 2\n\n[arms.none]"))
    with pytest.raises(ConfigError, match="world_per_seed"):
        load_ablation(path)
    path.write_text(path.read_text().replace("world_per_seed = true", "world_per_seed = false"))
    assert {j.cfg.env.seed for j in plan_jobs(load_ablation(path), "smoke", tmp_path / "out")} == {2}
