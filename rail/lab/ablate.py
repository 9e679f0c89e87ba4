"""``rail ablate``: controller ablations under one budget, one MLflow parent run, a nested child run per
(arm, seed).

An ablation file (``experiments/ablations/*.toml``, docs/ablation.md) holds:

- ``[ablation]``: ``name``, ``description``, ``seeds`` (a count, or a list of seeds), ``world_per_seed`` (true:
  every seed in a world of its own, ``env.seed`` = the run seed; default false: every seed in ``env.seed``'s);
- ``[base]``: config overrides shared by every arm, in the ``[section]`` form of ``rail train --config``;
- ``[preset.<P>]``: more shared overrides, applied only with ``--preset P`` (run length and evaluation
  sizes), and optionally ``seeds`` for that preset;
- ``[arms.<arm>]``: an optional ``description`` and the arm's ``controller`` and ``learner`` settings (what
  decides the interventions and how their rollouts are learned from). Arms may set nothing else, so every
  arm gets the same budget, warm start, environments, evaluation and, per seed, the same base task streams
  (the trainer derives them from ``(run.seed, step)``);
- ``[resources]``: what each job's Ray task reserves with ``--backend ray`` (``num_cpus``, ``num_gpus``).

A job's config is: the training preset < ``[base]`` < ``[preset.<P>]`` < ``--set`` < ``[arms.<arm>]`` <
what ``rail ablate`` sets itself (``run.name``, ``run.out``, ``run.seed``, ``run.threads``,
``tracking.parent_run_id``, and ``env.seed`` with ``world_per_seed``). Each job runs as ``python -m rail.cli train --config <job>.toml --no-progress``
in a worker process (``--backend process``) or in a Ray task (``--backend ray``, rail/lab/ablate_ray.py); a killed
job is resumed with ``rail resume``; a finished one is skipped.

This module imports no torch at import time (the warm-start cache key is computed lazily), so a bad
ablation file is reported at once.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from policy.fileio import write_text_atomic
from rail.config import (Config, ConfigError, build_config, dump_toml, merge, read_json, read_text,
                         validate)
from rail.cores import usable_cores

TOP_LEVEL = ("ablation", "base", "preset", "arms", "resources")
ABLATION_KEYS = ("name", "description", "seeds", "world_per_seed")
ARM_SECTIONS = ("controller", "learner")
#: Fields ``rail ablate`` sets per job; an ablation file or ``--set`` may not.
MANAGED = ("run.name", "run.out", "run.seed", "run.threads", "tracking.parent_run_id")
STATE_FILE = "ablation.json"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


# ---------------------------------------------------------------------------- the ablation file
@dataclass
class Ablation:
    path: Path
    name: str
    description: str
    seeds: list[int]
    base: dict
    presets: dict[str, dict]  # preset -> {"seeds": [...]?, "overrides": {...}}
    arms: dict[str, dict]  # arm -> config overrides (controller only)
    arm_docs: dict[str, str] = field(default_factory=dict)
    text: str = ""
    resources: dict[str, float] = field(default_factory=dict)  # [resources]: per-job Ray resources
    world_per_seed: bool = False  # every seed in a world of its own: env.seed = run.seed

    def seeds_for(self, preset: str, count: int | list[int] | None = None) -> list[int]:
        """The seeds to run: ``count`` (a count: 0..count-1, or a list of seeds), else the preset's, else the
        file's."""
        if isinstance(count, list):
            return list(count)
        if count is not None:
            return list(range(count))
        return list(self.presets.get(preset, {}).get("seeds", self.seeds))


def _seeds(value, where: str) -> list[int]:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: seeds must be a count or a list of integer seeds, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"{where}: seeds = {value}: must be >= 1")
        return list(range(value))
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        if len(set(value)) != len(value):
            raise ConfigError(f"{where}: seeds = {value}: repeated seed")
        return list(value)
    raise ConfigError(f"{where}: seeds must be a count or a non-empty list of integer seeds, got {value!r}")


def _no_managed(overrides: dict, where: str) -> None:
    for key in MANAGED:
        section, name = key.split(".")
        if isinstance(overrides.get(section), dict) and name in overrides[section]:
            raise ConfigError(f"{where}: {key} is set by rail ablate for each arm and seed; remove it")


def load_ablation(path: str | Path) -> Ablation:
    """Parse and check an ablation file; every error is a :class:`ConfigError` naming the file and the table."""
    p = Path(path)
    text = read_text(p, "--config")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {p}: not valid TOML ({e})") from None
    for key in raw:
        if key not in TOP_LEVEL:
            raise ConfigError(f"{p}: unknown table [{key}]; an ablation file has {', '.join(f'[{k}]' for k in TOP_LEVEL)}")
    head = raw.get("ablation")
    if not isinstance(head, dict):
        raise ConfigError(f"{p}: missing the [ablation] table (name, description, seeds)")
    for key in head:
        if key not in ABLATION_KEYS:
            raise ConfigError(f"{p}: unknown key 'ablation.{key}'; valid keys: {', '.join(ABLATION_KEYS)}")
    name = head.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ConfigError(f"{p}: ablation.name = {name!r}: a name of letters, digits, '_', '-' or '.' is required")
    description = head.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"{p}: ablation.description must be a string")
    seeds = _seeds(head.get("seeds", 1), f"{p}: ablation.seeds")
    world_per_seed = head.get("world_per_seed", False)
    if not isinstance(world_per_seed, bool):
        raise ConfigError(f"{p}: ablation.world_per_seed = {world_per_seed!r}: true or false")
    base = raw.get("base", {})
    if not isinstance(base, dict):
        raise ConfigError(f"{p}: [base] must be a table of [base.<section>] tables")
    _no_managed(base, f"{p} [base]")
    presets: dict[str, dict] = {}
    from rail.config import PRESETS

    if not isinstance(raw.get("preset", {}), dict):
        raise ConfigError(f"{p}: [preset] must hold [preset.<name>] tables")
    for pname, table in raw.get("preset", {}).items():
        if pname not in PRESETS:
            raise ConfigError(f"{p}: [preset.{pname}]: unknown training preset; valid presets: {', '.join(PRESETS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{p}: [preset.{pname}] must be a table")
        table = dict(table)
        entry: dict = {}
        if "seeds" in table:
            entry["seeds"] = _seeds(table.pop("seeds"), f"{p}: preset.{pname}.seeds")
        _no_managed(table, f"{p} [preset.{pname}]")
        entry["overrides"] = table
        presets[pname] = entry
    arms_raw = raw.get("arms")
    if not isinstance(arms_raw, dict) or not arms_raw:
        raise ConfigError(f"{p}: no arms; add [arms.<name>] tables with the controller settings of each arm")
    arms: dict[str, dict] = {}
    docs: dict[str, str] = {}
    for arm, table in arms_raw.items():
        where = f"{p} [arms.{arm}]"
        if not NAME_RE.match(arm):
            raise ConfigError(f"{where}: arm names are letters, digits, '_', '-' or '.'")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: must be a table")
        table = dict(table)
        doc = table.pop("description", "")
        if not isinstance(doc, str):
            raise ConfigError(f"{where}: description must be a string")
        for section in table:
            if section not in ARM_SECTIONS:
                raise ConfigError(
                    f"{where}: '{section}' settings cannot differ between arms (only "
                    f"{', '.join(ARM_SECTIONS)} may: every arm gets the same budget, environments, evaluation and "
                    f"task streams); move them to [base]")
        _no_managed(table, where)
        arms[arm] = table
        docs[arm] = doc
    from rail.lab.ablate_ray import parse_resources  # (imports no ray)

    resources = parse_resources(raw.get("resources", {}), str(p))
    ab = Ablation(p, name, description, seeds, base, presets, arms, docs, text, resources, world_per_seed)
    if world_per_seed:  # the seed decides the world: nothing else may
        for where, table in (("[base]", base), *((f"[preset.{k}]", v["overrides"]) for k, v in presets.items())):
            if isinstance(table.get("env"), dict) and "seed" in table["env"]:
                raise ConfigError(f"{p} {where}: env.seed is set by rail ablate with ablation.world_per_seed = true "
                                  "(every seed in a world of its own); remove it, or set world_per_seed = false")
    for pname in sorted({"default", *presets}):  # a typo anywhere fails now, not after an hour
        for arm in arms:
            arm_config(ab, arm, pname, 0, Path("."))
    return ab


def _merge(cfg: Config, overrides: dict, where: str) -> None:
    """``merge``, with every error naming the file and table it came from."""
    try:
        merge(cfg, copy.deepcopy(overrides), where)
    except ConfigError as e:
        raise ConfigError(str(e) if where in str(e) else f"{where}: {e}") from None


def arm_config(ab: Ablation, arm: str, preset: str, seed: int, out: Path, sets: list[dict] = (),
               tracking_uri: str | None = None, parent_run_id: str = "") -> Config:
    """The resolved config of one (arm, seed) job."""
    cfg = build_config(preset)
    _merge(cfg, ab.base, f"{ab.path} [base]")
    _merge(cfg, ab.presets.get(preset, {}).get("overrides", {}), f"{ab.path} [preset.{preset}]")
    for s in sets:
        _no_managed(s, "--set")
        if ab.world_per_seed and isinstance(s.get("env"), dict) and "seed" in s["env"]:
            raise ConfigError(f"--set env.seed: {ab.path} sets ablation.world_per_seed = true, so every seed runs in "
                              "a world of its own (env.seed = the run seed); drop the flag")
        _merge(cfg, s, "--set")
    _merge(cfg, ab.arms[arm], f"{ab.path} [arms.{arm}]")
    managed: dict = {"run": {"name": f"{ab.name}-{arm}-seed{seed}", "out": str(out / arm / f"seed{seed}"),
                             "seed": seed},
                     "tracking": {"parent_run_id": parent_run_id}}
    if ab.world_per_seed:
        managed["env"] = {"seed": seed}
    if tracking_uri is not None:
        managed["tracking"]["uri"] = tracking_uri
    merge(cfg, managed, "rail ablate")
    try:
        validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"{ab.path} [arms.{arm}] (preset {preset}): {e}") from None
    return cfg


def shared_view(cfg: Config) -> dict:
    """The part of a job's config every arm (and every seed) must share."""
    d = cfg.to_dict()
    for section in ARM_SECTIONS:
        d.pop(section)
    for k in ("name", "out", "seed", "threads"):
        d["run"].pop(k)
    d["tracking"].pop("parent_run_id")
    d["env"].pop("seed")  # one world for every seed, or each seed its own (ablation.world_per_seed): never per arm
    return d


# ---------------------------------------------------------------------------- jobs
@dataclass
class Job:
    arm: str
    seed: int
    dir: Path
    cfg: Config
    action: str = "start"  # start | resume | skip
    proc: subprocess.Popen | None = None  # or the backend's handle with the same poll/wait/send_signal/kill
    started: float = 0.0
    builder: bool = False  # started while its seed's warm start was not cached: it trains it
    err_offset: int = 0

    @property
    def key(self) -> str:
        return f"{self.arm}/seed{self.seed}"

    @property
    def toml(self) -> Path:
        return self.dir.parent / f"seed{self.seed}.toml"

    @property
    def stdout(self) -> Path:
        return self.dir.parent / f"seed{self.seed}.stdout.log"

    @property
    def stderr(self) -> Path:
        return self.dir.parent / f"seed{self.seed}.stderr.log"


def plan_jobs(ab: Ablation, preset: str, out: Path, arms: list[str] | None = None, seeds: int | list[int] | None = None,
              sets: list[dict] = (), tracking_uri: str | None = None) -> list[Job]:
    """Every (arm, seed) job, seed-major (all arms of seed 0 first); checks that arms differ only in ARM_SECTIONS."""
    names = list(ab.arms)
    if arms:
        unknown = [a for a in arms if a not in ab.arms]
        if unknown:
            raise ConfigError(f"--arms: unknown arm(s) {', '.join(unknown)}; {ab.path} has {', '.join(names)}")
        names = [a for a in names if a in arms]
    jobs = []
    for seed in ab.seeds_for(preset, seeds):
        for arm in names:
            cfg = arm_config(ab, arm, preset, seed, out, list(sets), tracking_uri)
            jobs.append(Job(arm, seed, out / arm / f"seed{seed}", cfg))
    ref = shared_view(jobs[0].cfg)
    for j in jobs[1:]:
        v = shared_view(j.cfg)
        if v != ref:
            diff = sorted(f"{s}.{k}" for s in v for k in v[s] if v[s][k] != ref[s].get(k))
            raise ConfigError(f"{ab.path}: arm {j.arm} differs from arm {jobs[0].arm} outside "
                              f"[{'], ['.join(ARM_SECTIONS)}] ({', '.join(diff)}); arms must share everything else")
    return jobs


def _comparable(d: dict) -> dict:
    d = copy.deepcopy(d)
    d.get("run", {}).pop("threads", None)
    d.get("run", {}).pop("out", None)
    d.pop("tracking", None)
    return d


def _finished(d: Path) -> bool:
    """Whether the run in ``d`` wrote a summary.json the report can read; a damaged one (a disk that filled, a
    stray edit) is said, and the job runs again: resuming its last checkpoint writes the summary anew."""
    p = d / "summary.json"
    if not p.is_file():
        return False
    try:
        s = json.loads(p.read_text(encoding="utf-8"))
        s["eval"]["easy_final"], s["budget"]["spent"]["total"]  # noqa: B018 - what the report reads first
        return True
    except (OSError, ValueError, KeyError, TypeError) as e:
        import warnings
        warnings.warn(f"{p}: damaged ({type(e).__name__}: {e}); this job runs again to rewrite it", stacklevel=3)
        return False


def classify(job: Job) -> str:
    """skip (finished), resume (killed after a checkpoint) or start; refuses a directory of another config."""
    d = job.dir
    if _finished(d):
        action = "skip"
    elif (d / "config.json").is_file() and (d / "checkpoints" / "latest").is_file():
        action = "resume"
    else:
        return "start"
    try:
        old = json.loads((d / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{d / 'config.json'}: unreadable ({e}); delete {d} to rerun this job") from None
    a, b = _comparable(old), _comparable(job.cfg.to_dict())
    if a != b:
        diff = sorted(f"{s}.{k}" for s in b for k in b[s] if a.get(s, {}).get(k) != b[s][k])
        raise ConfigError(f"{d} holds a run of another configuration ({', '.join(diff) or 'sections differ'}); "
                          f"use another --out, or delete {d} to rerun it")
    return action


def _stderr_tail(path: Path, offset: int, n: int = 20) -> list[str]:
    """The last ``n`` lines this attempt wrote to stderr, without progress-bar redraws."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    lines = [ln.rstrip() for ln in re.split(r"[\r\n]", text)]
    bar = re.compile(r"\|\s*\d+/\d+ \[|\d+%\|")
    lines = [ln for ln in lines if ln.strip() and not bar.search(ln)]
    return lines[-n:]


def _child_run_id(run_dir: Path) -> str | None:
    """The MLflow run id a job recorded in its newest checkpoint."""
    try:
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
        state = json.loads((run_dir / "checkpoints" / latest / "state.json").read_text())
        return state.get("run", {}).get("mlflow_run_id")
    except (OSError, json.JSONDecodeError):
        return None


# ---------------------------------------------------------------------------- MLflow parent run
class Parent:
    """The ablation's MLflow parent run (every call guarded: tracking failures never stop an ablation)."""

    def __init__(self, uri: str, experiment: str, name: str, run_id: str | None, warn: Callable[[str], None]):
        from rail.tracking import MlflowTracker

        self.uri, self.warn, self.tracker = uri, warn, None
        try:
            import mlflow

            client = mlflow.MlflowClient(tracking_uri=uri)
            if run_id:
                try:
                    client.get_run(run_id)
                except Exception:  # noqa: BLE001 - not in this store: start a new parent
                    run_id = None
        except Exception as e:  # noqa: BLE001
            warn(f"MLflow unavailable ({type(e).__name__}: {e}); the ablation runs without tracking")
            return
        t = MlflowTracker(uri, experiment, name, run_id=run_id)
        if t.ok and t.run_id:
            self.tracker = t
        else:
            warn("MLflow parent run could not be created; child runs are logged as top-level runs")

    @property
    def run_id(self) -> str | None:
        return self.tracker.run_id if self.tracker else None

    def _call(self, fn) -> None:
        if self.tracker is None or not self.tracker.ok:
            return
        try:
            fn(self.tracker)
        except Exception as e:  # noqa: BLE001
            self.warn(f"MLflow: {type(e).__name__}: {e}")

    def tag_child(self, run_id: str, tags: dict[str, str]) -> None:
        self._call(lambda t: [t.client.set_tag(run_id, k, v) for k, v in tags.items()])

    def kill_orphans(self, run_name: str) -> None:
        """Mark child runs of ``run_name`` still RUNNING (their process died before a checkpoint) KILLED."""
        def do(t):
            exp = t.client.get_run(t.run_id).info.experiment_id
            runs = t.client.search_runs([exp], filter_string=(
                f"tags.mlflow.parentRunId = '{t.run_id}' and tags.mlflow.runName = '{run_name}' "
                "and attributes.status = 'RUNNING'"))
            for r in runs:
                t.client.set_terminated(r.info.run_id, "KILLED")
        self._call(do)


# ---------------------------------------------------------------------------- where jobs run
class ProcessBackend:
    """Each job a ``rail train`` child process of this one, on this machine."""

    name = "process"
    signals_reach_jobs = True  # a Ctrl-C in the terminal reaches the children too (one process group)

    def threads(self, workers: int) -> int:
        return max(1, usable_cores() // workers)

    def describe(self, workers: int, threads: int) -> str:
        return f"{workers} workers x {threads} threads"

    def __enter__(self) -> "ProcessBackend":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def spawn(self, job: Job, args: list[str], env: dict[str, str], lock_fd: int | None) -> subprocess.Popen:
        with open(job.stdout, "ab") as so, open(job.stderr, "ab") as se:
            return subprocess.Popen([sys.executable, *args], stdout=so, stderr=se, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **env}, pass_fds=(lock_fd,) if lock_fd is not None else ())


def make_backend(name: str, ab: Ablation, address: str | None = None, num_cpus: float | None = None,
                 num_gpus: float | None = None):
    """``--backend``: ``process`` (local worker processes) or ``ray`` (Ray tasks; rail/lab/ablate_ray.py)."""
    if name == "process":
        for flag, value in (("--address", address), ("--num-cpus", num_cpus), ("--num-gpus", num_gpus)):
            if value is not None:
                raise ConfigError(f"{flag}: only with --backend ray")
        return ProcessBackend()
    if name == "ray":
        from rail.lab.ablate_ray import RayBackend, job_resources

        return RayBackend(job_resources(ab.resources, num_cpus, num_gpus), address)
    raise ConfigError(f"--backend {name}: unknown; valid: process, ray")


# ---------------------------------------------------------------------------- the run
class AblationRunner:
    def __init__(self, ab: Ablation, jobs: list[Job], out: Path, preset: str, workers: int,
                 log: Callable[[str], None] = print, backend=None):
        self.ab, self.jobs, self.out, self.preset = ab, jobs, out, preset
        self.backend = backend or ProcessBackend()
        self.workers = max(1, workers)
        self.threads = self.backend.threads(self.workers)
        self.log = log
        self.state: dict = {}
        self.parent: Parent | None = None
        self._ws_keys: dict[int, Path | None] = {}
        self._lock_fd: int | None = None

    # -- state
    def _load_state(self) -> dict:
        p = self.out / STATE_FILE
        if p.is_file():
            st = read_json(p, fix="delete it to start the ablation's bookkeeping afresh (finished runs are kept)")
            if st.get("name") != self.ab.name:
                raise ConfigError(f"{self.out} holds ablation {st.get('name')!r}, not {self.ab.name!r}; use another --out")
            return st
        return {"name": self.ab.name, "jobs": {}}

    def _save(self) -> None:
        self.state["updated"] = time.time()
        write_text_atomic(self.out / STATE_FILE, json.dumps(self.state, indent=1, sort_keys=True))

    def _lock(self) -> None:
        import fcntl

        self.out.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.out / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(f"{self.out}: another rail ablate (or a training process it started) is still "
                              "running there; wait for it or stop it") from None
        self._lock_fd = fd  # inherited by the workers: the lock lasts as long as any of them

    # -- warm start
    def _ws_cache(self, job: Job) -> Path | None:
        """Where this job's warm start is cached (shared by the arms of a seed); None when it has none."""
        cfg = job.cfg
        if not cfg.warmstart.enabled:
            return None
        if job.seed not in self._ws_keys:
            from rail.envs import make_envs
            from rail.policy_setup import warmstart_cache

            envs = make_envs(cfg.env.families, cfg.env.seed, cfg.env.options)
            self._ws_keys[job.seed] = warmstart_cache(cfg, envs)  # the path the trainer writes, by the same code
        return self._ws_keys[job.seed]

    def _ready(self, job: Job, running: list[Job]) -> bool:
        if job.action == "resume":
            return True
        cache = self._ws_cache(job)
        if cache is None or (cache / "config.json").is_file():
            return True
        return not any(r.builder and r.seed == job.seed for r in running)

    # -- one job
    def _entry(self, job: Job) -> dict:
        return self.state["jobs"].setdefault(job.key, {"arm": job.arm, "seed": job.seed, "dir": str(job.dir),
                                                        "attempts": 0})

    def _launch(self, job: Job, running: list[Job]) -> None:
        e = self._entry(job)
        if job.action == "resume":
            args = ["-m", "rail.cli", "resume", str(job.dir), "--no-progress"]
        else:
            if (job.dir / "config.json").is_file():  # killed before its first checkpoint: nothing to resume
                shutil.rmtree(job.dir)
                if self.parent:
                    self.parent.kill_orphans(job.cfg.run.name)
            tables = {k: v for k, v in job.cfg.to_dict().items()}
            tables["run"] = {k: v for k, v in tables["run"].items() if k != "threads"}
            header = (f"{self.ab.name}: arm {job.arm}, seed {job.seed} (written by rail ablate from {self.ab.path}, "
                      f"preset {self.preset})")
            write_text_atomic(job.toml, dump_toml(tables, header))
            args = ["-m", "rail.cli", "train", "--config", str(job.toml), "--no-progress",
                    "--set", f"run.threads={self.threads}"]
        cache = self._ws_cache(job) if job.action == "start" else None
        job.builder = cache is not None and not (cache / "config.json").is_file()
        job.dir.parent.mkdir(parents=True, exist_ok=True)
        job.err_offset = job.stderr.stat().st_size if job.stderr.exists() else 0
        env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
        job.proc = self.backend.spawn(job, args, env, self._lock_fd)
        job.started = time.time()
        e.update(status="running", action=job.action, command=job.proc.args, pid=job.proc.pid, started=job.started,
                 returncode=None, stderr_tail=[], attempts=e.get("attempts", 0) + 1, **getattr(job.proc, "info", {}))
        self._save()
        running.append(job)
        self.log(f"[{self.ab.name}] {job.action:6s} {job.key}" + ("  (trains the warm start)" if job.builder else ""))

    def _finish(self, job: Job, rc: int) -> None:
        e = self._entry(job)
        secs = time.time() - job.started
        ok = rc == 0 and (job.dir / "summary.json").is_file()
        e.update(status="finished" if ok else "failed", returncode=rc, ended=time.time(), seconds=round(secs, 1),
                 pid=None)
        msg = f"[{self.ab.name}] {'done  ' if ok else 'FAILED'} {job.key} in {secs:.0f}s"
        if ok:
            try:
                s = json.loads((job.dir / "summary.json").read_text())
                e["summary"] = {"easy_final": s["eval"]["easy_final"], "beyond_final": s["eval"]["beyond_final"],
                                "budget_spent": s["budget"]["spent"]["total"], "wall_seconds": s["wall_seconds"]}
                msg += f"  easy {s['eval']['easy_final']:.3f}  beyond {s['eval']['beyond_final']:.3f}"
            except (OSError, json.JSONDecodeError, KeyError):
                pass
            e["stderr_tail"] = []
        else:
            if rc == 0:
                e["returncode"] = rc
                e["error"] = "exited 0 without writing summary.json"
            e["stderr_tail"] = _stderr_tail(job.stderr, job.err_offset)
            if getattr(job.proc, "error", None):  # the backend's own account (e.g. the job's Ray node died)
                e["error"] = job.proc.error
                e["stderr_tail"].append(job.proc.error)
            msg += f" (exit code {rc}): " + (e["stderr_tail"][-1] if e["stderr_tail"] else "no stderr")
        e.update(getattr(job.proc, "info", {}))
        rid = _child_run_id(job.dir)
        if rid:
            e["mlflow_run_id"] = rid
            if self.parent:
                self.parent.tag_child(rid, {"rail.ablation": self.ab.name, "rail.arm": job.arm,
                                            "rail.seed": str(job.seed)})
        self._save()
        self.log(msg)

    # -- the loop
    def run(self, report: bool = True) -> int:
        self._lock()
        self.state = self._load_state()
        actions = {j.key: classify(j) for j in self.jobs}  # before anything is created or started
        st = self.state
        uri = self.jobs[0].cfg.tracking.uri
        # arms and seeds of every run of this ablation so far (a rerun with --arms adds to them)
        arms = set(st.get("arms") or []) | {j.arm for j in self.jobs}
        order = list(self.ab.arms)
        st.update(name=self.ab.name, description=self.ab.description, config_file=str(self.ab.path),
                  preset=self.preset, arms=sorted(arms, key=lambda a: (order.index(a) if a in order else len(order), a)),
                  arm_descriptions={a: self.ab.arm_docs.get(a, "") for a in self.ab.arms},
                  seeds=sorted(set(st.get("seeds") or []) | {j.seed for j in self.jobs}), workers=self.workers,
                  threads=self.threads, backend=self.backend.name,
                  tracking_uri=uri, experiment=self.jobs[0].cfg.tracking.experiment, started=time.time(),
                  finished=None, status="running")
        write_text_atomic(self.out / "ablation.toml", self.ab.text)
        if uri:
            old = st.get("parent_run_id") if st.get("parent_tracking_uri") == uri else None
            self.parent = Parent(uri, self.jobs[0].cfg.tracking.experiment, f"ablate-{self.ab.name}", old, self.log)
            st["parent_run_id"], st["parent_tracking_uri"] = self.parent.run_id, uri
            if self.parent.run_id and self.parent.run_id != old:
                shared = shared_view(self.jobs[0].cfg)
                self.parent._call(lambda t: t.log_params({"ablation": {
                    "name": self.ab.name, "file": str(self.ab.path), "preset": self.preset,
                    "arms": ",".join(st["arms"]), "seeds": ",".join(map(str, st["seeds"]))}, "shared": shared}))
            self.parent._call(lambda t: t.set_tags({
                "rail.ablation": self.ab.name, "rail.ablation.dir": str(self.out.resolve()),
                "rail.preset": self.preset, "mlflow.note.content": self.ab.description or self.ab.name}))
        for j in self.jobs:
            j.action = actions[j.key]
            j.cfg.tracking.parent_run_id = (self.parent.run_id or "") if self.parent else ""
            e = self._entry(j)
            if j.action == "skip":
                e.update(status="finished", action="skip")
            elif e.get("status") not in ("failed",):
                e["status"] = "pending"
        self._save()
        todo = [j for j in self.jobs if j.action != "skip"]
        skipped = len(self.jobs) - len(todo)
        self.log(f"[{self.ab.name}] {len(self.jobs)} jobs ({len({j.arm for j in self.jobs})} arms x "
                 f"{len({j.seed for j in self.jobs})} seeds, "
                 f"preset {self.preset}) in {self.out}: {skipped} finished already, "
                 f"{sum(j.action == 'resume' for j in todo)} to resume, {sum(j.action == 'start' for j in todo)} to start; "
                 f"{self.backend.describe(self.workers, self.threads)}")
        t0 = time.time()
        running: list[Job] = []
        status = "FAILED"

        def on_term(signum, frame):
            raise KeyboardInterrupt
        old_term = signal.signal(signal.SIGTERM, on_term)  # a terminated ablation stops its workers too
        try:
            while todo or running:
                while len(running) < self.workers:
                    nxt = next((j for j in todo if self._ready(j, running)), None)
                    if nxt is None:
                        break
                    todo.remove(nxt)
                    self._launch(nxt, running)
                time.sleep(0.3)
                for j in list(running):
                    rc = j.proc.poll()
                    if rc is not None:
                        running.remove(j)
                        self._finish(j, rc)
            status = "FINISHED"
        except KeyboardInterrupt:
            # a Ctrl-C in the terminal reaches worker processes too: let them stop on their own first
            deadline = time.time() + (5 if self.backend.signals_reach_jobs else 0)
            while time.time() < deadline and any(j.proc.poll() is None for j in running):
                time.sleep(0.1)
            for j in running:
                if j.proc.poll() is None:
                    j.proc.send_signal(signal.SIGINT)
            for j in running:
                try:
                    j.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    j.proc.kill()
                    j.proc.wait()
                self._entry(j).update(status="interrupted", pid=None, returncode=j.proc.returncode)
            status = "KILLED"
            raise
        finally:
            signal.signal(signal.SIGTERM, old_term)
            failed = sorted(k for k, e in st["jobs"].items() if e.get("status") == "failed"
                            and k in {j.key for j in self.jobs})
            st.update(finished=time.time(), status=status.lower(), failed=failed,
                      seconds=round(time.time() - t0, 1))
            self._save()
            if self.parent:
                self.parent._call(lambda t: t.log_metrics({"jobs/total": len(self.jobs), "jobs/failed": len(failed),
                                                           "jobs/seconds": time.time() - t0}, 0))
                self.parent._call(lambda t: t.set_tags({"rail.failed_jobs": ",".join(failed) or "none"}))
                self.parent._call(lambda t: [t.log_artifact(self.out / n) for n in (STATE_FILE, "ablation.toml")])
                if status != "FINISHED":
                    self.parent._call(lambda t: t.close(status))
        self.log(f"[{self.ab.name}] {len(self.jobs) - len(failed)}/{len(self.jobs)} jobs finished in "
                 f"{time.time() - t0:.0f}s" + (f"; failed: {', '.join(failed)} (see {self.out / STATE_FILE})"
                                              if failed else ""))
        try:
            if report:
                from rail.lab.ablation_report import write_report

                try:
                    res = write_report(self.out, parent=self.parent)
                    self.log(res["verdict"]["text"])
                    self.log(f"[{self.ab.name}] report: {self.out / 'report.md'}")
                except ConfigError as e:  # e.g. no job finished: nothing to report
                    self.log(f"[{self.ab.name}] no report: {e}")
        finally:
            if self.parent:
                self.parent._call(lambda t: t.close("FINISHED"))
        return 1 if failed else 0
