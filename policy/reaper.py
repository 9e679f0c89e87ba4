"""A guard process that cleans up after a parent that may die without cleaning up itself.

vLLM runs its engine core (and its workers) in processes of their own. When the process that started them
exits normally it shuts them down, and Ctrl-C reaches them through the terminal's process group; but a parent
killed with SIGKILL (or by the out-of-memory killer) leaves them running, holding memory and cores. The reaper
is a small child process that reads ``pid N`` and ``path P`` lines on its stdin; when stdin closes -- the parent
closed it, or the parent died and the kernel closed it -- it terminates every listed process tree that is still
alive (SIGTERM, then SIGKILL after a grace period), removes every listed path, and exits.

Usage (from the parent)::

    reaper = Reaper.start()
    reaper.watch_pid(pid); reaper.watch_path(tmpdir)
    ...
    reaper.close()   # normal end: whatever is still listed is cleaned up now

Run as ``python -m policy.reaper``; it imports nothing heavy.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc); empty where /proc is unavailable."""
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    out += [int(x) for x in f.read().split()]
            except OSError:
                pass
    except OSError:
        pass
    return out


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, parents first."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        tree.append(p)
        todo += _children(p)
    return tree


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def terminate(pids: list[int], grace: float = 5.0) -> None:
    """SIGTERM every process of the trees rooted at ``pids``, then SIGKILL whatever outlives ``grace`` seconds."""
    tree = [p for root in pids for p in process_tree(root)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in tree:
            if _alive(p):
                try:
                    os.kill(p, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 1.0)
        while time.monotonic() < deadline and any(_alive(p) for p in tree):
            time.sleep(0.05)


class Reaper:
    """The parent's handle on a reaper child process."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    @classmethod
    def start(cls) -> "Reaper":
        proc = subprocess.Popen([sys.executable, "-m", "policy.reaper"], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, text=True, start_new_session=True)
        return cls(proc)

    def _send(self, line: str) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def watch_pid(self, pid: int) -> None:
        self._send(f"pid {int(pid)}")

    def watch_path(self, path: str | os.PathLike) -> None:
        self._send(f"path {os.fspath(path)}")

    def close(self, timeout: float = 30.0) -> None:
        """Clean up now (whatever is still alive or present) and wait for the reaper to exit."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main() -> None:
    # Started in its own session, so the parent's Ctrl-C does not kill it before it has cleaned up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pids, paths = [], []
    for line in sys.stdin:
        kind, _, value = line.strip().partition(" ")
        if kind == "pid" and value.isdigit():
            pids.append(int(value))
        elif kind == "path" and value:
            paths.append(value)
    terminate(pids)
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


if __name__ == "__main__":
    main()
