"""``rail ablate --backend ray``: every (arm, seed) job a Ray task, on a local Ray instance or an existing cluster.

The scheduling, bookkeeping, MLflow parent run, resume rules and report are :class:`rail.lab.ablate.AblationRunner`'s,
shared with the process backend; this module only translates "start this job" and "is it done" into Ray. A job's
task runs the same ``python -m rail.cli train ...`` command the process backend runs, as a child process of the
Ray worker, with the same torch thread count and the same log files, so its figures are the process backend's.
The task reserves ``num_cpus`` / ``num_gpus`` (the ablation file's ``[resources]`` table, or ``--num-cpus`` /
``--num-gpus``); the job trains with ``int(num_cpus)`` torch threads.

Every node must see the driver's working directory, the output directory and the warm-start cache at the same
paths (a shared file system), and reach the MLflow tracking URI (docs/ablation.md, "On a Ray cluster").

Ray is imported only when the backend starts, so ``rail ablate`` without it stays light.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from rail.config import ConfigError
from rail.cores import usable_cores

#: The ``[resources]`` table of an ablation file: what each job's Ray task reserves.
RESOURCES = {
    "num_cpus": (1, "CPUs each job's task reserves; the job trains with int(num_cpus) torch threads"),
    "num_gpus": (0, "GPUs each job's task reserves (a fraction below 1 shares a GPU between jobs)"),
}
STOP_GRACE_S = 25.0  # a cancelled job's training process gets this long to stop after SIGINT, then SIGKILL


def parse_resources(table, where: str) -> dict[str, float]:
    """Check a ``[resources]`` table (or the flags' values); returns only the keys it sets."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: [resources] must be a table of {', '.join(RESOURCES)}")
    out: dict[str, float] = {}
    for key, value in table.items():
        if key not in RESOURCES:
            raise ConfigError(f"{where}: unknown key 'resources.{key}'; valid keys: {', '.join(RESOURCES)}")
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and (value > 0 if key == "num_cpus" else value >= 0)
        if not ok:
            raise ConfigError(f"{where}: resources.{key} = {value!r}: must be a number "
                              f"{'> 0' if key == 'num_cpus' else '>= 0'}")
        if value > 1 and value != int(value):  # Ray's rule for fractional resources
            raise ConfigError(f"{where}: resources.{key} = {value}: a fraction below 1 or a whole number")
        out[key] = value
    return out


def job_resources(file_table: dict, num_cpus: float | None = None, num_gpus: float | None = None) -> dict[str, float]:
    """A job's resources: the defaults < the ablation file's ``[resources]`` < ``--num-cpus`` / ``--num-gpus``."""
    flags = {k: v for k, v in (("num_cpus", num_cpus), ("num_gpus", num_gpus)) if v is not None}
    for key, value in flags.items():
        parse_resources({key: value}, f"--{key.replace('_', '-')}")
    return {**{k: d for k, (d, _) in RESOURCES.items()}, **file_table, **flags}


# ---------------------------------------------------------------------------- on the worker node
def _child_setup(parent: int, prctl) -> None:
    """In the training process between fork and exec. A cancel stops the child with SIGINT (:func:`_stop`), so
    the child must act on it: Ray workers block SIGINT, and a worker of a Ray instance started by a driver that
    ignores SIGINT (a shell's background job) ignores it too; both would be inherited. The child runs in its
    worker's process group, which no terminal's Ctrl-C reaches, so restoring the default reaches only that
    cancel. And the child must die with its worker (killed, or its node gone) rather than go on training unseen
    (Ray does the same for its own processes: ``set_kill_on_parent_death_linux``)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if prctl is not None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the worker died before prctl took effect
            os._exit(1)


def _stop(child: subprocess.Popen) -> None:
    """SIGINT (the run closes its engine and MLflow run, as on Ctrl-C), SIGKILL after STOP_GRACE_S."""
    try:
        if child.poll() is None:
            child.send_signal(signal.SIGINT)
            deadline = time.time() + STOP_GRACE_S
            while child.poll() is None and time.time() < deadline:
                time.sleep(0.1)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def run_job(args: list[str], cwd: str, stdout: str, stderr: str, env: dict[str, str]) -> dict:
    """The body of one job's Ray task: ``python <args>`` in ``cwd``, output appended to ``stdout`` / ``stderr``;
    returns its exit status. A ``ray.cancel`` arrives as KeyboardInterrupt and stops the child first."""
    parent, prctl = os.getpid(), None
    if sys.platform.startswith("linux"):
        import ctypes

        prctl = ctypes.CDLL(None).prctl  # looked up here: the child may only call it between fork and exec
    if not os.path.isdir(cwd):
        raise FileNotFoundError(f"node {socket.gethostname()} does not have {cwd}: every node must mount the "
                                "ablation's working directory, output directory and warm-start cache at the same paths")
    with open(stdout, "ab") as so, open(stderr, "ab") as se:
        child = subprocess.Popen([sys.executable, *args], cwd=cwd, stdout=so, stderr=se, stdin=subprocess.DEVNULL,
                                 env={**os.environ, **env}, preexec_fn=lambda: _child_setup(parent, prctl))
    try:
        while child.poll() is None:
            time.sleep(0.2)  # not child.wait(): a cancel's KeyboardInterrupt is raised only between bytecodes
    except BaseException:
        _stop(child)
        raise
    return {"returncode": child.returncode, "node": socket.gethostname()}


# ---------------------------------------------------------------------------- on the driver
def _describe(e: BaseException) -> str:
    """One line for a failed task: what the task raised, or what Ray says happened to its worker or node."""
    cause = getattr(e, "cause", None) or e
    text = " ".join(str(cause).split())
    return f"ray: {type(cause).__name__}: {text[:400]}"


class RayJob:
    """One submitted job: its Ray task, behind the part of ``subprocess.Popen``'s interface the runner uses."""

    def __init__(self, ref, args: list[str]):
        self.ref, self.args = ref, args
        self.pid = None  # the training process's pid is known (and recorded) only when the task returns
        self.returncode: int | None = None
        self.error: str | None = None
        self.info = {"ray_task_id": ref.task_id().hex(), "node": None}  # node: known when the task returns

    def _collect(self) -> None:
        import ray

        try:
            res = ray.get(self.ref)
            self.returncode = res["returncode"]
            self.info["node"] = res["node"]
        except ray.exceptions.RayError as e:  # the task raised, was cancelled, or its worker or node died
            self.returncode, self.error = -1, _describe(e)

    def poll(self) -> int | None:
        import ray

        if self.returncode is None and ray.wait([self.ref], timeout=0)[0]:
            self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import ray

        if self.returncode is None:
            if not ray.wait([self.ref], timeout=timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._collect()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        import ray

        ray.cancel(self.ref, force=False)  # KeyboardInterrupt in the task: it stops the training process

    def kill(self) -> None:
        import ray

        ray.cancel(self.ref, force=True)  # kills the worker; its training process dies with it


class RayBackend:
    """Jobs as Ray tasks; a context manager that connects to Ray (or starts a local instance) and disconnects
    (stopping the local instance) on exit."""

    name = "ray"
    signals_reach_jobs = False  # Ray workers run in their own process groups: a Ctrl-C reaches only rail ablate

    def __init__(self, resources: dict[str, float], address: str | None = None):
        self.resources, self.address = resources, address
        self._task = None

    def threads(self, workers: int) -> int:
        return max(1, int(self.resources["num_cpus"]))

    def describe(self, workers: int, threads: int) -> str:
        where = f"the Ray cluster at {self.address}" if self.address else "a local Ray instance"
        return (f"Ray tasks on {where}, {self.resources['num_cpus']:g} CPU and {self.resources['num_gpus']:g} GPU "
                f"each, at most {workers} at a time, {threads} threads each")

    def _connect(self) -> None:
        import ray

        kw = {"include_dashboard": False, "log_to_driver": False}
        if not self.address:
            # "local": never join a cluster found on this host. Ray starts its workers at niceness 15 by default,
            # and a job's training process inherits it: beside any other work on the machine it would all but
            # stop. On the instance rail starts itself, the jobs run at the driver's priority.
            ray.init(address="local", num_cpus=usable_cores(), _system_config={"worker_niceness": 0}, **kw)
            return
        host, _, port = self.address.rpartition(":")
        if host and port.isdigit():  # Ray retries an address where nothing listens for minutes: look first
            try:
                socket.create_connection((host, int(port)), timeout=10).close()
            except OSError as e:
                raise ConfigError(f"--address {self.address}: no Ray cluster answers there ({e})") from None
        try:
            ray.init(address=self.address, **kw)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConfigError(f"--address {self.address}: cannot join that Ray cluster ({' '.join(str(e).split())})") from None

    def _check_fits(self) -> None:
        """A task no node can hold waits forever: refuse it on the local instance, warn on a cluster (whose
        autoscaler may still add such a node)."""
        import ray

        need = {"CPU": self.resources["num_cpus"], "GPU": self.resources["num_gpus"]}
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        if any(all(r.get(k, 0) >= v for k, v in need.items()) for r in nodes):
            return
        have = ", ".join(f"{r.get('CPU', 0):g} CPU / {r.get('GPU', 0):g} GPU" for r in nodes) or "none"
        msg = (f"[resources] num_cpus = {need['CPU']:g}, num_gpus = {need['GPU']:g}: no node of the Ray cluster has "
               f"that much (nodes: {have})")
        if not self.address:
            raise ConfigError(msg + "; lower them with --num-cpus / --num-gpus or [resources]")
        print(f"rail: warning: {msg}; the jobs wait until such a node joins", file=sys.stderr)

    def __enter__(self) -> "RayBackend":
        try:
            import ray
        except ImportError:
            raise ConfigError("--backend ray needs the ray extra: pip install -e \".[ray]\"") from None
        self._connect()
        try:
            self._check_fits()
        except BaseException:
            ray.shutdown()
            raise
        self._task = ray.remote(run_job)
        return self

    def __exit__(self, *exc) -> None:
        import ray

        ray.shutdown()  # stops the local instance this process started; on a cluster, only disconnects

    def spawn(self, job, args: list[str], env: dict[str, str], lock_fd: int | None) -> RayJob:
        cwd = os.getcwd()
        # max_retries=0: a job whose worker or node died is recorded as failed; rerunning the ablation resumes it
        ref = self._task.options(name=f"rail-ablate {job.key}", num_cpus=self.resources["num_cpus"],
                                 num_gpus=self.resources["num_gpus"], max_retries=0).remote(
            args, cwd, str(Path(cwd, job.stdout)), str(Path(cwd, job.stderr)), env)
        return RayJob(ref, [sys.executable, *args])
