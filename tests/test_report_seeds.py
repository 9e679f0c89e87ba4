"""`rail report` with few seeds and an unfinished ablation: intervals clipped to where a rate (or a difference of
rates) can lie, intervals from fewer than 3 seeds marked and none from one seed, the jobs without summary.json
listed, paired figures over the seeds both arms finished, the verdict's wording, and figure y-limits scaled to
the data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_report_axes import fake_run as axes_run

FIXED_RULES = ("none", "ladder", "dapo", "rti")


def fake_run(d: Path, controller: str, seed: int, beyond: list[float], easy: list[float] | None = None) -> None:
    """A finished run (test_report_axes.fake_run's files); easy levels at 0.5 unless given."""
    axes_run(d, controller, seed, beyond, easy or [0.5] * len(beyond))


def unfinished_run(d: Path, controller: str) -> None:
    """A run killed before its summary: config.json and the first metrics lines only."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"controller": {"name": controller}, "env": {"families": ["calc"]}}))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "groups/zero_variance_share": 0.5}) + "\n")


def ablation_json(root: Path, arms: list[str], seeds: list[int], jobs: dict[str, str], status: str) -> None:
    """ablation.json as `rail ablate` writes it: ``jobs`` maps ``<arm>/seed<k>`` to the job's status."""
    entries = {}
    for key, st in jobs.items():
        arm, seed = key.split("/seed")
        e = {"arm": arm, "seed": int(seed), "dir": str(root / arm / f"seed{seed}"), "attempts": 1, "status": st,
             "action": "start"}
        if st == "failed":
            e.update(returncode=1, error=None, stderr_tail=["RuntimeError: CUDA out of memory"])
        if st == "interrupted":
            e.update(returncode=-2, stderr_tail=[])
        entries[key] = e
    root.mkdir(parents=True, exist_ok=True)
    (root / "ablation.json").write_text(json.dumps({
        "name": "partial", "description": "", "config_file": "experiments/ablations/controllers.toml",
        "preset": "default", "arms": arms, "arm_descriptions": {a: "" for a in arms}, "seeds": seeds,
        "workers": 2, "threads": 1, "backend": "process", "tracking_uri": None, "experiment": "rail",
        "started": 0.0, "finished": None, "status": status, "jobs": entries,
        "failed": sorted(k for k, s in jobs.items() if s == "failed")}))


# per seed 0..4, final success beyond the boundary; rail's curve 0 -> 0.1 -> final
NONE_FINAL = [0.10, 0.12, 0.08, 0.30, 0.30]  # mean 0.18 over all five seeds, 0.10 over seeds 0-2
RAIL_FINAL = [0.20, 0.22, 0.15]  # seeds 0-2 finished; 3 running, 4 not started
LADDER_FINAL = [0.0, 0.9]  # 2 seeds, far apart: 0.45 ± 5.7, far beyond [0, 1]
DAPO_FINAL = [0.05]  # 1 seed
RTI_FINAL = [0.0, 0.0, 0.0, 0.0, 0.5]  # 5 seeds: 0.1 ± 0.28, below 0


@pytest.fixture
def partial(tmp_path) -> Path:
    """Five arms planned on seeds 0-4 (25 jobs), 9 without summary.json: `none` and `rti` on every seed,
    `rail` on 3, `ladder` on 2, `dapo` on 1."""
    root = tmp_path / "partial"
    jobs = {}
    for seed in range(5):
        fake_run(root / "none" / f"seed{seed}", "none", seed, [0.0, 0.05, NONE_FINAL[seed]])
        fake_run(root / "rti" / f"seed{seed}", "rti", seed, [0.0, 0.0, RTI_FINAL[seed]])
        jobs[f"none/seed{seed}"] = jobs[f"rti/seed{seed}"] = "finished"
    for seed, b in enumerate(RAIL_FINAL):
        fake_run(root / "rail" / f"seed{seed}", "rail", seed, [0.0, 0.1, b])
        jobs[f"rail/seed{seed}"] = "finished"
    unfinished_run(root / "rail" / "seed3", "rail")
    jobs.update({"rail/seed3": "running", "rail/seed4": "pending"})
    for seed, b in enumerate(LADDER_FINAL):
        fake_run(root / "ladder" / f"seed{seed}", "ladder", seed, [0.0, b / 2, b])
        jobs[f"ladder/seed{seed}"] = "finished"
    jobs.update({"ladder/seed2": "failed", "ladder/seed3": "interrupted", "ladder/seed4": "pending"})
    fake_run(root / "dapo" / "seed0", "dapo", 0, [0.0, 0.0, DAPO_FINAL[0]])
    jobs["dapo/seed0"] = "finished"
    jobs.update({f"dapo/seed{s}": "pending" for s in (1, 2)})  # seeds 3, 4: planned, never recorded
    ablation_json(root, ["none", "ladder", "dapo", "rti", "rail"], [0, 1, 2, 3, 4], jobs, status="running")
    return root


def _row(md: str, start: str) -> str:
    return next(ln for ln in md.splitlines() if ln.startswith(start))


# ---------------------------------------------------------------------------- intervals
def test_t_interval_is_clipped_and_absent_for_one_seed():
    from scipy import stats

    from rail.lab.report_common import RATE, RATE_DIFF, ci_text, t_interval

    raw = t_interval([0.0, 0.9])  # 0.45 ± t(0.975, 1) x 0.636
    half = stats.t.ppf(0.975, 1) * 0.9 / 2
    assert raw == pytest.approx([0.45 - half, 0.45 + half]) and raw[0] < -5 and raw[1] > 5
    assert t_interval([0.0, 0.9], bounds=RATE) == [0.0, 1.0]
    assert t_interval([-0.9, 0.1], bounds=RATE_DIFF) == [-1.0, 1.0]
    assert t_interval([0.021]) is None and t_interval([]) is None and t_interval([None, float("nan")]) is None
    assert ci_text(None, 1) == "n=1" and ci_text(None, 0) == "–"
    assert ci_text([0.0, 1.0], 2) == "[0.000, 1.000]†" and ci_text([0.1, 0.2], 3) == "[0.100, 0.200]"


def test_rates_and_differences_are_clipped_and_few_seeds_marked(partial):
    from scipy import stats

    from rail.lab.ablation_report import write_report

    with pytest.warns(UserWarning, match="Missing: 9 of 25 jobs"):
        rep = write_report(partial, figures=False)
    arms = rep["arms"]
    assert {a: v["n_seeds"] for a, v in arms.items()} == {"none": 5, "ladder": 2, "dapo": 1, "rti": 5, "rail": 3}
    assert {a: v["few_seeds"] for a, v in arms.items()} == {"none": False, "ladder": True, "dapo": True,
                                                            "rti": False, "rail": False}
    # ladder: 0.45 ± 5.7 over 2 seeds, clipped to [0, 1]; dapo: one seed, no interval
    assert arms["ladder"]["final_beyond"] == pytest.approx(0.45) and arms["ladder"]["final_beyond_ci"] == [0.0, 1.0]
    assert arms["dapo"]["final_beyond_ci"] is None and arms["dapo"]["auc_beyond_ci"] is None
    # rti: 0.1 ± 0.278 over 5 seeds, its lower end clipped at 0, the upper one kept
    half = stats.t.ppf(0.975, 4) * stats.tstd(RTI_FINAL) / 5 ** 0.5
    assert arms["rti"]["final_beyond_ci"] == [0.0, pytest.approx(0.1 + half)] and 0.1 - half < 0
    # every interval of a rate in [0, 1], every curve band too
    for v in arms.values():
        for k in ("final_beyond_ci", "final_easy_ci", "auc_beyond_ci"):
            assert v[k] is None or 0.0 <= v[k][0] <= v[k][1] <= 1.0
        assert all(iv is None or 0.0 <= iv[0] <= iv[1] <= 1.0 for iv in v["curve"]["beyond_ci"])
    # paired differences of rates in [-1, 1]; rail - ladder (0.20 - 0.0, 0.22 - 0.9): -0.24 ± 5.4 over 2 seeds
    d = rep["verdict"]["vs"]["ladder"]
    assert d["final_beyond_diff"] == pytest.approx(-0.24) and d["final_beyond_diff_ci"] == [-1.0, 1.0]
    assert d["n"] == 2 and d["few_seeds"] is True and d["paired_seeds"] == [0, 1]
    assert rep["verdict"]["vs"]["dapo"]["final_beyond_diff_ci"] is None and rep["verdict"]["vs"]["dapo"]["n"] == 1
    js = json.loads((partial / "report.json").read_text())
    assert js["verdict"]["vs"]["ladder"]["few_seeds"] is True and js["verdict"]["vs"]["ladder"]["n"] == 2
    assert js["arms"]["ladder"]["few_seeds"] is True and "_seed_runs" not in js["arms"]["rail"]
    # report.md: the marks and their footnote; "n=1" instead of an interval
    md = (partial / "report.md").read_text()
    assert "[0.000, 1.000]†" in _row(md, "| `ladder` | ladder |")
    assert "| n=1 |" in _row(md, "| `dapo` | dapo |")
    rti = _row(md, "| `rti` | rti |")
    assert f"[0.000, {0.1 + half:.3f}] |" in rti and "†" not in rti
    assert "| `ladder` | -0.240 | [-1.000, 1.000]† |" in md  # the verdict's paired table
    assert "| `dapo` | 0.150 | n=1 |" in md
    assert md.count("† fewer than 3 seeds: interval unreliable.") >= 2
    assert "[0.021, 0.021]" not in md and "[0.050, 0.050]" not in md  # no zero-width interval from one seed


# ---------------------------------------------------------------------------- unfinished ablation
def test_jobs_without_summary_are_listed_with_their_state(partial):
    from rail.lab.ablation_report import write_report

    with pytest.warns(UserWarning):
        rep = write_report(partial, figures=False)
    assert rep["jobs_planned"] == 25 and rep["ablation_status"] == "running"
    assert rep["missing"] == [
        {"arm": "ladder", "seed": 2, "state": "failed"}, {"arm": "ladder", "seed": 3, "state": "interrupted"},
        {"arm": "ladder", "seed": 4, "state": "not started"},
        {"arm": "dapo", "seed": 1, "state": "not started"}, {"arm": "dapo", "seed": 2, "state": "not started"},
        {"arm": "dapo", "seed": 3, "state": "not started"}, {"arm": "dapo", "seed": 4, "state": "not started"},
        {"arm": "rail", "seed": 3, "state": "running"}, {"arm": "rail", "seed": 4, "state": "not started"}]
    # in the ablation's arm order (none, ladder, dapo, rti, rail); none and rti have every seed
    # `failed` keeps the failed and interrupted jobs with their exit code and stderr
    assert [(f["job"], f["status"]) for f in rep["failed"]] == [("ladder/seed2", "failed"),
                                                                ("ladder/seed3", "interrupted")]
    md = (partial / "report.md").read_text()
    top = md.split("## Does `rail` beat")[0]
    assert ("**Missing: 9 of 25 jobs — `ladder` seed 2 failed, seed 3 interrupted, seed 4 not started; "
            "`dapo` seeds 1, 2, 3, 4 not started; `rail` seed 3 running, seed 4 not started.**") in top
    assert "(ablation.json: `running`)" in top
    assert "Over the finished runs only: 9 of 25 planned jobs have no summary.json" in rep["verdict"]["text"]


def test_without_ablation_json_an_unfinished_run_directory_is_missing(tmp_path):
    from rail.lab.ablation_report import write_report

    root = tmp_path / "abl"
    fake_run(root / "none" / "seed0", "none", 0, [0.0, 0.1])
    fake_run(root / "rail" / "seed0", "rail", 0, [0.0, 0.2])
    unfinished_run(root / "rail" / "seed1", "rail")
    with pytest.warns(UserWarning, match="Missing: 1 of 3 jobs"):
        rep = write_report(root, figures=False)
    assert rep["missing"] == [{"arm": "rail", "seed": 1, "state": "no summary.json"}]
    # a finished ablation has nothing missing and says nothing about it
    import shutil
    shutil.rmtree(root / "rail" / "seed1")
    rep = write_report(root, figures=False)
    assert rep["missing"] == [] and "Missing:" not in (root / "report.md").read_text()


# ---------------------------------------------------------------------------- pairing over shared seeds
def test_paired_figures_use_only_the_seeds_both_arms_finished(partial):
    from rail.lab.ablation_report import write_report

    with pytest.warns(UserWarning):
        rep = write_report(partial, figures=False)
    arms = rep["arms"]
    rail, none = arms["rail"], arms["none"]
    # rail - none over seeds 0-2: (0.10 + 0.10 + 0.07) / 3 = 0.09; the means over all finished seeds would give
    # 0.19 - 0.18 = 0.01
    vn = rep["versus_none"]["vs"]["rail"]
    assert vn["paired_seeds"] == [0, 1, 2] and vn["n"] == 3
    assert vn["final_beyond_diff"] == pytest.approx(0.09)
    assert rail["final_beyond"] - none["final_beyond"] == pytest.approx(0.01)
    assert rep["verdict"]["vs"]["none"]["final_beyond_diff"] == pytest.approx(0.09)
    # budget to match none: none's final over seeds 0-2 is 0.10, which rail's curve (0, 0.1, ...) reaches at 32;
    # none's mean over its five seeds (0.18) rail would reach only at its last evaluation, 64
    assert rep["none_final_beyond"] == pytest.approx(0.18)
    assert rail["budget_to_match_none_seeds"] == [0, 1, 2]
    assert rail["budget_to_match_none_beyond_target"] == pytest.approx(0.10)
    assert rail["budget_to_match_none_beyond"] == 32
    assert arms["dapo"]["budget_to_match_none_seeds"] == [0]
    assert arms["dapo"]["budget_to_match_none_beyond_target"] == pytest.approx(0.10)  # none's seed 0
    assert none["budget_to_match_none_seeds"] == [0, 1, 2, 3, 4]
    assert "(0.100, over the 3 seeds it shares with `none`) after 32 budget units" in rep["verdict"]["text"]
    # best fixed rule in hindsight: ladder (mean 0.45 over 2 seeds); rail is paired with it over seeds 0 and 1
    bf = rep["versus_best_fixed"]
    assert bf["best"] == "ladder" and bf["paired_seeds"] == [0, 1] and bf["n"] == 2
    assert bf["final_beyond_diff"] == pytest.approx(-0.24)
    assert "too few seeds in common" in bf["text"] and "fewer than 3 seeds: interval unreliable" in bf["text"]
    # the tables say how many seeds are behind every number
    md = (partial / "report.md").read_text()
    assert "| seeds with none |" in md
    assert "for `ladder`, `dapo`, `rail`, which share fewer seeds with it, the target is `none`'s mean" in md
    row = _row(md, "| `rail` | rail |")
    assert row.startswith("| `rail` | rail | 3 |") and "| 32 | 3 |" in row
    assert _row(md, "| `dapo` | dapo |").startswith("| `dapo` | dapo | 1 |")
    assert "| `rail` | 3 | 0.19 (+0.09) |" in md  # per level, the paired difference from none over seeds 0-2
    assert "| `rail` | 0.090 |" in md and "| 3 |" in _row(md, "| `rail` | 0.090 |")


# ---------------------------------------------------------------------------- the verdict
def _verdict_dir(root: Path, rail: list[float], fixed: dict[str, list[float]]) -> dict:
    from rail.lab.ablation_report import write_report

    for seed, b in enumerate(rail):
        fake_run(root / "rail" / f"seed{seed}", "rail", seed, [0.0, b / 2, b])
    for arm, finals in fixed.items():
        for seed, b in enumerate(finals):
            fake_run(root / arm / f"seed{seed}", arm, seed, [0.0, b / 2, b])
    return write_report(root, figures=False)


def test_verdict_yes_needs_three_paired_seeds_with_the_interval_above_zero(tmp_path):
    rep = _verdict_dir(tmp_path / "yes", [0.30, 0.32, 0.31], {"none": [0.10, 0.11, 0.10], "ladder": [0.2, 0.2, 0.22]})
    v = rep["verdict"]
    assert v["answer"] == "yes" and v["beats_all_ci"] is True and v["text"].startswith("**Yes**")
    assert "every paired 95% interval over 3 seeds above 0" in v["text"]
    # the same numbers on 2 seeds: the means are above everywhere, but two seeds decide nothing
    rep = _verdict_dir(tmp_path / "two", [0.30, 0.32], {"none": [0.10, 0.11], "ladder": [0.2, 0.2]})
    v = rep["verdict"]
    assert v["answer"] == "not enough seeds" and v["beats_all_mean"] is True and v["beats_all_ci"] is False
    assert v["text"].startswith("**Not enough seeds**") and "`ladder` (n=2), `none` (n=2)" in v["text"]
    assert "means alone (no conclusion)" in v["text"]


def test_verdict_no_needs_an_interval_below_zero(tmp_path):
    # rail below ladder on every one of 3 seeds: the paired interval lies below 0
    rep = _verdict_dir(tmp_path / "no", [0.10, 0.12, 0.11], {"none": [0.05, 0.05, 0.06], "ladder": [0.3, 0.32, 0.3]})
    v = rep["verdict"]
    assert v["answer"] == "no" and v["below_ci"] == ["ladder"] and v["text"].startswith("**No**")
    assert "ends below `ladder` (-0.197, 95% CI [" in v["text"] and "over 3 paired seeds" in v["text"]
    # below on the means but on 2 seeds: formerly a "No" from the means alone, now not enough seeds
    rep = _verdict_dir(tmp_path / "no2", [0.10, 0.12], {"none": [0.05, 0.05], "ladder": [0.3, 0.32]})
    v = rep["verdict"]
    assert v["answer"] == "not enough seeds" and not v["text"].startswith("**No**")
    assert "not above `ladder` (0.310, n=2)" in v["text"]
    # versus none: no arm above none with 3 seeds, but some not decided: not enough seeds rather than "No"
    assert rep["versus_none"]["answer"] == "not enough seeds"
    assert rep["versus_none"]["text"].startswith("**Not enough seeds**")


def test_verdict_not_shown_when_three_seeds_straddle_zero(tmp_path):
    rep = _verdict_dir(tmp_path / "ns", [0.10, 0.30, 0.20], {"none": [0.20, 0.10, 0.21], "ladder": [0.1, 0.1, 0.1]})
    v = rep["verdict"]
    assert v["vs"]["none"]["final_beyond_diff_ci"][0] < 0 < v["vs"]["none"]["final_beyond_diff_ci"][1]
    assert v["answer"] == "not shown" and v["text"].startswith("**Not shown**")
    assert "includes 0 against `ladder`, `none`" in v["text"]


def test_partial_ablation_verdict_is_not_enough_seeds(partial):
    from rail.lab.ablation_report import write_report

    with pytest.warns(UserWarning):
        rep = write_report(partial, figures=False)
    v = rep["verdict"]
    assert v["answer"] == "not enough seeds" and v["few_seeds"] == ["ladder", "dapo"]
    assert "`ladder` (n=2), `dapo` (n=1)" in v["text"]


# ---------------------------------------------------------------------------- figures
def test_figure_y_limits_follow_the_data_not_the_intervals(partial, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from rail.lab.ablation_report import write_report
    from rail.lab.report_figures import PAD, bar_ylim, curve_ylim, rate_ylim

    limits: dict[str, list[tuple[float, float]]] = {}
    save = Figure.savefig

    def record(fig, fname, *a, **k):
        limits[Path(fname).name] = [ax.get_ylim() for ax in fig.axes if ax.get_visible() and ax.axison]
        return save(fig, fname, *a, **k)
    monkeypatch.setattr(Figure, "savefig", record)
    with pytest.warns(UserWarning):
        rep = write_report(partial)
    beyond, easy = limits["learning_curves.png"]
    # means up to 0.45 (ladder's, 2 seeds: its band [0, 1] neither drawn nor scaling the axis); rti's band
    # (5 seeds) up to 0.378
    assert beyond == pytest.approx(curve_ylim(rep, "beyond"))
    assert -PAD <= beyond[0] <= 0.0 and 0.45 < beyond[1] < 0.55
    assert easy == pytest.approx(curve_ylim(rep, "easy")) and easy[1] - easy[0] < 0.2  # every easy rate 0.5
    assert easy[0] < 0.5 < easy[1]
    (bars,) = limits["final_beyond.png"]
    assert bars == pytest.approx(bar_ylim(rep)) and bars[0] == 0.0 and 0.45 < bars[1] < 0.55
    # rates stay within [0, 1] with a small margin, whatever is given
    assert rate_ylim([-3.0, 0.2, 6.0]) == (-PAD, 1 + PAD)
    lo, hi = rate_ylim([0.0, 0.01, 0.02])
    assert lo == -PAD and 0.03 < hi < 0.1  # near-zero rates are not flattened against a [0, 1] axis
    assert rate_ylim([], floor_zero=True)[0] == 0.0


def test_low_rates_with_two_seeds_are_not_flattened(tmp_path, monkeypatch):
    """The case of a 2-seed arm whose interval would reach 6: the axis follows the means (about 0.02)."""
    from rail.lab.ablation_report import write_report
    from rail.lab.report_figures import bar_ylim, curve_ylim

    root = tmp_path / "low"
    for seed, (n, r) in enumerate([(0.0, 0.021), (0.02, 0.0)]):
        fake_run(root / "none" / f"seed{seed}", "none", seed, [0.0, n / 2, n])
        fake_run(root / "rail" / f"seed{seed}", "rail", seed, [0.0, r / 2, r])
    rep = write_report(root)
    assert rep["arms"]["rail"]["final_beyond_ci"][1] == pytest.approx(0.021 / 2 + 12.706 * 0.021 / 2, rel=1e-3)
    for lo, hi in (curve_ylim(rep, "beyond"), bar_ylim(rep)):
        assert lo <= 0.0 and 0.021 < hi < 0.1
    md = (root / "report.md").read_text()
    assert "† fewer than 3 seeds: interval unreliable." in md
