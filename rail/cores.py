"""The CPU cores this process may run on, shared by ``rail ablate``'s backends (rail/lab/ablate.py, rail/lab/ablate_ray.py)
and the command line that sizes their workers. Imports nothing of rail's."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask on Linux), else the machine's count, at least 1."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
