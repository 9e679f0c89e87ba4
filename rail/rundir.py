"""The run directory (``run.out``): one process at a time, and what a directory holds before a run starts or
resumes in it.

A ``rail train`` holds an exclusive lock on ``<out>/.lock`` (``flock``; the file names the holder's pid) from
before it writes anything until it ends, for a fresh start and a resume alike: a second process on the same
directory is refused with the first one's pid, instead of both writing one trace and one metrics file. The
kernel drops the lock with its process, so a lock file a killed run left behind is simply taken over.

Torch-free: the command line checks a directory before anything heavy is imported.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import warnings
from pathlib import Path

LOCK = ".lock"
#: what a run writes besides checkpoints/ and summary.json; removed when a run without a checkpoint starts over
PARTIAL = ("metrics.jsonl", "traces", "engine", "checkpoints")


class RunError(RuntimeError):
    """A run that cannot start or continue; the message says why and what to do."""


class RunLock:
    """The exclusive lock of one run directory, held until :meth:`release` (or until the process ends)."""

    def __init__(self, out: Path):
        self.path = Path(out) / LOCK
        try:
            self._f = open(self.path, "a+", encoding="utf-8")
        except OSError as e:
            raise RunError(f"run.out {out}: cannot write there ({e.strerror}); choose a writable --out") from None
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._f.seek(0)
            holder = self._f.read().strip() or "unknown"
            self._f.close()
            raise RunError(f"{out}: another rail process (pid {holder}) is running in this directory; wait for it "
                           f"to end or stop it, then run again") from None
        self._f.seek(0)
        self._f.truncate()
        self._f.write(f"{os.getpid()}\n")
        self._f.flush()

    def release(self) -> None:
        if not self._f.closed:
            fcntl.flock(self._f, fcntl.LOCK_UN)
            self._f.close()


def make_out(out: Path) -> bool:
    """Create ``out`` (and its parents); True when it did not exist. A clear error for a path that cannot be a
    directory (a file, a path under a file, a read-only or full file system)."""
    out = Path(out)
    existed = out.is_dir()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunError(f"run.out {out}: is a file, not a directory; choose another --out") from None
    except NotADirectoryError:
        raise RunError(f"run.out {out}: a part of this path is a file, not a directory; choose another --out") from None
    except OSError as e:
        why = "read-only file system" if e.errno == errno.EROFS else e.strerror
        raise RunError(f"run.out {out}: cannot create it ({why}); choose a writable --out") from None
    return not existed


def has_checkpoint(out: Path) -> bool:
    """Whether a checkpoint was ever completed in ``out`` (a ``step_*`` directory or the ``latest`` pointer)."""
    ck = Path(out) / "checkpoints"
    return (ck / "latest").exists() or any(p.is_dir() for p in ck.glob("step_*"))


def is_run_config(path: Path) -> bool:
    """Whether ``path`` is a config.json a rail run wrote (so a directory holding it is a run's)."""
    from rail.config import Config, ConfigError, merge

    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        merge(Config(), raw)
        return True
    except (OSError, ValueError, ConfigError, AttributeError):
        return False


def clear_partial(out: Path, why: str) -> None:
    """Remove what an attempt wrote before its first checkpoint (nothing finished: no step was checkpointed), so
    the run starts over in the same directory; ``why`` says which case it is."""
    gone = [name for name in PARTIAL if (Path(out) / name).exists()]
    for name in gone:
        p = Path(out) / name
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    warnings.warn(f"{out}: {why}; starting it again from the beginning"
                  + (f" (removed {', '.join(gone)})" if gone else ""), stacklevel=2)
