"""`rail ablate --backend ray` on a real local Ray instance (2 CPUs): the same run directories, figures and MLflow
runs as the process backend for the smoke preset; each seed's warm start trained once; Ctrl-C cancels the tasks and
a SIGKILLed ablation resumes; a job that raises or whose Ray worker dies is recorded as failed while the others go
on; and no Ray process the run started is left behind. Plus the `[resources]` table and the flags, without Ray.

Every process a test's `rail ablate` starts (the driver, Ray's gcs_server, raylet and workers, the training
processes) inherits an environment variable unique to that run, so the tests find exactly those processes in /proc.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from processes import RAIL, ROOT, child_env, interrupt, launch, wait_for
from rail.lab.ablate import load_ablation
from rail.cli import main

CONTROLLERS = ROOT / "experiments" / "ablations" / "controllers.toml"
ARMS = "none,rail"  # 2 arms x 1 seed of the smoke preset
MARK = "RAIL_TEST_RUN_MARK"
TIMING = re.compile(r"^time/|wall_seconds|^controller/seconds$|^seconds$")  # what may differ between two runs


STARTED: list[str] = []  # the marks of every rail ablate started, so a failed test's processes are ended


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test():
    """Whatever a test's rail ablate started and left running (a test that failed half way) is killed when the
    test ends, so it cannot load the machine for the tests after it."""
    first = len(STARTED)
    yield
    for mark in STARTED[first:]:
        for pid in marked(mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start(*args, out: Path, cache: Path, db: Path | None, mark: str, backend="ray", extra=()) -> subprocess.Popen:
    """`rail ablate` of the smoke controllers ablation on ARMS, in the background, on two cores (both backends
    then train with one thread per job, whatever the machine)."""
    cmd = [*RAIL, "ablate", "--config", str(CONTROLLERS), "--preset", "smoke", "--arms", ARMS, "--out", str(out),
           "--tracking-uri", f"sqlite:///{db}" if db else "", "--set", f"warmstart.cache_dir={cache}",
           "--backend", backend, *args, *extra]
    log = out.parent / f"{out.name}.{uuid.uuid4().hex[:6]}.log"
    STARTED.append(mark)
    with open(log, "w") as f:
        p = launch(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(**{MARK: mark}), cores=2)
    p.log = log
    return p


def output(p: subprocess.Popen) -> str:
    return p.log.read_text()


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie is dead, only not yet reaped


def marked(mark: str, also=()) -> dict[int, str]:
    """pid -> command line of every live process whose environment carries this run's mark, and of the pids in
    ``also`` still alive (seen marked earlier: a process that rewrites its title may overwrite its environment)."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (int(d.name) in also or f"{MARK}={mark}".encode() in (d / "environ").read_bytes().split(b"\0")) \
                    and alive(int(d.name)):
                found[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours
            pass
    return found


def gone(mark: str, timeout: float, also=()) -> dict[int, str]:
    """Wait until no marked process is left; returns those still there after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while (left := marked(mark, also)) and time.time() < deadline:
        time.sleep(0.5)
    return left


def wait_for_checkpoint(run: Path, step: int, p: subprocess.Popen) -> None:
    latest, want = run / "checkpoints" / "latest", f"step_{step:06d}"
    wait_for(lambda: latest.is_file() and latest.read_text().strip() >= want, p, f"{run} checkpointed {want}",
             output=lambda: output(p))


def flat(d: dict, pre: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{pre}{k}.") if isinstance(v, dict) else {f"{pre}{k}": v})
    return out


def figures(run: Path, roots: list[Path]) -> dict:
    """A finished job's summary, metrics and decision trace, less timings and this run's own paths."""
    def clean(v):
        if isinstance(v, str):
            for i, r in enumerate(roots):
                v = v.replace(str(r), f"<root{i}>")
        return v
    summary = {k: clean(v) for k, v in flat(json.loads((run / "summary.json").read_text())).items()
               if not TIMING.search(k.split(".")[-1]) and not k.startswith("time.")}
    metrics = [{k: v for k, v in json.loads(ln).items() if not TIMING.search(k)}
               for ln in (run / "metrics.jsonl").read_text().splitlines()]
    trace = run / "traces" / "decisions.dsjson"
    return {"summary": summary, "metrics": metrics, "trace": trace.read_text() if trace.exists() else None}


def mlflow_view(db: Path, roots: list[Path]) -> dict:
    """The parent run and its children as MLflow holds them: names, statuses, tags, params and every non-timing
    metric's history (paths of this run replaced, so two ablations in different directories compare equal)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{db}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], max_results=1000)

    def clean(v: str) -> str:
        for i, r in enumerate(roots):
            v = v.replace(str(r), f"<root{i}>")
        return re.sub(r"[0-9a-f]{32}", "<run-id>", v)

    def view(r) -> dict:
        return {"status": r.info.status, "name": r.info.run_name,
                "tags": {k: clean(v) for k, v in r.data.tags.items() if k.startswith("rail.")},
                "params": {k: clean(v) for k, v in r.data.params.items()},
                "metrics": {k: sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, k))
                            for k in r.data.metrics if not TIMING.search(k)},
                "artifacts": sorted(a.path for a in client.list_artifacts(r.info.run_id))}
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {r.info.run_name: view(r) for r in runs if "mlflow.parentRunId" in r.data.tags}
    return {"parents": [{k: v for k, v in view(p).items() if k != "metrics"} for p in parents], "children": children}


# ---------------------------------------------------------------------------- the [resources] table and flags
def _file(tmp_path: Path, resources: str) -> Path:
    f = tmp_path / "ab.toml"
    f.write_text(resources + '[ablation]\nname = "r"\n[arms.a]\ncontroller.name = "none"\n')
    return f


def test_resources_table_and_flags(tmp_path, capsys):
    from rail.lab.ablate_ray import job_resources

    ab = load_ablation(_file(tmp_path, "[resources]\nnum_cpus = 2\nnum_gpus = 0.5\n"))
    assert ab.resources == {"num_cpus": 2, "num_gpus": 0.5}
    assert job_resources(ab.resources) == {"num_cpus": 2, "num_gpus": 0.5}
    assert job_resources(ab.resources, num_cpus=4) == {"num_cpus": 4, "num_gpus": 0.5}  # flags win
    assert job_resources({}) == {"num_cpus": 1, "num_gpus": 0}
    # a dry run needs no Ray and says what each job reserves
    rc = main(["ablate", "--config", str(_file(tmp_path, "[resources]\nnum_cpus = 2\n")), "--preset", "smoke",
               "--out", str(tmp_path / "o"), "--backend", "ray", "--num-gpus", "1", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and "2 CPU and 1 GPU each" in out and "2 threads each" in out, out
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("resources, args, needles", [
    ("[resources]\nnum_cpu = 1\n", [], ["resources.num_cpu", "num_cpus, num_gpus"]),
    ("[resources]\nnum_cpus = 0\n", [], ["resources.num_cpus", "> 0"]),
    ("[resources]\nnum_gpus = 1.5\n", [], ["resources.num_gpus", "whole number"]),
    ("[resources]\nnum_gpus = \"one\"\n", [], ["resources.num_gpus"]),
    ("resources = 3\n", [], ["[resources] must be a table"]),
    ("", ["--backend", "ray", "--num-cpus", "-1"], ["--num-cpus", "> 0"]),
    ("", ["--address", "auto"], ["--address", "--backend ray"]),
    ("", ["--num-gpus", "1"], ["--num-gpus", "--backend ray"]),
])
def test_bad_resources_or_flags_are_one_line_and_exit_2(tmp_path, capsys, resources, args, needles):
    out = tmp_path / "o"
    rc = main(["ablate", "--config", str(_file(tmp_path, resources)), "--preset", "smoke", "--out", str(out), *args])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("rail: config error:") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, (n, err)
    assert not out.exists()


@pytest.mark.ray
def test_ray_address_where_nothing_listens_is_one_line(tmp_path, capsys):
    import socket

    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "o"
    rc = main(["ablate", "--config", str(CONTROLLERS), "--preset", "smoke", "--out", str(out), "--backend", "ray",
               "--address", f"127.0.0.1:{port}", "--tracking-uri", ""])
    err = capsys.readouterr().err
    assert rc == 2 and f"--address 127.0.0.1:{port}" in err and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.ray
def test_local_instance_refuses_a_job_larger_than_the_machine(tmp_path):
    out, mark = tmp_path / "o", uuid.uuid4().hex
    p = start(out=out, cache=tmp_path / "ws", db=None, mark=mark, extra=["--num-cpus", "64"])
    assert p.wait(timeout=300) == 2, output(p)
    err = output(p).strip().splitlines()[-1]
    assert err.startswith("rail: config error: [resources] num_cpus = 64") and "--num-cpus" in err, output(p)
    assert not out.exists()
    assert gone(mark, 30) == {}


# ---------------------------------------------------------------------------- the same smoke ablation, both backends
@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """The smoke ablation on ARMS with the process backend (2 workers, 1 thread each) and with the Ray backend
    (a local instance of 2 CPUs, 1 CPU per job), each with its own warm-start cache and MLflow store; the Ray
    run's processes are sampled while it runs."""
    tmp = tmp_path_factory.mktemp("ablate-ray")
    runs = {}
    for name, extra in (("process", ["--workers", "2"]), ("ray", [])):
        out, cache, db, mark = tmp / name, tmp / f"ws-{name}", tmp / f"{name}.db", uuid.uuid4().hex
        p = start(out=out, cache=cache, db=db, mark=mark, backend=name, extra=extra)
        seen: set[str] = set()
        pids: set[int] = set()
        while p.poll() is None:
            now = marked(mark)
            pids |= set(now)
            seen |= {cmd.split()[0].rsplit("/", 1)[-1] if not cmd.startswith("ray::") else "ray::"
                     for cmd in now.values() if cmd}
            time.sleep(0.5)
        runs[name] = {"out": out, "cache": cache, "db": db, "mark": mark, "rc": p.returncode, "stdout": output(p),
                      "seen": seen, "left": gone(mark, 30, pids)}
    runs["tmp"] = tmp
    return runs


@pytest.mark.ray
def test_ray_backend_gives_the_process_backends_runs_and_figures(both):
    p, r = both["process"], both["ray"]
    for run in (p, r):
        assert run["rc"] == 0, run["stdout"][-3000:]
    roots = [both["tmp"] / "process", both["tmp"] / "ray", both["tmp"] / "ws-process", both["tmp"] / "ws-ray"]
    roots_p = [roots[0], roots[2]]
    roots_r = [roots[1], roots[3]]
    sp, sr = (json.loads((x["out"] / "ablation.json").read_text()) for x in (p, r))
    assert sp["backend"] == "process" and sr["backend"] == "ray"
    assert sp["threads"] == sr["threads"] == 1
    assert set(sp["jobs"]) == set(sr["jobs"]) == {"none/seed0", "rail/seed0"}
    for key, e in sr["jobs"].items():
        assert e["status"] == "finished" and e["returncode"] == 0 and e["ray_task_id"] and e["node"], e
        arm = key.split("/")[0]
        # the same files in the same places
        files = lambda root: sorted(str(f.relative_to(root)) for f in (root / arm).rglob("*")
                                    if "checkpoints" not in f.parts)
        assert files(p["out"]) == files(r["out"])
        # the same figures: summary, every step's metrics and the decision trace, all but the timings
        fp, fr = figures(p["out"] / arm / "seed0", roots_p), figures(r["out"] / arm / "seed0", roots_r)
        assert fp["summary"]["budget.spent.total"] == 48 and len(fp["metrics"]) == 7
        assert fp == fr, arm
    # the same report, less timings
    rp, rr = (json.loads((x["out"] / "report.json").read_text()) for x in (p, r))
    clean = lambda rep: {k: v for k, v in flat(rep["arms"]).items() if not TIMING.search(k.split(".")[-1])
                         and "overhead" not in k}
    assert clean(rp) == clean(rr) and rp["verdict"]["text"] == rr["verdict"]["text"]
    # the same MLflow runs: one parent, one nested child per job, the same params, tags and metric histories
    vp, vr = mlflow_view(p["db"], roots_p), mlflow_view(r["db"], roots_r)
    assert len(vp["parents"]) == 1 and sorted(vp["children"]) == ["controllers-none-seed0", "controllers-rail-seed0"]
    assert all(c["status"] == "FINISHED" and c["metrics"] for c in vp["children"].values())
    assert vp == vr


@pytest.mark.ray
def test_each_seeds_warm_start_is_trained_once(both):
    for run in (both["process"], both["ray"]):
        how = {arm: json.loads((run["out"] / arm / "seed0" / "summary.json").read_text())["model"]["warmstart"]
               for arm in ARMS.split(",")}
        assert how["none"].startswith("trained (") and how["rail"].startswith("cached ("), how
        # the other arm started once the cache was there, not after the first job had finished
        assert run["stdout"].count("(trains the warm start)") == 1, run["stdout"]
        jobs = json.loads((run["out"] / "ablation.json").read_text())["jobs"]
        assert jobs["rail/seed0"]["started"] < jobs["none/seed0"]["ended"]


@pytest.mark.ray
def test_ray_run_leaves_no_ray_process(both):
    r = both["ray"]
    assert {"raylet", "gcs_server", "ray::"} <= r["seen"], r["seen"]  # the check below looks at the right things
    assert r["left"] == {}, r["left"]


# ---------------------------------------------------------------------------- interruptions and failures
@pytest.mark.ray
def test_ctrl_c_cancels_the_tasks_and_a_killed_ablation_resumes(both, tmp_path):
    """Thirty steps per job (checkpoints every 2): after rail ablate is SIGKILLed, a job runs on until Ray notices
    its driver is gone and ends the worker, so on a fast machine six more steps could finish first. Ctrl-C once
    the none job has checkpointed step 2: rail ablate exits 130 with the tasks cancelled and no process left.
    Run again and SIGKILL rail ablate alone once none has checkpointed step 4: Ray's processes and the jobs die
    with it. A third run resumes and finishes."""
    out, db, cache = tmp_path / "abl", tmp_path / "mlflow.db", both["ray"]["cache"]  # warm start cached
    long = ["--set", "run.steps=30"]
    none = out / "none" / "seed0"

    mark = uuid.uuid4().hex
    p = start(out=out, cache=cache, db=db, mark=mark, extra=long)
    wait_for_checkpoint(none, 2, p)
    before = marked(mark)
    assert any(_is_job(cmd) for cmd in before.values())
    interrupt(p)
    assert p.wait(timeout=300) == 130, output(p)[-3000:]
    assert "interrupted; rerun the same `rail ablate` command" in output(p)
    assert gone(mark, 30, before) == {}
    state = json.loads((out / "ablation.json").read_text())
    assert state["status"] == "killed" and state["jobs"]["none/seed0"]["status"] == "interrupted"
    assert not (none / "summary.json").exists()

    killed = uuid.uuid4().hex
    p = start(out=out, cache=cache, db=db, mark=killed, extra=long)
    wait_for_checkpoint(none, 4, p)
    before = marked(killed)
    os.kill(p.pid, signal.SIGKILL)  # rail ablate only: what it started must not outlive it
    p.wait()
    assert "resume none/seed0" in output(p)
    jobs = [pid for pid, cmd in before.items() if _is_job(cmd)]
    deadline = time.time() + 30
    while any(map(alive, jobs)) and time.time() < deadline:
        time.sleep(0.2)
    assert jobs and not any(map(alive, jobs)), "the jobs die with their workers at once"

    mark = uuid.uuid4().hex
    p = start(out=out, cache=cache, db=db, mark=mark, extra=long)
    assert p.wait(timeout=600) == 0, output(p)[-3000:]
    assert gone(mark, 30) == {}
    assert gone(killed, 120, before) == {}  # the killed run's Ray agents too, after their 60 s graceful shutdown
    state = json.loads((out / "ablation.json").read_text())
    e = state["jobs"]["none/seed0"]
    assert e["status"] == "finished" and e["action"] == "resume" and e["attempts"] == 3
    for arm in ARMS.split(","):
        s = json.loads((out / arm / "seed0" / "summary.json").read_text())
        assert s["steps"] == 30 and s["budget"]["spent"]["total"] == 480
        steps = [json.loads(ln)["step"] for ln in (out / arm / "seed0" / "metrics.jsonl").read_text().splitlines()
                 if "groups/zero_variance_share" in ln]
        assert steps == list(range(1, 31))  # each step logged once across the three runs
    # MLflow: one parent; each job's child run finished, none's resumed in place across the three runs (a job
    # stopped before its first checkpoint starts afresh in a new child run, the old one closed)
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{db}")
    runs = client.search_runs([x.experiment_id for x in client.search_experiments()], max_results=100)
    parents = [x for x in runs if "mlflow.parentRunId" not in x.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = [x for x in runs if x.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    for arm in ARMS.split(","):
        final = next(x for x in children if x.info.run_id == state["jobs"][f"{arm}/seed0"]["mlflow_run_id"])
        assert final.info.status == "FINISHED" and final.info.run_name == f"controllers-{arm}-seed0"
    assert sum(x.info.run_name == "controllers-none-seed0" for x in children) == 1
    assert all(x.info.status != "RUNNING" for x in children), [(x.info.run_name, x.info.status) for x in children]


def _is_job(cmd: str) -> bool:
    """Whether a command line is a job's training process: started (rail.cli train) or resumed (rail.cli resume)."""
    return "rail.cli train" in cmd or "rail.cli resume" in cmd


def _job_process(mark: str, run: Path) -> tuple[int, int] | None:
    """(pid, parent pid) of the training process of ``run``, if it is running."""
    for pid, cmd in marked(mark).items():
        if _is_job(cmd) and str(run) in cmd:
            stat = Path(f"/proc/{pid}/stat").read_text()
            return pid, int(stat[stat.rindex(")") + 2:].split()[1])
    return None


@pytest.mark.ray
def test_a_job_that_raises_or_loses_its_worker_is_recorded_and_the_others_go_on(both, tmp_path):
    """On a copy of the finished Ray ablation, both jobs are set to resume from step 2. First, none's checkpoints
    all lose their manifests, so its training process refuses to resume and exits 1: recorded with its stderr tail
    while rail finishes. Then none resumes for real, and the Ray worker running rail's job is SIGKILLed: rail is
    recorded as failed with Ray's account of it, its training process dies with the worker, and none finishes."""
    out = tmp_path / "abl"
    shutil.copytree(both["ray"]["out"], out, symlinks=True)
    none, rail = out / "none" / "seed0", out / "rail" / "seed0"

    def rewind(run: Path, pointer: str = "step_000002") -> None:
        (run / "summary.json").unlink(missing_ok=True)
        (run / "checkpoints" / "latest").write_text(pointer + "\n")

    for run in (none, rail):  # the copy logs to no MLflow store (its jobs would reopen the original's runs)
        cfg = json.loads((run / "config.json").read_text())
        cfg["tracking"]["uri"] = ""
        (run / "config.json").write_text(json.dumps(cfg))
    rewind(none)
    rewind(rail)
    manifests = {ck: (ck / "manifest.json").read_bytes() for ck in (none / "checkpoints").glob("step_*")}
    for ck in manifests:
        (ck / "manifest.json").unlink()
    mark = uuid.uuid4().hex
    p = start(out=out, cache=both["ray"]["cache"], db=None, mark=mark)
    assert p.wait(timeout=600) == 1, output(p)[-3000:]
    assert "FAILED none/seed0" in output(p)
    jobs = json.loads((out / "ablation.json").read_text())["jobs"]
    bad = jobs["none/seed0"]
    assert bad["status"] == "failed" and bad["returncode"] == 1
    assert any("no usable checkpoint" in ln for ln in bad["stderr_tail"]), bad["stderr_tail"]
    assert jobs["rail/seed0"]["status"] == "finished" and (rail / "summary.json").is_file()
    assert gone(mark, 30) == {}

    for ck, manifest in manifests.items():
        (ck / "manifest.json").write_bytes(manifest)
    rewind(none)
    rewind(rail)
    mark = uuid.uuid4().hex
    p = start(out=out, cache=both["ray"]["cache"], db=None, mark=mark)
    jobs = {}
    wait_for(lambda: bool(jobs.update(rail=_job_process(mark, rail)) or jobs["rail"]), p,
             "rail/seed0's training process", output=lambda: output(p))
    child, worker = jobs["rail"]
    assert marked(mark)[worker].startswith("ray::rail-ablate rail/seed0")
    os.kill(worker, signal.SIGKILL)
    assert p.wait(timeout=600) == 1, output(p)[-3000:]
    assert not alive(child)  # died with its worker
    jobs = json.loads((out / "ablation.json").read_text())["jobs"]
    lost = jobs["rail/seed0"]
    assert lost["status"] == "failed" and lost["returncode"] == -1, lost
    assert lost["error"].startswith("ray: ") and lost["stderr_tail"][-1] == lost["error"]
    assert jobs["none/seed0"]["status"] == "finished" and (none / "summary.json").is_file()
    assert not (rail / "summary.json").exists()
    rep = json.loads((out / "report.json").read_text())
    assert [f["job"] for f in rep["failed"]] == ["rail/seed0"]
    assert gone(mark, 30) == {}


@pytest.mark.ray
def test_a_job_whose_node_dies_is_recorded_and_the_others_go_on(both, tmp_path, monkeypatch):
    """A Ray cluster of two nodes on this machine (the head and one more, 1 CPU each), joined with --address;
    both jobs resume from step 2, one on each node. The second node is removed (its raylet and workers killed)
    while its job trains: that job is recorded as failed with Ray's account, the one on the head finishes, and
    the lost job's training process is gone."""
    from ray.cluster_utils import Cluster

    out = tmp_path / "abl"
    shutil.copytree(both["ray"]["out"], out, symlinks=True)
    for arm in ARMS.split(","):
        run = out / arm / "seed0"
        cfg = json.loads((run / "config.json").read_text())
        cfg["tracking"]["uri"] = ""
        (run / "config.json").write_text(json.dumps(cfg))
        (run / "summary.json").unlink()
        (run / "checkpoints" / "latest").write_text("step_000002\n")
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)  # the cluster's processes carry the mark too
    # its workers at normal priority, as on the local instance rail ablate starts (Ray's default niceness of 15
    # would let any other load on the machine stall the jobs)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                           "_system_config": {"worker_niceness": 0}})
    try:
        node = cluster.add_node(num_cpus=1)
        p = start(out=out, cache=both["ray"]["cache"], db=None, mark=mark, extra=["--address", cluster.address])
        jobs = {}

        def both_training() -> bool:
            jobs.update({arm: j for arm in ARMS.split(",") if (j := _job_process(mark, out / arm / "seed0"))})
            return len(jobs) == 2
        wait_for(both_training, p, "both jobs' training processes", output=lambda: output(p))
        raylet = lambda pid: int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        on_node = [arm for arm, (child, worker) in jobs.items() if raylet(worker) == node.all_processes[
            "raylet"][0].process.pid]
        assert len(on_node) == 1, (jobs, on_node)
        lost, kept = on_node[0], next(a for a in jobs if a != on_node[0])
        cluster.remove_node(node, allow_graceful=False)
        assert p.wait(timeout=600) == 1, output(p)[-3000:]
        state = json.loads((out / "ablation.json").read_text())["jobs"]
        e = state[f"{lost}/seed0"]
        assert e["status"] == "failed" and e["returncode"] == -1 and e["error"].startswith("ray: "), e
        assert state[f"{kept}/seed0"]["status"] == "finished", state
        assert not alive(jobs[lost][0])  # the lost job's training process died with its node
    finally:
        cluster.shutdown()
    assert gone(mark, 30) == {}
