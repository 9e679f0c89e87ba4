"""experiments/api_example.py, docs/api.md's runnable example, run as written: a configuration built in code, a run
started through rail.train.start_run on the smoke preset with tracking off, its summary's key figures printed."""

from __future__ import annotations

import json
import sys

from processes import ROOT, run


def test_api_example_trains_the_smoke_preset_and_prints_the_key_figures(tmp_path):
    out = tmp_path / "run"
    r = run([sys.executable, str(ROOT / "experiments" / "api_example.py"), "--out", str(out),
             "--warmstart-cache", str(tmp_path / "warmstart")], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("key figures: "))
    figures = json.loads(line.removeprefix("key figures: "))
    assert figures["controller"] == "rail" and figures["steps"] == 3
    assert figures["budget_spent"]["total"] == 3 * 16  # the smoke preset's budget, spent exactly
    assert figures["controller_mode"] in ("shadow", "live")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["budget"]["spent"] == figures["budget_spent"]
    assert summary["tracking"]["status"] == "off" and (out / "metrics.jsonl").is_file()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000003"
