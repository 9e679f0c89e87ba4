"""The command line's grammar (docs/usage.md): help and version, one positional RUN for every command that acts on
an existing run (and the old spellings as hidden aliases), ``ablate --seeds``, ``report --out``, ``train
--print-config`` / ``--dry-run``, the checks of every path and name before an output directory is made, and
``traces show``.

Argument, config and path checks run in-process or as short subprocesses; the commands that read a real run share
one cut-down smoke run of the learned controller (a module fixture)."""

from __future__ import annotations

import argparse
import json
import re
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest

from processes import ROOT, rail
from rail.cli import LEARNED, main, make_parser, parse_seeds
from rail.config import PRESETS, Config, build_config, parse_set
from rail.controllers import CONTROLLERS

SMALL = ["run.steps=2", "run.checkpoint_every=1", "budget.rollouts_per_step=8", "eval.tasks_per_level=1",
         "eval.levels=[1, 3]", "eval.every=100"]


def run_main(capsys, *args) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(err: str) -> str:
    """The one ``rail: ...`` line of a refused command line."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rail: ") and "Traceback" not in err, err
    return lines[0]


def files_under(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> Path:
    """A finished cut-down smoke run of the learned controller, trained by `rail train`."""
    root = tmp_path_factory.mktemp("cli")
    out = root / "run"
    sets = [*SMALL, f"warmstart.cache_dir='{root / 'ws'}'"]
    r = rail("train", "--preset", "smoke", "--tracking-uri", "", "--no-progress", "--out", str(out),
             "--controller", LEARNED, *(x for s in sets for x in ("--set", s)), cwd=root, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "traces" / "decisions.dsjson").is_file() and (out / "summary.json").is_file()
    return out


def fixed_run(d: Path, controller: str, config: bool = True) -> Path:
    """The files a finished run of a fixed controller leaves that say which controller it was."""
    d.mkdir(parents=True)
    if config:
        cfg = Config()
        cfg.controller.name = controller
        (d / "config.json").write_text(json.dumps(cfg.to_dict()))
    (d / "summary.json").write_text(json.dumps({"controller": controller, "steps": 2}))
    return d


# ---------------------------------------------------------------------------- 1. help and version
def test_bare_rail_prints_the_help_and_starts_nothing(tmp_path):
    r = rail(cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: rail") and r.stderr == ""
    for cmd in ("train", "resume", "eval", "traces", "ablate", "report"):
        assert re.search(rf"^\s+{cmd}\s+\S", r.stdout, re.MULTILINE), cmd
    assert list(tmp_path.iterdir()) == []


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"rail {version('rail')}"


def _subparsers(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, by its full name (``traces show``)."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[prefix + name] = sub
                out.update(_subparsers(sub, f"{prefix}{name} "))
    return out


def test_every_command_has_a_description_and_help_shows_defaults_and_choices():
    parser = make_parser()
    top = parser.format_help()
    assert parser.description.endswith(".") and "RAIL" in top
    subs = _subparsers(parser)
    assert set(subs) == {"train", "resume", "eval", "traces", "traces evaluate", "traces show", "ablate", "report"}
    for name, sub in subs.items():
        assert sub.description and sub.description.rstrip().endswith("."), name
    train = " ".join(subs["train"].format_help().split())  # unwrapped
    assert "{" + ",".join(CONTROLLERS) + "}" in train and "{" + ",".join(PRESETS) + "}" in train
    assert f"run.steps (default: {Config().run.steps})" in train
    assert "(default: default)" in train  # --preset
    assert "--resume" not in train  # the old spelling is hidden
    assert "--checkpoint" not in subs["eval"].format_help()
    assert "(default: 0.05)" in " ".join(subs["traces evaluate"].format_help().split())
    assert "(default: process)" in " ".join(subs["ablate"].format_help().split())


# ---------------------------------------------------------------------------- 2. RUN, and the old spellings
def test_old_spellings_still_work_and_say_the_new_form(smoke_run, capsys):
    rc, out, err = run_main(capsys, "train", "--resume", str(smoke_run), "--dry-run")
    assert rc == 0, err
    assert err.strip() == "rail: warning: `rail train --resume DIR` is spelled `rail resume DIR` now"
    assert f"run dir:     {smoke_run} (would continue from checkpoints/step_000002" in out
    rc2, out2, _ = run_main(capsys, "resume", str(smoke_run), "--dry-run")
    assert rc2 == 0 and out2 == out


def test_eval_takes_run_and_the_old_checkpoint_flag(smoke_run):
    r = rail("eval", "--checkpoint", str(smoke_run / "checkpoints" / "step_000001"), "--json",
             "--tasks-per-level", "1", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "`rail eval --checkpoint DIR` is spelled `rail eval DIR` now" in r.stderr
    res = json.loads(r.stdout)
    assert set(res) == {"lookup", "calc", "kin"} and all(set(d) == {"1", "3"} for d in res.values())


def test_eval_wants_one_run(smoke_run, capsys):
    rc, _, err = run_main(capsys, "eval")
    assert rc == 2 and "RUN" in one_line(err)
    rc, _, err = run_main(capsys, "eval", str(smoke_run), "--checkpoint", str(smoke_run))
    assert rc == 2 and "not both" in one_line(err)


def test_eval_and_resume_of_a_run_without_a_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(Config().to_dict()))
    rc, _, err = run_main(capsys, "eval", str(run))
    assert rc == 2 and "no checkpoint yet" in one_line(err) and f"rail resume {run}" in err
    rc, out, err = run_main(capsys, "resume", str(run), "--dry-run")
    assert rc == 0, err
    assert "no checkpoint yet: would start again from the beginning" in out
    assert files_under(tmp_path) == ["run", "run/config.json"]


def test_docs_and_examples_use_the_current_grammar():
    old = re.compile(r"train --resume|eval --checkpoint")
    paths = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "claim").glob("*.md"),
             *(ROOT / "experiments").rglob("*.py"), *(ROOT / "experiments").rglob("*.toml"),
             *(ROOT / "rail").rglob("*.py")]
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in paths for n, line in enumerate(p.read_text().splitlines(), 1)
            if old.search(line) and p.name != "cli.py"]
    assert not hits, hits


# ---------------------------------------------------------------------------- 3. ablate --seeds
@pytest.mark.parametrize("text, seeds", [("5", [0, 1, 2, 3, 4]), ("1", [0]), ("0,3,7", [0, 3, 7]),
                                         ("[0,3,7]", [0, 3, 7]), ("[2]", [2]), (" 4, 1 ", [4, 1])])
def test_seeds_is_a_count_or_a_list(text, seeds):
    assert parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["0", "-1", "a", "1,1", "", "[1,", "3.5", "1,-2"])
def test_bad_seeds_exit_2_naming_the_flag(tmp_path, capsys, text):
    out = tmp_path / "o"
    rc, _, err = run_main(capsys, "ablate", "--config", str(ROOT / "experiments/ablations/controllers.toml"),
                          "--seeds", text, "--out", str(out))
    assert rc == 2 and "--seeds" in one_line(err)
    assert not out.exists()


def test_ablate_runs_the_seeds_listed(tmp_path, capsys):
    out = tmp_path / "o"
    rc, stdout, err = run_main(capsys, "ablate", "--config", str(ROOT / "experiments/ablations/controllers.toml"),
                               "--preset", "smoke", "--arms", "none,rail", "--seeds", "0,3", "--out", str(out),
                               "--tracking-uri", "", "--dry-run")
    assert rc == 0, err
    keys = [ln.split()[1] for ln in stdout.splitlines() if ln.startswith("start ")]
    assert sorted(keys) == ["none/seed0", "none/seed3", "rail/seed0", "rail/seed3"], stdout
    assert not out.exists()


# ---------------------------------------------------------------------------- 4. report --out
def _ablation(root: Path) -> Path:
    from test_report_axes import fake_run

    for seed in (0, 1):
        fake_run(root / "none" / f"seed{seed}", "none", seed, [0.0, 0.1, 0.2], [0.3, 0.4, 0.5])
        fake_run(root / "rail" / f"seed{seed}", "rail", seed, [0.0, 0.2, 0.4], [0.3, 0.4, 0.5])
    return root


def test_report_out_writes_the_report_there_and_leaves_the_ablation_alone(tmp_path, capsys):
    root = _ablation(tmp_path / "ab")
    before = files_under(root)
    dest = tmp_path / "elsewhere" / "report"
    rc, out, err = run_main(capsys, "report", str(root), "--out", str(dest))
    assert rc == 0, err
    assert files_under(root) == before
    assert (dest / "report.md").is_file() and json.loads((dest / "report.json").read_text())["arms"]
    figures = json.loads((dest / "report.json").read_text())["figures"]
    assert figures and all((dest / f).is_file() for f in figures)
    assert f"report: {dest / 'report.md'}" in out
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    rc, _, err = run_main(capsys, "report", str(root), "--out", str(a_file))
    assert rc == 2 and "--out" in one_line(err)


# ---------------------------------------------------------------------------- 5. --print-config, --dry-run
def test_print_config_is_every_field_and_reads_back_to_the_same_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    sets = ["learner.lr=5e-4", "controller.ladder_by_cell={\"kin/3\" = [\"rubric_hint@start\"]}",
            "env.options.kin={}", "learner.shift_threshold=inf", "run.name='a \"quoted\" name'"]
    args = ["train", "--preset", "smoke", "--steps", "7", "--controller", "ladder",
            *(x for s in sets for x in ("--set", s)), "--print-config"]
    rc, text, err = run_main(capsys, *args)
    assert rc == 0 and err == ""
    assert list(tmp_path.iterdir()) == []  # nothing written
    raw = tomllib.loads(text)
    for sec in fields(Config):
        assert set(raw[sec.name]) == {f.name for f in fields(getattr(Config(), sec.name))}, sec.name
    want = build_config("smoke", None, [{"run": {"steps": 7}, "controller": {"name": "ladder"}},
                                        *(parse_set(s) for s in sets)])
    assert build_config("default", raw) == want
    assert raw["learner"]["shift_threshold"] == float("inf") and raw["run"]["name"] == 'a "quoted" name'
    (tmp_path / "printed.toml").write_text(text)
    rc, again, _ = run_main(capsys, "train", "--config", str(tmp_path / "printed.toml"), "--print-config")
    assert rc == 0 and again == text


def test_dry_run_checks_everything_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_main(capsys, "train", "--preset", "smoke", "--dry-run")  # default tracking: sqlite file
    assert rc == 0, err
    assert out.splitlines()[0] == f"run dir:     {Path('runs') / 'smoke'} (would be created)"
    for key in ("model:", "envs:        lookup, calc, kin at levels 1, 2, 3", "budget:      16 rollouts per step",
                "controller:  rail (learned)", "steps:       3", "nothing written"):
        assert key in out, key
    assert list(tmp_path.iterdir()) == []
    rc, _, err = run_main(capsys, "train", "--preset", "smoke", "--dry-run", "--set", "env.levels=[9]")
    assert rc == 2 and "env.levels" in one_line(err)
    assert list(tmp_path.iterdir()) == []


def test_dry_run_refuses_an_out_that_holds_a_run(smoke_run, capsys):
    before = files_under(smoke_run)
    rc, _, err = run_main(capsys, "train", "--preset", "smoke", "--dry-run", "--out", str(smoke_run))
    assert rc == 1 and f"rail resume {smoke_run}" in one_line(err)
    rc, out, err = run_main(capsys, "train", "--preset", "smoke", "--dry-run", "--tracking-uri", "",
                            "--out", str(smoke_run.parent / "next"), "--controller-from", str(smoke_run))
    assert rc == 0, err
    assert f"starting from {smoke_run}" in out and not (smoke_run.parent / "next").exists()
    assert files_under(smoke_run) == before


# ---------------------------------------------------------------------------- 6. paths and names, before any directory
@pytest.mark.parametrize("args, needle", [
    (["train", "--config", "nope.toml"], "--config nope.toml: no such file"),
    (["train", "--model", "no-such-model"], "--model"),
    (["train", "--controller", "oracle"], "--controller"),
    (["train", "--controller-from", "nowhere"], "--controller-from nowhere"),
    (["resume", "nowhere"], "RUN nowhere: no such directory"),
    (["eval", "nowhere"], "RUN nowhere: no such directory"),
    (["traces", "evaluate", "nowhere"], "RUN nowhere: no such file or directory"),
    (["traces", "show", "nowhere"], "RUN nowhere: no such file or directory"),
    (["ablate", "--config", str(ROOT / "experiments/ablations/controllers.toml"), "--arms", "none,nope"], "--arms"),
    (["ablate", "--config", "nope.toml"], "nope.toml"),
])
def test_a_bad_path_or_name_is_one_line_exit_2_and_makes_no_directory(tmp_path, args, needle):
    if args[0] in ("train", "ablate"):
        args = [*args, "--preset", "smoke", "--out", "out"]
    r = rail(*args, cwd=tmp_path, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in one_line(r.stderr)
    assert list(tmp_path.iterdir()) == []  # no runs/, no --out, no MLflow store


def test_controller_from_a_fixed_controllers_run(tmp_path, capsys):
    run = fixed_run(tmp_path / "ladder-run", "ladder")
    rc, _, err = run_main(capsys, "train", "--preset", "smoke", "--controller-from", str(run), "--out",
                          str(tmp_path / "out"))
    line = one_line(err)
    assert rc == 2 and "--controller-from" in line and "controller 'ladder' writes no trace" in line
    assert not (tmp_path / "out").exists()


def test_resume_of_a_directory_that_is_not_a_run(tmp_path, capsys):
    (tmp_path / "plain").mkdir()
    rc, _, err = run_main(capsys, "resume", str(tmp_path / "plain"))
    assert rc == 2 and "no config.json" in one_line(err)
    assert files_under(tmp_path) == ["plain"]


# ---------------------------------------------------------------------------- 7. traces show
def test_traces_show_says_each_decision_in_words(smoke_run, capsys):
    from controller.traces import event_step, read

    events = read(smoke_run / "traces" / "decisions.dsjson")
    rc, out, err = run_main(capsys, "traces", "show", str(smoke_run))
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == len(events) > 0
    pattern = re.compile(r"step (?P<step>\d+)  (?P<family>\w+)/(?P<level>\d) group \d+( round \d+)?: "
                         r"chose (?P<action>\S+)(?P<k> x\d+)?( plan \d+)? \(p=\d\.\d\d, (?P<mode>shadow|live)"
                         r"(; heuristic: [^)]+)?\)(?P<ran>; \d+/\d+ succeeded)?.*; reward \d\.\d\d")
    for line, e in zip(lines, events):
        m = pattern.fullmatch(line)
        assert m, line
        s = e["c"]["s"]
        assert int(m["step"]) == event_step(e) and (m["family"], m["level"]) == (s["family"], s["level"])
        chosen = e["_actions"][e["_labelIndex"]]
        assert (m["action"] + (m["k"] or "")).replace(" ", "") == chosen.split(",")[0]
        assert m["mode"] == e["_mode"]
        assert (m["ran"] is not None) == ("rollouts" in e.get("_outcome", {}))
        assert line.endswith(f"reward {-e['_label_cost']:.2f}")


def test_traces_show_limit_and_step(smoke_run, capsys):
    from controller.traces import event_step, read

    events = read(smoke_run / "traces" / "decisions.dsjson")
    rc, out, _ = run_main(capsys, "traces", "show", str(smoke_run), "--limit", "2")
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 3 and lines[2] == f"... {len(events) - 2} more (--limit)"
    last = event_step(events[-1])
    rc, out, _ = run_main(capsys, "traces", "show", str(smoke_run), "--step", str(last))
    lines = out.splitlines()
    assert rc == 0 and len(lines) == sum(event_step(e) == last for e in events)
    assert all(ln.startswith(f"step {last}  ") for ln in lines)
    rc, _, err = run_main(capsys, "traces", "show", str(smoke_run), "--step", "99")
    assert rc == 1 and "--step 99" in one_line(err)
    rc, _, err = run_main(capsys, "traces", "show", str(smoke_run), "--limit", "0")
    assert rc == 2 and "--limit" in one_line(err)
    rc, out, _ = run_main(capsys, "traces", "evaluate", str(smoke_run), "--json")
    assert rc == 0 and json.loads(out)["events"] == len(events)


@pytest.mark.parametrize("command", ["show", "evaluate"])
@pytest.mark.parametrize("controller, config", [("none", True), ("ladder", False)])
def test_traces_of_a_controller_that_writes_none(tmp_path, capsys, command, controller, config):
    run = fixed_run(tmp_path / "run", controller, config=config)
    rc, _, err = run_main(capsys, "traces", command, str(run))
    assert rc == 2
    assert one_line(err) == f"rail: controller '{controller}' writes no trace (only the learned controller does); {run}"


def test_traces_of_a_learned_run_without_a_trace_yet(tmp_path, capsys):
    run = fixed_run(tmp_path / "run", LEARNED)
    rc, _, err = run_main(capsys, "traces", "show", str(run))
    assert rc == 2 and "no decision trace there" in one_line(err)
