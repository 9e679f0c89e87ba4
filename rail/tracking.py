"""Experiment tracking behind one small interface: MLflow, a JSONL file, or nothing.

A tracking failure never stops training: the MLflow tracker logs one warning, then turns itself off and the
run goes on (``metrics.jsonl`` is always written by the file tracker), and the run's summary says so. It costs
seconds, not minutes: MLflow's own HTTP retries (7, with exponential backoff: about four minutes against a
server that is down) are turned off and a request times out after 10 s, unless the environment sets
``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` / ``MLFLOW_HTTP_REQUEST_TIMEOUT`` itself.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any

log = logging.getLogger("rail.tracking")


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class NullTracker:
    run_id: str | None = None

    def log_params(self, params: dict) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def close(self, status: str = "FINISHED") -> None: ...


class JsonlTracker(NullTracker):
    """One JSON line per step in ``metrics.jsonl``; on resume, lines past the checkpoint are dropped."""

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = path
        if resume_step is not None and path.exists():
            text = path.read_bytes().decode("utf-8", "replace")  # a damaged line is dropped, not a crash
            keep = [ln for ln in text.splitlines() if ln.strip() and _step_of(ln) <= resume_step]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(ln + "\n" for ln in keep))
            os.replace(tmp, path)
        self._f = open(path, "a", buffering=1)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        clean = {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None) for k, v in metrics.items()}
        self._f.write(json.dumps({"step": step, **clean}, sort_keys=True) + "\n")

    def close(self, status: str = "FINISHED") -> None:
        self._f.close()


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except Exception:  # noqa: BLE001 - a torn last line from a killed run
        return 1 << 60


def _artifacts_for(uri: str) -> str | None:
    """Artifacts of a local SQLite store live beside the database file, not in the working directory."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).resolve().parent / "mlruns").as_uri()
    return None


def mlflow_metric_name(name: str) -> str:
    """MLflow accepts only alphanumerics, ``_ - . : /`` and spaces in metric names: ``how@where`` is logged
    as ``how:where`` (``intervention/rubric_hint:violation/decisions``); metrics.jsonl keeps the ``@``."""
    return re.sub(r"[^\w\-. :/]", lambda m: ":" if m.group() == "@" else "_", name)


#: MLflow's HTTP client settings in every rail process that tracks (the environment's own values win); set on
#: import, before any MLflow request (`rail ablate`'s parent run looks its run up before it makes a tracker)
HTTP_SETTINGS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
for _k, _v in HTTP_SETTINGS.items():
    os.environ.setdefault(_k, _v)


class MlflowTracker(NullTracker):
    """MLflow run; every call is guarded, and the first failure disables the tracker with one warning
    (``error`` then says what failed)."""

    def __init__(self, uri: str, experiment: str, run_name: str, run_id: str | None = None,
                 parent_run_id: str | None = None):
        self.ok = True
        self.error: str | None = None
        self.run_id = None
        self.client = None
        try:
            import mlflow  # imported lazily: it is slow, and tracking is optional

            self.mlflow = mlflow
            mlflow.set_tracking_uri(uri)
            exp = mlflow.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else mlflow.create_experiment(experiment, artifact_location=_artifacts_for(uri))
            client = mlflow.MlflowClient()
            if run_id is None:
                tags = {"mlflow.runName": run_name}
                if parent_run_id:
                    tags["mlflow.parentRunId"] = parent_run_id
                run_id = client.create_run(exp_id, tags=tags).info.run_id
            else:
                client.update_run(run_id, status="RUNNING")
            self.client, self.run_id = client, run_id
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _fail(self, e: Exception) -> None:
        if self.ok:
            self.error = f"{type(e).__name__}: {str(e)[:300]}"
            warnings.warn(f"MLflow tracking disabled after an error ({self.error}); "
                          "training continues, metrics.jsonl is still written", stacklevel=3)
        self.ok = False

    def _guard(self, fn, *a, **kw) -> None:
        if not self.ok:
            return
        try:
            fn(*a, **kw)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        flat = flatten(params)
        batch = [Param(k, str(v)[:6000]) for k, v in flat.items()]
        self._guard(lambda: [self.client.log_batch(self.run_id, params=batch[i:i + 100])
                             for i in range(0, len(batch), 100)])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        import time

        ts = int(time.time() * 1000)
        batch = [Metric(mlflow_metric_name(k), float(v), ts, step) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and math.isfinite(v)]
        self._guard(lambda: [self.client.log_batch(self.run_id, metrics=batch[i:i + 500])
                             for i in range(0, len(batch), 500)])

    def log_artifact(self, path: str | Path) -> None:
        self._guard(lambda: self.client.log_artifact(self.run_id, str(path)))

    def set_tags(self, tags: dict[str, str]) -> None:
        self._guard(lambda: [self.client.set_tag(self.run_id, k, v) for k, v in tags.items()])

    def close(self, status: str = "FINISHED") -> None:
        self._guard(lambda: self.client.set_terminated(self.run_id, status))


class MultiTracker:
    """Fans every call out to several trackers."""

    def __init__(self, *trackers):
        self.trackers = trackers

    @property
    def run_id(self):
        return next((t.run_id for t in self.trackers if t.run_id), None)

    def __getattr__(self, name):
        def call(*a, **kw):
            for t in self.trackers:
                getattr(t, name)(*a, **kw)
        return call
