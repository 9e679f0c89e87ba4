"""Readable end-of-run summaries (plain text tables, no extra dependency)."""

from __future__ import annotations

from pathlib import Path

#: the summary's time line, in words (rail.train.TIMINGS)
TIME_LABELS = {"generate": "base generation", "rounds": "rounds' generation", "score": "scoring",
               "controller": "controller", "update": "update", "eval": "evaluation"}


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def format_eval(result: dict[str, dict[str, float]], initial: dict | None = None) -> str:
    levels = sorted({int(lv) for rates in result.values() for lv in rates})
    rows = []
    for fam in sorted(result):
        row = [fam]
        for lv in levels:
            v = result[fam].get(str(lv))
            if v is None:
                row.append("")
            elif initial is not None:
                row.append(f"{initial[fam][str(lv)]:.2f}->{v:.2f}")
            else:
                row.append(f"{v:.2f}")
        rows.append(row)
    return _table(rows, ["family", *[f"L{lv}" for lv in levels]])


def format_summary(s: dict, out: Path) -> str:
    b, e = s["budget"], s["eval"]
    sp = b["spent"]
    lines = [
        "",
        f"run {s['name']}  controller={s['controller']}  steps={s['steps']}  wall={s['wall_seconds']:.0f}s  "
        f"model={s['model']['parameters'] / 1e6:.2f}M params",
        f"budget: {sp['total']} {b['unit']} spent ({sp['base']} base, {sp['intervention']} intervention), "
        f"{b['per_step']} per step",
        "",
        "held-out unguided success, start -> end:",
        format_eval(e["final"], e["initial"]),
        "",
        *_overall(e),
        f"easy levels {e['easy_levels']}: {e['easy_initial']:.3f} -> {e['easy_final']:.3f}   "
        f"beyond {e['beyond_levels']}: {e['beyond_initial']:.3f} -> {e['beyond_final']:.3f}",
        *_tool_calls(s.get("tool_calls")),
        *_errors(s.get("errors"), s.get("tracking")),
        *_interventions(s.get("interventions")),
        *_controller(s.get("controller_state")),
        *_learned(s.get("choices"), e, s["steps"], learns=s["controller"] == "rail"),
        *_warm_start(s["model"].get("warmstart_check"), e["easy_levels"]),
        "boundary (levels beyond reach at the start: unguided success below 0.05): "
        + ", ".join(f"{f}: {v['beyond_reach_at_start']}" for f, v in s["boundary"].items()),
        "time (s): " + ", ".join(f"{TIME_LABELS.get(k, k)} {v:.1f}" for k, v in s["time"].items()),
        f"outputs: {out}/summary.json, metrics.jsonl, checkpoints/",
    ]
    return "\n".join(lines)


def _warm_start(check: dict | None, levels: list[int]) -> list[str]:
    if not check or check.get("success") is None:
        return []
    return [f"warm start: {check['updates']} updates, unguided success on levels {levels} {check['success']:.3f} "
            f"(target {check['target']})"]


def _overall(e: dict) -> list[str]:
    """Each row's success over all its held-out tasks, for rows whose cells hold different numbers of tasks (a
    finite pool, e.g. bfcl's categories), where the table's cells alone do not give it."""
    counts, fin = e.get("tasks") or {}, e.get("overall_final") or {}
    rows = [r for r in sorted(fin) if len(set(counts.get(r, {}).values())) > 1]
    if not rows:
        return []
    ini = e.get("overall_initial") or {}
    return ["all levels: " + ", ".join(f"{r} {ini.get(r, float('nan')):.2f}->{fin[r]:.2f} "
                                       f"({sum(counts[r].values())} tasks)" for r in rows)]


def _tool_calls(tc: dict | None) -> list[str]:
    if not tc:
        return []
    # ``calls`` counts every turn that was meant as a call, the malformed ones (never executed) included
    calls, failed, malformed = tc.get("calls", 0), tc.get("failed", 0), tc.get("malformed", 0)
    errors = max(0, failed - malformed)
    return [f"tool calls in training rollouts: {calls - malformed} executed ({errors} of them returned a tool error), "
            f"{malformed} malformed (not a call of a listed tool in the model's tool format)"]


def _errors(errors: dict | None, tracking: dict | None) -> list[str]:
    """What went wrong without stopping the run: broken verdicts, failing tools, tracking switched off."""
    out = []
    if errors and (errors.get("reward") or errors.get("tool")):
        out.append(f"errors: {errors.get('reward', 0)} trajectories got reward 0 because the verifier failed, "
                   f"{errors.get('tool', 0)} tool calls failed inside the tool (errors/reward, errors/tool)")
    if tracking and tracking.get("status") == "failed":
        out.append(f"tracking FAILED: MLflow at {tracking['uri']} was switched off ({tracking['error']}); "
                   "metrics.jsonl and summary.json hold everything")
    return out


def _interventions(iv: dict | None) -> list[str]:
    if not iv or not iv.get("by_operator"):
        return []
    rows = [[key, str(d["decisions"]), str(d["rollouts"]), f"{d['success_rate']:.2f}",
             f"{d['accepted_share']:.2f}", str(d["rescued"])] for key, d in iv["by_operator"].items()]
    return ["",
            f"interventions: {iv['budget_share']:.1%} of the budget, {iv['rollouts']} rollouts, success "
            f"{iv['success_rate']:.2f}, accepted by the shift filter {iv['acceptance_rate']:.2f}, "
            f"rescued {iv['rescued_groups']} zero-variance groups (rescue rate {iv['rescue_rate']:.2f})",
            _table(rows, ["operator", "decisions", "rollouts", "success", "accepted", "rescued"]), ""]


def _controller(c: dict | None) -> list[str]:
    if not c or "mode" not in c:
        return []
    moves = ", ".join(f"{t['from']}->{t['to']} at decision {t['event']} (DR diff {t['diff']:+.3f}, "
                      f"bound [{t['diff_lower']:+.3f}, {t['diff_upper']:+.3f}])" for t in c["transitions"]) or "none"
    reused = c.get("reused")
    return [f"learned controller: {c['events']} decisions, final mode {c['mode']}; transitions: {moves}",
            *([f"  started from {reused['trace']} ({reused['events']} decisions replayed; it started {reused['mode']})"]
              if reused else []),
            f"  trace: {c['trace']}  (rail traces evaluate {c['trace']})"]


def learned(choices: dict | None, steps: int) -> list[dict]:
    """What the controller did per family and level over the run, from ``summary.json`` ``choices``: the share of
    the cell's groups it intervened on in the first and in the last quarter of its steps, its most used help (key,
    share of the cell's decisions, mean rollouts per decision), and the step after which it no longer intervened
    there (None while it still did in the last tenth of the run). Cells it never intervened on are left out."""
    out = []
    for cell, c in sorted((choices or {}).items(), key=lambda kv: (kv[0].split(" L")[0], int(kv[0].split(" L")[1]))):
        decisions = sum(d for d, _ in c["help"].values())
        if not decisions:
            continue
        by_step = sorted((int(k), g, i) for k, (g, i) in c["steps"].items())
        q = max(1, steps // 4)
        first = [(g, i) for st, g, i in by_step if st <= q]
        last = [(g, i) for st, g, i in by_step if st > steps - q]
        share = lambda rows: sum(i for _, i in rows) / sum(g for g, _ in rows) if rows and sum(g for g, _ in rows) else None
        key, (d, r) = max(c["help"].items(), key=lambda kv: (kv[1][0], kv[0]))
        last_on = max((st for st, _, i in by_step if i), default=None)
        seen_after = any(st > (last_on or 0) for st, _, _ in by_step)
        stopped = last_on if last_on is not None and seen_after and last_on <= steps - max(1, steps // 10) else None
        out.append({"cell": cell, "decisions": decisions, "first": share(first), "last": share(last), "help": key,
                    "help_share": d / decisions, "rollouts_each": r / d if d else 0.0, "stopped_after": stopped})
    return out


def _learned(choices: dict | None, e: dict, steps: int, learns: bool = True) -> list[str]:
    rows = learned(choices, steps)
    if not rows:
        return []
    f = lambda v: "-" if v is None else f"{v:.2f}"

    def success(cell: str) -> str:
        fam, lv = cell.split(" L")
        a, b = (e.get("initial") or {}).get(fam, {}).get(lv), (e.get("final") or {}).get(fam, {}).get(lv)
        return "" if a is None or b is None else f"{a:.2f}->{b:.2f}"

    table = [[r["cell"], f"{f(r['first'])}->{f(r['last'])}", f"{r['help']} ({r['help_share']:.0%} of "
              f"{r['decisions']}, {r['rollouts_each']:.1f} rollouts each)",
              "still helping" if r["stopped_after"] is None else f"stopped after step {r['stopped_after']}",
              success(r["cell"])] for r in rows]
    return ["", f"what the controller {'learned' if learns else 'did'} (groups it intervened on, first -> last "
            "quarter of the run; its most used help; unguided success):",
            _table(table, ["family/level", "intervened", "most used help", "", "success"]), ""]


def format_interventions(interventions: dict | None, controller_state: dict | None) -> str:
    """The interventions table and the learned controller's line, as ``rail train`` prints them (the TRL adapter's
    summary too)."""
    return "\n".join([*_interventions(interventions), *_controller(controller_state)])
