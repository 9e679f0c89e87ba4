"""`rail report` on synthetic ablation directories: the budget each arm needs to reach plain GRPO's final success
beyond the boundary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def fake_run(d: Path, controller: str, seed: int, beyond: list[float], easy: list[float], *,
             rows: list[dict] | None = None, env: dict | None = None, cells: list[dict] | None = None) -> None:
    """A child run directory with the files the trainer writes (summary.json, metrics.jsonl, config.json).
    Evaluations at steps 0, 2, 4, ... with 32 budget units per evaluation interval; ``cells``: the full
    ``{family: {level: success}}`` of each evaluation instead of calc levels 1 (easy) and 3 (beyond)."""
    d.mkdir(parents=True)
    success = cells or [{"calc": {"1": easy[i], "3": beyond[i]}} for i in range(len(beyond))]
    hist = [{"step": 2 * i, "budget_spent": 32 * i, "success": s} for i, s in enumerate(success)]
    steps = 2 * (len(hist) - 1)
    summary = {"controller": controller, "wall_seconds": 10.0 + seed, "steps": steps,
               "budget": {"unit": "rollouts", "per_step": 16, "total": 0, "group_size": 4,
                          "spent": {"base": 16 * steps, "intervention": 0, "total": 16 * steps}},
               "eval": {"initial": hist[0]["success"], "final": hist[-1]["success"], "history": hist,
                        "easy_levels": [1], "beyond_levels": [3], "easy_initial": easy[0], "easy_final": easy[-1],
                        "beyond_initial": beyond[0], "beyond_final": beyond[-1]},
               "interventions": {"acceptance_rate": 0.5, "budget_share": 0.25}}
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "config.json").write_text(json.dumps({"controller": {"name": controller},
                                               "env": {"families": ["calc"], **(env or {})},
                                               "eval": {"tasks_per_level": 10}}))
    base = [{"step": s, "groups/zero_variance_share": 0.5, "time/generate_s": 1.0, "time/score_s": 0.0,
             "time/controller_s": 0.5, "time/update_s": 0.5, "budget/spent_total": 16.0 * s,
             "intervention/budget_share": 0.0} for s in range(1, steps + 1)]
    for r, extra in zip(base, rows or []):
        r.update(extra)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in base))


class FakeParent:
    """The MLflow parent run as the report sees it: what it logs is recorded."""

    def __init__(self):
        self.metrics, self.artifacts = {}, []

    def _call(self, fn):
        fn(self)

    def log_artifact(self, path):
        self.artifacts.append(Path(path).name)

    def log_metrics(self, metrics, step):
        self.metrics.update(metrics)


# ---------------------------------------------------------------------------- efficiency beyond the boundary
def test_budget_to_match_none_beyond_for_an_arm_that_reaches_it_and_one_that_never_does(tmp_path):
    from rail.ablation_report import write_report

    root = tmp_path / "abl"
    easy = [0.2, 0.3, 0.4]
    for seed, (ladder_mid, rail_end) in enumerate([(0.08, 0.04), (0.12, 0.06)]):
        fake_run(root / "none" / f"seed{seed}", "none", seed, [0.0, 0.05, 0.1], easy)
        # ladder's seed-mean beyond curve 0, 0.10, 0.20: reaches none's 0.1 at the second evaluation (32)
        fake_run(root / "ladder" / f"seed{seed}", "ladder", seed, [0.0, ladder_mid, 0.2], easy)
        # rail's 0, 0.02, 0.05: below 0.1 at every evaluation
        fake_run(root / "rail" / f"seed{seed}", "rail", seed, [0.0, 0.02, rail_end], easy)
    parent = FakeParent()
    rep = write_report(root, parent=parent, figures=False)
    arms = rep["arms"]
    assert rep["none_final_beyond"] == pytest.approx(0.1)
    assert arms["ladder"]["budget_to_match_none_beyond"] == 32
    assert arms["rail"]["budget_to_match_none_beyond"] is None
    assert arms["none"]["budget_to_match_none_beyond"] == 64  # none reaches its own final at its last evaluation
    # the easy one alongside, unchanged: every arm shares the easy curve, so each reaches 0.4 at 64
    assert {a: v["budget_to_match_none"] for a, v in arms.items()} == {"none": 64, "ladder": 64, "rail": 64}
    # the comparison block: rail never reached it, ladder did with 32
    v = rep["verdict"]
    assert v["less_budget_than_all_beyond"] is False
    assert "never reached the `none` arm's final beyond-boundary success (0.100)" in v["text"]
    assert "`ladder` 32" in v["text"]
    # the table: beside the easy column, "never" where it is not reached
    md = (root / "report.md").read_text()
    assert "| budget to match none (easy) | budget to match none (beyond) |" in md
    assert "| 0.200 | [" in md  # ladder's final beyond
    row = next(ln for ln in md.splitlines() if ln.startswith("| `rail` | rail |"))
    assert "| 64 | never |" in row
    row = next(ln for ln in md.splitlines() if ln.startswith("| `ladder` | ladder |"))
    assert "| 64 | 32 |" in row
    assert "the target of 'budget to match none (beyond)': 0.100" in md
    # report.json and MLflow: logged where the easy one is, absent ("never") for rail
    assert json.loads((root / "report.json").read_text())["arms"]["rail"]["budget_to_match_none_beyond"] is None
    assert parent.metrics["report/ladder/budget_to_match_none_beyond"] == 32.0
    assert parent.metrics["report/ladder/budget_to_match_none"] == 64.0
    assert "report/rail/budget_to_match_none_beyond" not in parent.metrics
    assert {"report.md", "report.json"} <= set(parent.artifacts)


def test_budget_to_match_none_beyond_when_rail_needs_the_least(tmp_path):
    from rail.ablation_report import write_report

    root = tmp_path / "abl"
    easy = [0.2, 0.3, 0.4]
    fake_run(root / "none" / "seed0", "none", 0, [0.0, 0.05, 0.1], easy)
    fake_run(root / "ladder" / "seed0", "ladder", 0, [0.0, 0.05, 0.1], easy)
    fake_run(root / "rail" / "seed0", "rail", 0, [0.0, 0.1, 0.2], easy)
    rep = write_report(root, figures=False)
    assert rep["arms"]["rail"]["budget_to_match_none_beyond"] == 32
    assert rep["arms"]["ladder"]["budget_to_match_none_beyond"] == 64
    assert rep["verdict"]["less_budget_than_all_beyond"] is True
    assert "beyond-boundary success (0.100) after 32 budget units; the other fixed heuristics: `ladder` 64, so it " \
           "needed the least budget." in rep["verdict"]["text"]


def test_without_a_none_arm_budget_to_match_none_beyond_is_empty(tmp_path):
    from rail.ablation_report import write_report

    root = tmp_path / "abl"
    fake_run(root / "ladder" / "seed0", "ladder", 0, [0.0, 0.1, 0.2], [0.2, 0.3, 0.4])
    fake_run(root / "rail" / "seed0", "rail", 0, [0.0, 0.1, 0.2], [0.2, 0.3, 0.4])
    rep = write_report(root, figures=False)
    assert rep["none_final_beyond"] is None
    assert all(v["budget_to_match_none_beyond"] is None for v in rep["arms"].values())
    assert rep["verdict"]["less_budget_than_all_beyond"] is None
