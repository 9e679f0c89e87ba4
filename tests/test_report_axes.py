"""`rail report` on synthetic ablation directories: the budget each arm needs to reach plain GRPO's final success
beyond the boundary; what the controllers chose per family and level; and, after a task-mix shift, how many steps
each controller's choices took to settle (steps_to_follow, on synthetic metrics) and the success on the new mix."""

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
    from rail.lab.ablation_report import write_report

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
    from rail.lab.ablation_report import write_report

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
    from rail.lab.ablation_report import write_report

    root = tmp_path / "abl"
    fake_run(root / "ladder" / "seed0", "ladder", 0, [0.0, 0.1, 0.2], [0.2, 0.3, 0.4])
    fake_run(root / "rail" / "seed0", "rail", 0, [0.0, 0.1, 0.2], [0.2, 0.3, 0.4])
    rep = write_report(root, figures=False)
    assert rep["none_final_beyond"] is None
    assert all(v["budget_to_match_none_beyond"] is None for v in rep["arms"].values())
    assert rep["verdict"]["less_budget_than_all_beyond"] is None


# ---------------------------------------------------------------------------- steps_to_follow on synthetic choices
def test_steps_to_follow_counts_the_steps_until_the_choices_stay_at_their_steady_state():
    from rail.lab.adaptivity import follow_distances, steps_to_follow

    switched = [{"none": 10.0}] * 6 + [{"rubric_hint@violation": 8.0, "none": 2.0}] * 14  # 20 post-shift steps
    # window ceil(20 / 5) = 4 steps; steady state: the last 5 steps (0.8 hint, 0.2 none); a window holding j steps
    # after the switch has 0.2 j hint
    d = follow_distances(switched)
    assert d[:6] == pytest.approx([0.8] * 6)
    assert d[6:9] == pytest.approx([0.6, 0.4, 0.2])
    assert d[9:] == pytest.approx([0.0] * 11)
    assert steps_to_follow(switched) == 8  # the first window within 0.25: 3 of its 4 steps after the switch
    assert steps_to_follow(switched, window=1) == 6
    assert steps_to_follow(switched, tol=0.5) == 7
    # choices that never change follow at once, whatever they are (a controller that never intervenes too)
    assert steps_to_follow([{"none": 16.0}] * 9) == 0
    assert steps_to_follow([{"resample@start": 3.0, "none": 13.0}] * 9) == 0
    # the last window (4 of 20 steps) is off the steady state (the last 5, half of them none): never
    flip = [{"none": 40.0}] * 16 + [{"resample@start": 10.0}] * 4
    assert follow_distances(flip)[-1] == pytest.approx(0.5) and steps_to_follow(flip) is None
    assert steps_to_follow([{"none": 10.0}] * 7 + [{"resample@start": 10.0}], window=1) is None
    # nothing logged after the shift (a run from before the choice metrics): no answer
    assert steps_to_follow([]) is None and steps_to_follow([{}, {}]) is None


def test_choice_counts_read_the_shifted_cells_from_the_metrics():
    from rail.lab.adaptivity import cell_series, choice_counts, shift_of, steps_to_follow

    rows = [{"step": 1, "choice/calc/level_1/groups": 4.0, "choice/calc/level_1/intervened": 1.0,
             "choice/calc/level_1/resample@start": 1.0},
            {"step": 2, "choice/calc/level_3/groups": 4.0, "choice/calc/level_3/intervened": 3.0,
             "choice/calc/level_3/rubric_hint@violation": 4.0, "choice/kin/level_3/groups": 2.0,
             "choice/kin/level_3/intervened": 0.0},
            {"step": 3, "choice/calc/level_3/groups": 6.0, "choice/calc/level_3/intervened": 3.0,
             "choice/calc/level_3/rubric_hint@violation": 3.0}]
    cells = cell_series(rows)
    assert list(cells) == ["calc L1", "calc L3", "kin L3"]
    assert cells["calc L3"]["groups"] == [0.0, 4.0, 6.0] and cells["calc L1"]["keys"] == {"resample@start": [1.0, 0.0, 0.0]}
    shift = shift_of({"env": {"families": ["calc", "kin"], "levels": [1, 2], "shift_step": 2, "shift_levels": [3],
                              "shift_families": ["calc"]}})
    assert shift == {"step": 2, "families": ["calc"], "levels": [3]}
    # kin is not in the shifted mix; a group hinted twice counts twice, a group left alone once as none
    assert choice_counts(cells, [1, 2, 3], shift) == [{"none": 1.0, "rubric_hint@violation": 4.0},
                                                      {"none": 3.0, "rubric_hint@violation": 3.0}]
    assert steps_to_follow(choice_counts(cells, [1, 2, 3], shift)) == 1
    assert shift_of({"env": {"families": ["calc"], "levels": [1, 2]}}) is None
    assert shift_of({"env": {"families": ["calc"], "levels": [1, 2], "shift_step": 3,
                             "shift_families": ["calc"]}})["levels"] == [1, 2]  # empty: env.levels


def test_success_on_the_shifted_mix_from_the_evaluation_before_the_change():
    from rail.lab.adaptivity import shift_success

    hist = [{"step": 2 * i, "budget_spent": 32 * i, "success": {"calc": {"1": 0.5, "3": y}, "kin": {"3": 0.0}}}
            for i, y in enumerate([0.0, 0.0, 0.1, 0.3, 0.5])]
    out = shift_success(hist, {"step": 5, "families": ["calc"], "levels": [3]})
    assert out["cells"] == ["calc L3"] and out["start_step"] == 4
    assert out["initial"] == 0.1 and out["final"] == 0.5
    assert out["auc"] == pytest.approx(((0.1 + 0.3) / 2 * 32 + (0.3 + 0.5) / 2 * 32) / 64)
    both = shift_success(hist, {"step": 5, "families": ["calc", "kin"], "levels": [3]})  # kin L3 stays at 0
    assert both["cells"] == ["calc L3", "kin L3"] and both["final"] == pytest.approx(0.25)
    assert shift_success(hist, {"step": 5, "families": ["calc"], "levels": [4]})["final"] is None  # not evaluated


# ---------------------------------------------------------------------------- the report with a shift
def _choice_rows(before: list[tuple[float, str | None]], after: list[tuple[float, str | None]]) -> list[dict]:
    """Steps 1-4 on calc L1 and L2 (2 groups each), steps 5-8 on calc L3 (4 groups): per step (groups
    intervened, the how@where used once per intervened group)."""
    rows = []
    for i, (n, key) in enumerate(before + after):
        cells = ["level_1", "level_2"] if i < len(before) else ["level_3"]
        per = 4.0 / len(cells)
        r = {}
        for c in cells:
            r[f"choice/calc/{c}/groups"] = per
            r[f"choice/calc/{c}/intervened"] = n / len(cells)
            if key and n:
                r[f"choice/calc/{c}/{key}"] = n / len(cells)
        r["intervention/budget_share"] = 0.25 if n else 0.0
        if key and n:
            r[f"intervention/{key}/decisions"] = n
            r[f"intervention/{key}/rollouts"] = 2 * n
        rows.append(r)
    return rows


def test_report_with_a_task_mix_shift(tmp_path):
    import numpy as np
    from matplotlib.image import imread
    from scipy import stats

    from rail.lab.ablation_report import write_report

    root = tmp_path / "abl"
    env = {"families": ["calc"], "levels": [1, 2], "shift_step": 5, "shift_levels": [3], "shift_families": []}
    easy = [0.5] * 5
    hint, res = "rubric_hint@violation", "resample@start"
    for seed in (0, 1):
        fake_run(root / "none" / f"seed{seed}", "none", seed, [0.0, 0.0, 0.1, 0.1, 0.2], easy, env=env,
                 rows=_choice_rows([(0.0, None)] * 4, [(0.0, None)] * 4))
        # ladder: hints every group from the shift on, at once
        fake_run(root / "ladder" / f"seed{seed}", "ladder", seed, [0.0, 0.0, 0.1, 0.2, 0.3], easy, env=env,
                 rows=_choice_rows([(2.0, res)] * 4, [(4.0, hint)] * 4))
        # rail: leaves the new levels alone for 2 (seed 0) or 3 (seed 1) steps, then hints every group
        late = 2 + seed
        fake_run(root / "rail" / f"seed{seed}", "rail", seed, [0.0, 0.0, 0.1, 0.3, 0.5 - 0.2 * seed], easy, env=env,
                 rows=_choice_rows([(2.0, res)] * 4, [(0.0, None)] * late + [(4.0, hint)] * (4 - late)))
    parent = FakeParent()
    rep = write_report(root, parent=parent)
    sh = rep["shift"]
    assert sh["step"] == 5 and sh["levels"] == [3] and sh["families"] == ["calc"]
    assert sh["cells"] == ["calc L3"] and sh["start_step"] == 4 and sh["tolerance"] == 0.25
    arms = rep["arms"]
    r, lad, none = arms["rail"], arms["ladder"], arms["none"]
    # steps to follow: 4 post-shift steps, window 1, steady state the last step
    assert r["per_seed"]["0"]["steps_to_follow"] == 2 and r["per_seed"]["1"]["steps_to_follow"] == 3
    assert r["steps_to_follow"] == pytest.approx(2.5) and r["steps_to_follow_never"] == 0
    lo, hi = r["steps_to_follow_ci"]  # a count of steps: clipped at 0
    assert lo == 0 and hi == pytest.approx(2.5 + stats.t.ppf(0.975, 1) * np.std([2, 3], ddof=1) / np.sqrt(2))
    assert lad["steps_to_follow"] == 0 and none["steps_to_follow"] == 0
    # success on the shifted mix (calc L3) from the evaluation at step 4 (budget 64) to the end (128)
    assert r["shift_initial"] == pytest.approx(0.1) and r["shift_final"] == pytest.approx(0.4)
    assert r["per_seed"]["0"]["shift_auc"] == pytest.approx(0.3) and r["per_seed"]["1"]["shift_auc"] == pytest.approx(0.25)
    assert lad["shift_auc"] == pytest.approx(0.2) and lad["shift_final"] == pytest.approx(0.3)
    # paired against ladder
    adv = rep["after_shift"]
    assert adv["reference"] == "ladder" and set(adv["vs"]) == {"none", "rail"}
    v = adv["vs"]["rail"]
    assert v["shift_final_diff"] == pytest.approx(0.1) and v["shift_auc_diff"] == pytest.approx(0.075)
    assert v["steps_to_follow_diff"] == pytest.approx(2.5) and v["steps_to_follow_paired_seeds"] == [0, 1]
    # per-seed differences 0.2 and 0.0: 0.1 ± 1.27 over 2 seeds, clipped to the [-1, 1] of a difference of rates
    assert v["shift_final_diff_ci"] == [-1.0, 1.0] and v["shift_final_n"] == 2 and v["shift_final_few_seeds"] is True
    assert "`rail` − `ladder`, paired over seeds: final success on the shifted mix +0.100" in adv["text"]
    assert "steps to follow +2.5" in adv["text"]
    # what each chose per family and level, over training
    cb = r["choices_by_cell"]
    assert set(cb) == {"calc L1", "calc L2", "calc L3"}
    assert cb["calc L1"]["intervened_share"] == pytest.approx(0.5) and cb["calc L1"]["dominant"] == res
    assert cb["calc L3"]["dominant"] == hint
    assert cb["calc L3"]["intervened_share"] == pytest.approx((8 + 4) / 32)  # 2 + 1 hinted steps of 4 groups
    assert none["choices_by_cell"]["calc L3"] == {"groups": 16.0, "intervened_share": 0.0, "decisions": {},
                                                  "dominant": None}
    # report.json without the private series; report.md with both sections; MLflow
    js = json.loads((root / "report.json").read_text())
    assert "_cells_series" not in js["arms"]["rail"] and js["arms"]["rail"]["steps_to_follow"] == 2.5
    md = (root / "report.md").read_text()
    assert "## After the task-mix shift at step 5" in md and adv["text"] in md
    row = next(ln for ln in md.splitlines() if ln.startswith("| `rail` | 2 | 2.5 |"))
    assert "| 0 | 0.100 | 0.400 |" in row and "| 2.5 |" in row
    assert "## What the controllers chose per family and level" in md
    assert f"| `rail` | 2 | 0.50 {res} | 0.50 {res} | 0.38 {hint} |" in md
    assert parent.metrics["report/rail/steps_to_follow"] == 2.5
    assert parent.metrics["report/ladder/shift_auc"] == pytest.approx(0.2)
    # the figure: written, listed, linked, not blank
    assert "choices_by_level.png" in rep["figures"] and "](choices_by_level.png)" in md
    png = root / "choices_by_level.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = imread(png)
    assert img.shape[0] > 200 and img.shape[1] > 300 and float(np.std(img[..., :3])) > 0.02


def test_report_without_a_shift_has_no_shift_section_and_still_draws_the_choices(tmp_path):
    from rail.lab.ablation_report import write_report

    root = tmp_path / "abl"
    for arm in ("none", "ladder"):
        fake_run(root / arm / "seed0", arm, 0, [0.0, 0.1, 0.2, 0.2, 0.3], [0.5] * 5,
                 rows=_choice_rows([(2.0 if arm == "ladder" else 0.0, "resample@start")] * 8, []))
    rep = write_report(root)
    assert rep["shift"] is None and rep["after_shift"] is None
    assert rep["arms"]["ladder"]["steps_to_follow"] is None and rep["arms"]["ladder"]["shift_final"] is None
    md = (root / "report.md").read_text()
    assert "task-mix shift" not in md and "choices_by_level.png" in rep["figures"]
    assert rep["arms"]["ladder"]["choices_by_cell"]["calc L2"]["dominant"] == "resample@start"
    # runs from before the choice metrics: no table, the figure says why it is empty
    old = tmp_path / "old"
    fake_run(old / "none" / "seed0", "none", 0, [0.0, 0.1, 0.2], [0.5] * 3)
    rep = write_report(old)
    assert rep["arms"]["none"]["choices_by_cell"] == {}
    assert "What the controllers chose per family and level" not in (old / "report.md").read_text()
    assert (old / "choices_by_level.png").is_file()


def test_a_controller_that_never_settles_is_counted_and_left_out_of_the_mean(tmp_path):
    from rail.lab.ablation_report import write_report

    root = tmp_path / "abl"
    env = {"families": ["calc"], "levels": [1, 2], "shift_step": 4, "shift_levels": [3]}
    hint = "rubric_hint@violation"
    beyond, easy = [0.0, 0.0, 0.1, 0.1, 0.2, 0.2, 0.3], [0.5] * 7  # 12 steps: 9 after the shift, window 2, steady 3
    fake_run(root / "ladder" / "seed0", "ladder", 0, beyond, easy, env=env,
             rows=_choice_rows([(2.0, hint)] * 3, [(4.0, hint)] * 9))
    fake_run(root / "ladder" / "seed1", "ladder", 1, beyond, easy, env=env,
             rows=_choice_rows([(2.0, hint)] * 3, [(4.0, hint)] * 9))
    # seed 0 settles 4 steps after the shift; seed 1 switches in the last two steps: off its own steady state
    fake_run(root / "rail" / "seed0", "rail", 0, beyond, easy, env=env,
             rows=_choice_rows([(2.0, hint)] * 3, [(0.0, None)] * 3 + [(4.0, hint)] * 6))
    fake_run(root / "rail" / "seed1", "rail", 1, beyond, easy, env=env,
             rows=_choice_rows([(2.0, hint)] * 3, [(0.0, None)] * 7 + [(4.0, hint)] * 2))
    rep = write_report(root, figures=False)
    r = rep["arms"]["rail"]
    assert r["per_seed"]["0"]["steps_to_follow"] == 4 and r["per_seed"]["1"]["steps_to_follow"] is None
    assert r["steps_to_follow"] == 4 and r["steps_to_follow_never"] == 1 and r["steps_to_follow_ci"] is None  # one seed
    assert rep["arms"]["ladder"]["steps_to_follow_never"] == 0
    v = rep["after_shift"]["vs"]["rail"]
    assert v["steps_to_follow_paired_seeds"] == [0] and v["steps_to_follow_diff"] == 4
    assert v["shift_final_paired_seeds"] == [0, 1] and v["shift_final_diff"] == 0
    assert "Never settled within the tolerance by the end of the run (seeds): `rail` (1)." in rep["after_shift"]["text"]


def test_choices_of_an_action_at_its_own_temperature_are_read():
    from rail.lab import adaptivity

    rows = [{"choice/kin/level_3/groups": 2.0, "choice/kin/level_3/intervened": 1.0,
             "choice/kin/level_3/resample@entropy:1.3": 1.0, "choice/kin/level_3/rubric_hint@start": 1.0}]
    cell = adaptivity.cell_series(rows)["kin L3"]
    assert set(cell["keys"]) == {"resample@entropy:1.3", "rubric_hint@start"} and cell["groups"] == [2.0]
