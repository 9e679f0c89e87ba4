"""The processes tests start, with everything they assume set up by the test rather than inherited from whoever
started pytest.

A test's child process inherits its signal dispositions, environment, working directory and CPU affinity from
pytest, and pytest from the shell that started it: a POSIX shell starts a background job (``bash .ci/run &``)
with SIGINT and SIGQUIT ignored, ignored dispositions survive ``exec``, and ``rail`` rightly keeps an ignored
SIGINT ignored. So every child here is started through :func:`launch` or :func:`run`:

* **signals**: SIGINT and SIGQUIT at their default dispositions, and unblocked, as in a terminal's foreground
  job; :func:`interrupt` checks that the process it signals handles SIGINT and fails naming the missing
  precondition otherwise;
* **environment**: the suite's own (``conftest.py`` removes the variables that would send runs elsewhere:
  an MLflow server, a Ray cluster), unbuffered output, the repository on ``PYTHONPATH``;
* **working directory**: the repository root unless the test names another;
* **cores**: ``cores=N`` runs the process on N of the cores pytest may use, so what it derives from the core
  count (an ablation's threads per worker) is the same on any machine with that many;
* **waiting**: :func:`wait_for` polls an explicit marker (a file, a checkpoint pointer) and fails at once, with
  the process's output, if the process ends first; its timeout is a safety net, never what a test waits on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RAIL = [sys.executable, "-m", "rail.cli"]
#: signals a terminal's foreground job handles by default and a background job of a shell starts ignoring
FOREGROUND = (signal.SIGINT, signal.SIGQUIT)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a test's child process: the suite's, unbuffered, with the repository importable."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **extra}


def _setup(cores: int | None) -> Callable[[], None]:
    """What runs in the child between fork and exec (no locks taken, nothing allocated that another thread of
    pytest may hold): the foreground signals, and the cores."""
    allowed = sorted(os.sched_getaffinity(0))
    if cores is not None and len(allowed) < cores:
        raise AssertionError(f"precondition of this test: {cores} cores, but pytest may use {len(allowed)}")
    mask = set(allowed[:cores]) if cores is not None else None

    def in_child() -> None:
        for sig in FOREGROUND:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FOREGROUND)
        if mask is not None:
            os.sched_setaffinity(0, mask)
    return in_child


def launch(cmd: list[str], *, cwd: Path | str | None = None, env: dict[str, str] | None = None,
           new_session: bool = False, cores: int | None = None, **kw) -> subprocess.Popen:
    """Start ``cmd`` in the background as a terminal would start a foreground job (module docstring).
    ``new_session``: in a process group of its own, so ``interrupt(p, group=True)`` reaches it and its children
    and nothing else."""
    return subprocess.Popen(cmd, cwd=cwd or ROOT, env=env or child_env(), preexec_fn=_setup(cores),
                            start_new_session=new_session, **kw)


def run(cmd: list[str], *, cwd: Path | str | None = None, env: dict[str, str] | None = None,
        timeout: float = 600, cores: int | None = None, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end (as :func:`launch` starts it), its output captured as text."""
    kw.setdefault("capture_output", True)
    return subprocess.run(cmd, cwd=cwd or ROOT, env=env or child_env(), preexec_fn=_setup(cores),
                          text=True, timeout=timeout, **kw)


def rail(*args: str, **kw) -> subprocess.CompletedProcess:
    """``rail ARGS`` to its end (:func:`run`)."""
    return run([*RAIL, *args], **kw)


def _sigint_bit(status: str, field: str) -> bool:
    line = next(ln for ln in status.splitlines() if ln.startswith(field + ":"))
    return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)


def sigint_problem(pid: int) -> str | None:
    """Why process ``pid`` would not act on a SIGINT (it ignores or blocks it), or None; None too where /proc
    cannot tell (not Linux, or the process is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    if _sigint_bit(status, "SigIgn"):
        return (f"process {pid} ignores SIGINT: it inherited an ignored disposition (a shell's background job "
                "starts so); start it with tests/processes.launch")
    if _sigint_bit(status, "SigBlk"):
        return f"process {pid} blocks SIGINT in its main thread; start it with tests/processes.launch"
    return None


def interrupt(p: subprocess.Popen, group: bool = False) -> None:
    """What a terminal's Ctrl-C does: SIGINT to ``p`` (``group``: to its whole process group, as a terminal sends
    it), after checking that ``p`` handles SIGINT at all."""
    problem = sigint_problem(p.pid)
    assert problem is None, f"precondition of this test: {problem}"
    if group:
        os.killpg(p.pid, signal.SIGINT)
    else:
        p.send_signal(signal.SIGINT)


def wait_for(ready: Callable[[], bool], p: subprocess.Popen, what: str, timeout: float = 600,
             output: Callable[[], str] | None = None) -> None:
    """Poll ``ready()`` until it holds while ``p`` runs; fail as soon as ``p`` has ended (a test that waits for a
    marker acts on the running process next), or after ``timeout`` seconds, a bound far above what the wait takes
    on a slow, loaded machine; ``output()`` is shown with either failure."""
    deadline = time.monotonic() + timeout
    while not ready():
        if p.poll() is not None:
            raise AssertionError(f"the process ended (exit {p.returncode}) before {what}"
                                 + (f":\n{output()[-3000:]}" if output else ""))
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:.0f} s" + (f":\n{output()[-3000:]}" if output else ""))
        time.sleep(0.05)
    if p.poll() is not None:
        raise AssertionError(f"the process ended (exit {p.returncode}) just after {what}, before the test could "
                             "act on it" + (f":\n{output()[-3000:]}" if output else ""))
