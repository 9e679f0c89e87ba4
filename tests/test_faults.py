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

from processes import RAIL, ROOT, child_env, launch, rail, wait_for
from rail.config import Config, ConfigError, build_config, parse_set



def cli(*args, cwd=None, env=None, timeout=300):
    return rail(*args, cwd=cwd, env=child_env(**(env or {})), timeout=timeout)


def one_line_error(r, *needles, rc=None):
    """The process failed with one ``rail: ...`` error line on stderr that names every needle, and no traceback
    (``rail: warning:`` lines may come before it)."""
    assert r.returncode != 0 and (rc is None or r.returncode == rc), (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("rail:") and not ln.startswith("rail: warning:")]
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


# ---------------------------------------------------------------------------- one finished run, shared
#: a cut-down smoke run: 2 steps, a checkpoint after each, a few evaluation tasks (the learned controller, so
#: there is a trace)
SMALL = ["run.steps=2", "run.checkpoint_every=1", "budget.rollouts_per_step=8", "eval.tasks_per_level=1",
         "eval.levels=[1, 3]", "eval.every=100"]


@pytest.fixture(scope="module")
def ws_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmstart"))


def small_cfg(out: Path, ws_cache: str, *sets: str, uri: str = ""):
    return build_config("smoke", sets=[*(parse_set(s) for s in SMALL), *(parse_set(s) for s in sets),
                                       {"run": {"out": str(out)}, "tracking": {"uri": uri},
                                        "warmstart": {"cache_dir": ws_cache}}])


def small_args(out: Path, ws_cache: str) -> list[str]:
    sets = [*SMALL, f"warmstart.cache_dir='{ws_cache}'"]
    return ["train", "--preset", "smoke", "--out", str(out), "--tracking-uri", "", "--no-progress",
            *(x for s in sets for x in ("--set", s))]


class FailingServer:
    """An HTTP server that answers every request with 503 and counts them: an MLflow server that is down."""

    def __init__(self):
        import http.server
        import threading

        outer = self
        self.requests = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def _fail(self):
                outer.requests += 1
                self.send_response(503)
                self.end_headers()

            do_GET = do_POST = _fail

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def finished(tmp_path_factory, ws_cache):
    """One finished cut-down run, tracked to an MLflow server that is down: (run directory, what happened)."""
    import warnings

    from rail.train import start_run

    out = tmp_path_factory.mktemp("finished") / "run"
    server = FailingServer()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer, _ = start_run(small_cfg(out, ws_cache, uri=server.uri), show_progress=False)
            trainer.run()
    finally:
        server.close()
    return out, {"requests": server.requests, "warnings": [str(w.message) for w in caught]}


def copy_run(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def resume_in_process(out: Path):
    """Resume ``out`` to the end in this process; (summary, the warnings it gave)."""
    import warnings

    from rail.train import resume_run

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _ = resume_run(out, show_progress=False)
        summary = trainer.run()
    return summary, [str(w.message) for w in caught]


def training_steps(out: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()
            if "rollout/reward_mean" in ln]


# ---------------------------------------------------------------------------- MLflow
def test_mlflow_unreachable_costs_one_request_and_the_summary_says_so(finished):
    out, seen = finished
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 2 and training_steps(out) == [1, 2]  # the run's own files are complete
    assert s["tracking"]["status"] == "failed" and "503" in s["tracking"]["error"]
    assert any("MLflow tracking disabled" in w for w in seen["warnings"])
    assert seen["requests"] == 1  # MLflow's own retries (7, backoff: minutes) are off


def test_mlflow_connection_refused_is_a_disabled_tracker_not_a_stall():
    import socket

    from rail.tracking import MlflowTracker

    with socket.socket() as s:  # a port held, never listened on: a connection is refused, whatever else runs here
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.warns(UserWarning, match="MLflow tracking disabled"):
            t = MlflowTracker(f"http://127.0.0.1:{port}", "rail", "x")
    assert not t.ok and str(port) in t.error
    t.log_metrics({"a": 1.0}, 1)  # a no-op now


# ---------------------------------------------------------------------------- killed before its first checkpoint
def test_killed_before_its_first_checkpoint_resumes_and_restarts(tmp_path, ws_cache, finished):
    import signal

    from rail.rundir import has_checkpoint
    from rail.train import start_run

    killed = tmp_path / "killed"
    p = launch([*RAIL, *small_args(killed, ws_cache)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: (killed / "config.json").exists(), p, "the run's config.json")
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert (killed / "config.json").exists() and not has_checkpoint(killed)
    again = copy_run(killed, tmp_path / "again")
    # resume: nothing was finished, so it starts again from the beginning with the run's own config
    summary, said = resume_in_process(killed)
    assert summary["steps"] == 2 and training_steps(killed) == [1, 2]
    assert any("stopped before its first one" in w for w in said)
    # or start it again with the same --out: the unfinished run is replaced (its partial files go), not refused
    with pytest.warns(UserWarning, match="stopped before its first checkpoint"):
        trainer, _ = start_run(small_cfg(again, ws_cache), show_progress=False)
    trainer.tracker.close()
    trainer.lock.release()
    assert (again / "metrics.jsonl").read_text() == "" and not (again / "traces" / "decisions.dsjson").exists()


# ---------------------------------------------------------------------------- damaged checkpoints
def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["corrupt_weights", "deleted", "latest_outside_the_run", "latest_not_utf8"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, finished, damage):
    src, _ = finished
    out = copy_run(src, tmp_path / "run")
    (out / "summary.json").unlink()
    ck = out / "checkpoints"
    stale = ck / ".step_000003.k1ll3d"  # what a writer killed mid-write leaves
    (stale / "model").mkdir(parents=True)
    if damage == "corrupt_weights":
        _flip_a_byte(ck / "step_000002" / "model" / "model.safetensors")
    elif damage == "deleted":  # what the old error message advised doing
        shutil.rmtree(ck / "step_000002")
    elif damage == "latest_outside_the_run":
        other = copy_run(ck / "step_000001", tmp_path / "other" / "checkpoints" / "step_000001")
        (ck / "latest").write_text(os.path.relpath(other, ck) + "\n")
    else:
        (ck / "latest").write_bytes(b"\xffstep_000002\n")
    summary, said = resume_in_process(out)
    assert summary["steps"] == 2 and training_steps(out) == [1, 2]
    assert not stale.exists()
    # the resumed run is the uninterrupted one: the same decisions, event for event, and the same spend
    assert (out / "traces" / "decisions.dsjson").read_bytes() == (src / "traces" / "decisions.dsjson").read_bytes()
    assert summary["budget"]["spent"] == json.loads((src / "summary.json").read_text())["budget"]["spent"]
    if damage in ("corrupt_weights", "deleted"):  # fell back to step 1 and trained step 2 again
        assert any("resuming from step_000001" in w for w in said)
        assert summary["model"]["source"] == f"checkpoint {ck / 'step_000001'}"
        assert ("model.safetensors" if damage == "corrupt_weights" else "step_000002") in " ".join(said)
    else:  # the pointer is passed over, never followed out of the run; step 2 is intact and used
        assert any("latest" in w and "does not name a checkpoint of this run" in w for w in said)
        assert summary["model"]["source"] == f"checkpoint {ck / 'step_000002'}"
    assert (ck / "latest").read_text() == "step_000002\n"  # rewritten by step 2, or mended on resume


def test_no_usable_checkpoint_is_one_line_naming_each(tmp_path, finished, capsys):
    src, _ = finished
    out = copy_run(src, tmp_path / "run")
    for step in ("step_000001", "step_000002"):
        _flip_a_byte(out / "checkpoints" / step / "optimizer.pt")
    line = one_line_error(run_main(capsys, "resume", str(out), "--no-progress"), "step_000001", "step_000002",
                          "optimizer.pt", "start this run again from the beginning", rc=1)
    assert "checksum" in line


# ---------------------------------------------------------------------------- damaged traces on resume
def test_trace_with_a_junk_line_is_mended_on_resume(tmp_path, finished):
    src, _ = finished
    out = copy_run(src, tmp_path / "run")
    trace = out / "traces" / "decisions.dsjson"
    lines = trace.read_bytes().split(b"\n")
    trace.write_bytes(b"\n".join([lines[0], b'42', b"\xff\xfe junk", *lines[1:]]))
    summary, said = resume_in_process(out)
    assert any("dropped 2 damaged line(s)" in w and "line 2, 3" in w for w in said)
    assert trace.read_bytes() == (src / "traces" / "decisions.dsjson").read_bytes()
    r = cli("traces", "evaluate", str(out), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["events"] == len(lines) - 1


def test_trace_missing_checkpointed_events_falls_back_or_refuses(tmp_path, finished, capsys):
    from controller.traces import read

    src, _ = finished
    learned = [json.loads((src / "checkpoints" / s / "state.json").read_text())["controller"]["learned"]["learned"]
               for s in ("step_000001", "step_000002")]
    assert 0 < learned[0] < learned[1], learned  # each step decided something
    # the last event torn mid-line: step 2's checkpoint learned it, step 1's did not -> step 2 is run again
    out = copy_run(src, tmp_path / "torn")
    trace = out / "traces" / "decisions.dsjson"
    data = trace.read_bytes()
    trace.write_bytes(data[: data.rstrip(b"\n").rfind(b"\n") + 40])
    summary, said = resume_in_process(out)
    assert any("step_000002" in w and "does not match the trace" in w and "resuming from step_000001" in w
               for w in said)
    assert trace.read_bytes() == data and len(read(trace)) == learned[1]
    # cut inside the first event: no checkpoint's events are all there -> refused, naming the trace
    out = copy_run(src, tmp_path / "cut")
    (out / "traces" / "decisions.dsjson").write_bytes(data[:40])
    one_line_error(run_main(capsys, "resume", str(out), "--no-progress"), "decisions.dsjson",
                   "holds 0 intact events", rc=1)


# ---------------------------------------------------------------------------- one process per run directory
def test_second_process_on_the_same_out_is_refused_naming_the_first(tmp_path, finished, ws_cache, capsys):
    from rail.rundir import RunLock

    src, _ = finished
    out = copy_run(src, tmp_path / "run")
    empty = tmp_path / "empty"
    empty.mkdir()
    holders = [RunLock(out), RunLock(empty)]  # what a running `rail train` holds, from its start to its end
    try:
        pid = f"pid {os.getpid()}"
        one_line_error(cli("resume", str(out), "--no-progress"), pid, str(out), rc=1)  # two resumes
        one_line_error(run_main(capsys, *small_args(empty, ws_cache)), pid, rc=1)  # two fresh starts (flock: per
        # open file, so this process's second open is refused like another process's)
    finally:
        for h in holders:
            h.release()
    assert not (empty / "config.json").exists()


def test_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    from rail.rundir import LOCK, RunLock

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK).write_text(dead.stdout)  # a SIGKILLed run leaves its pid behind; the kernel dropped its lock
    lock = RunLock(tmp_path)
    assert (tmp_path / LOCK).read_text().strip() == str(os.getpid())
    lock.release()


# ---------------------------------------------------------------------------- full disk
def _can_mount_tmpfs(where: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs '{where}'"],
                       capture_output=True)
    return r.returncode == 0


def test_disk_full_during_a_checkpoint_on_a_small_tmpfs(tmp_path, ws_cache, finished):
    """A real full disk: the run trains in a private mount namespace on a tmpfs that holds one checkpoint and
    not two; what it left is copied out and resumed with room."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if not _can_mount_tmpfs(mnt):
        pytest.skip("cannot mount a tmpfs here (needs root); test_checkpoint_write_failure_keeps_the_last_one "
                    "covers the write path")
    size = sum(f.stat().st_size for f in (finished[0] / "checkpoints" / "step_000001").rglob("*") if f.is_file())
    args = " ".join(f"'{a}'" for a in small_args(mnt / "run", ws_cache))
    script = (f"mount -t tmpfs -o size={int(size * 1.6) // 1024}k tmpfs '{mnt}' && "
              f"'{sys.executable}' -m rail.cli {args}; rc=$?; cp -a '{mnt}/run' '{tmp_path}/run'; exit $rc")
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    one_line_error(r, "cannot write checkpoint step_000002", "step_000001", "rail resume", rc=1)
    out = tmp_path / "run"
    assert (out / "checkpoints" / "latest").read_text() == "step_000001\n"
    assert not list((out / "checkpoints").glob(".step_*"))
    summary, _ = resume_in_process(out)
    assert summary["steps"] == 2 and training_steps(out) == [1, 2]


def test_checkpoint_write_failure_keeps_the_last_one(tmp_path, finished, monkeypatch):
    """The same write path with ENOSPC simulated (for machines that cannot mount a tmpfs)."""
    import errno

    import torch

    from policy.checkpoint import CheckpointError, save_checkpoint, verify_checkpoint
    from policy.model import load_policy

    src, _ = finished
    out = copy_run(src, tmp_path / "run")
    ck = out / "checkpoints"
    model, tok = load_policy(ck / "step_000002" / "model")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint step_000003 .*No space left.*newest step_000002"):
        save_checkpoint(ck, 3, model, tok, {}, {})
    assert (ck / "latest").read_text() == "step_000002\n" and not list(ck.glob(".step_*"))
    verify_checkpoint(ck / "step_000002")


# ---------------------------------------------------------------------------- bad paths and damaged files
def test_out_that_cannot_be_a_directory(tmp_path, ws_cache, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    one_line_error(run_main(capsys, *small_args(a_file, ws_cache)), "is a file", rc=1)
    one_line_error(run_main(capsys, *small_args(a_file / "run", ws_cache)), "a part of this path is a file", rc=1)
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:  # root writes through permissions: make a read-only file system instead
        script = (f"mount -t tmpfs -o ro,size=1m tmpfs '{ro}' && '{sys.executable}' -m rail.cli "
                  + " ".join(f"'{a}'" for a in small_args(ro / "run", ws_cache)))
        if not _can_mount_tmpfs(ro):
            pytest.skip("root, but cannot mount a read-only tmpfs here")
        r = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True)
        one_line_error(r, "read-only file system", rc=1)
    else:
        ro.chmod(0o555)
        one_line_error(run_main(capsys, *small_args(ro / "run", ws_cache)), str(ro / "run"), rc=1)


def test_damaged_config_json_on_resume_and_eval(tmp_path, finished, capsys):
    src, _ = finished
    out = copy_run(src, tmp_path / "run")
    (out / "config.json").write_bytes(b"\xff" + (src / "config.json").read_bytes())
    one_line_error(run_main(capsys, "resume", str(out)), "config.json", "not UTF-8", rc=2)
    (out / "config.json").write_bytes((src / "config.json").read_bytes()[:100])
    one_line_error(run_main(capsys, "eval", str(out)), "config.json", "not valid JSON", "restore", rc=2)


def run_main(capsys, *args):
    """``rail ARGS`` in this process (a raw traceback would escape as the exception): its rc and stderr."""
    from rail.cli import main

    rc = main(list(args))
    err = capsys.readouterr().err
    return subprocess.CompletedProcess(args, rc, "", err)


@pytest.mark.parametrize("damage,needle", [
    ("number_line", "not an event (a JSON object), got int"),
    ("string_propensity", "propensity '0.5' is not a number"),
    ("binary_file", "not UTF-8"),
    ("controller_json", "controller.json: unreadable"),
    ("missing_keys", "not a rail decision event"),
])
def test_traces_evaluate_on_damaged_traces(tmp_path, finished, capsys, damage, needle):
    src, _ = finished
    d = tmp_path / "traces"
    shutil.copytree(src / "traces", d)
    trace = d / "decisions.dsjson"
    lines = trace.read_text().splitlines()
    first = json.loads(lines[0])
    if damage == "number_line":
        lines.insert(1, "42")
    elif damage == "string_propensity":
        first["_label_probability"] = "0.5"
        lines[0] = json.dumps(first)
    elif damage == "missing_keys":
        del first["_actions"]
        lines[0] = json.dumps(first)
    elif damage == "controller_json":
        (d / "controller.json").write_text("{garbled")
    if damage == "binary_file":
        trace.write_bytes(bytes(range(128, 256)) * 4)
    else:
        trace.write_text("\n".join(lines) + "\n")
    one_line_error(run_main(capsys, "traces", "evaluate", str(trace)), str(d), needle, rc=1)


def test_traces_evaluate_bad_arguments(finished, capsys):
    src, _ = finished
    one_line_error(run_main(capsys, "traces", "evaluate", str(src), "--alpha", "5"), "--alpha", rc=1)
    one_line_error(run_main(capsys, "traces", "evaluate", str(src), "--policy", "nosuch@where"),
                   "--policy nosuch@where", "no event", "rubric_hint@violation", rc=1)
    r = run_main(capsys, "traces", "evaluate", str(src), "--policy", "rubric_hint@violation", "--json")
    assert r.returncode == 0


def _ablation_dir(root: Path, run: Path) -> Path:
    """An ablation directory of two arms, each the shared run, as `rail ablate` lays it out."""
    for arm in ("none", "rail"):
        copy_run(run, root / arm / "seed0")
    (root / "ablation.json").write_text(json.dumps({"name": "t", "arms": ["none", "rail"], "seeds": [0], "jobs": {}}))
    return root


def test_report_on_a_garbled_ablation_json(tmp_path, finished, capsys):
    root = _ablation_dir(tmp_path / "ab", finished[0])
    (root / "ablation.json").write_text('{"name": "t", "arms": [')
    one_line_error(run_main(capsys, "report", str(root)), "ablation.json", "not valid JSON", "rerun", rc=2)


def test_an_arms_damaged_summary_is_named_and_its_job_runs_again(tmp_path, finished, capsys):
    from rail.lab.ablate import Job, classify
    from rail.train import read_run_config

    root = _ablation_dir(tmp_path / "ab", finished[0])
    bad = root / "rail" / "seed0" / "summary.json"
    bad.write_text(bad.read_text()[:50])
    r = run_main(capsys, "report", str(root), "--json")
    assert r.returncode == 0 and str(bad) in r.stderr  # a warning names it
    rep = json.loads((root / "report.json").read_text())
    assert list(rep["arms"]) == ["none"] and str(bad) in " ".join(rep["damaged"])
    assert str(bad) in rep["verdict"]["text"]
    job = Job("rail", 0, bad.parent, read_run_config(bad.parent))
    with pytest.warns(UserWarning, match="summary.json: damaged"):
        assert classify(job) == "resume"  # not skipped forever: resuming writes the summary again
    (root / "none" / "seed0" / "summary.json").write_text("")
    one_line_error(run_main(capsys, "report", str(root)), "no finished run", str(bad), rc=2)


# ---------------------------------------------------------------------------- broken environments
def test_tool_that_raises_or_returns_garbage_is_a_tool_error():
    from rail.envs import ToolRunner, make_env

    env = make_env("calc", 0)
    task = env.eval_tasks(1, 1)[0]
    runner = ToolRunner(env)
    for broken, why in ((lambda t, a: 1 / 0, "raised ZeroDivisionError"), (lambda t, a: float("nan"), "returned nan"),
                        (lambda t, a: (float("inf"), True, False), "returned (inf")):
        env.execute = broken
        st = runner.step(task, "calc(1, +, 2)")
        assert st.observation == "error : tool failed" and not st.ok and not st.done and st.error.startswith(why)


def test_broken_verifier_and_tools_cost_rewards_not_the_run(tmp_path, ws_cache, finished):
    import warnings

    from rail.train import start_run

    # every call fails, so every rollout runs to max_turns: the fewest the levels allow
    trainer, out = start_run(small_cfg(tmp_path / "run", ws_cache, "rollout.max_turns=4"), show_progress=False)
    for env in trainer.envs.values():
        env.reward = lambda task, steps: 1 / 0
        env.execute = lambda task, action: (float("nan"), True, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = trainer.run()
    m = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if "errors/reward" in ln]
    assert [x["step"] for x in m] == [1, 2] and summary["steps"] == 2
    assert all(x["errors/reward"] == x["rollout/count"] + x["intervention/rollouts"] > 0 for x in m)
    assert all(x["errors/tool"] > 0 and x["rollout/tool_failure_rate"] == 1.0 for x in m)
    assert summary["errors"]["reward"] == sum(x["errors/reward"] for x in m)
    assert summary["errors"]["tool"] == sum(x["errors/tool"] for x in m)
    assert any("raised ZeroDivisionError" in str(w.message) for w in caught)
