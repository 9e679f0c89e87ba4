"""The markdown of ``rail report`` (``report.md``): the verdict, the tables per arm, per cell and after a
task-mix shift. Every field is defined in docs/ablation.md."""

from __future__ import annotations

import math

import numpy as np

from rail.lab.report_common import (
    FEW_SEEDS_NOTE,
    SHIFT_FIELDS,
    cell_order,
    ci_text,
    mean,
    missing_text,
)


def _f(v, nd: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and not math.isfinite(v):
        return "–"
    return f"{v:.{nd}f}"


def format_markdown(rep: dict) -> str:
    arms, order = rep["arms"], rep["arms_order"]
    L = [f"# Ablation `{rep.get('ablation')}`", ""]
    if rep.get("description"):
        L += [rep["description"], ""]
    seeds = rep["seeds"]
    L += [f"Preset `{rep.get('preset')}`, seeds {seeds}, {len(order)} arms with results"
          + (f" (from `{rep['config_file']}`)" if rep.get("config_file") else "") + ". Every arm gets the same "
          "budget per step and, per seed, the same task streams; only controller and learner settings differ. "
          f"Levels: easy {rep['levels'].get('easy')}, beyond the boundary {rep['levels'].get('beyond')} "
          f"({rep.get('eval_tasks_beyond')} held-out tasks per evaluation beyond, {rep.get('eval_tasks_easy')} easy). "
          "Field definitions: docs/ablation.md.", ""]
    if rep.get("missing"):
        L += [f"**{missing_text(rep)}.** These jobs have no summary.json"
              + (f" (ablation.json: `{rep['ablation_status']}`)" if rep.get("ablation_status") else "")
              + ": every figure below is over the finished runs only, every paired one over the seeds both arms "
              "finished (the `seeds` columns).", ""]
    L += ["## Does `rail` beat the fixed heuristics beyond the boundary?", "", rep["verdict"]["text"], ""]
    vs = rep["verdict"].get("vs", {})
    if vs:
        L += [(f"Paired differences `{rep['verdict']['learned']}` − arm over the seeds both finished (95% t-interval, "
              "clipped to [−1, 1]):"), "",
              "| arm | Δ final beyond | 95% CI | Δ AUC beyond | 95% CI | seeds |", "|---|---|---|---|---|---|"]
        for f in [a for a in rep["arms_order"] if a in vs]:  # report order, also when read back from report.json
            d, n = vs[f], _n(vs[f])
            L.append(f"| `{f}` | {_f(d['final_beyond_diff'])} | {ci_text(d['final_beyond_diff_ci'], n)} | "
                     f"{_f(d['auc_beyond_diff'])} | {ci_text(d['auc_beyond_diff_ci'], n)} | {n} |")
        L += _note(L)
    bf = rep.get("versus_best_fixed")
    if bf:
        d = bf
        L += ["## Against the best fixed rule in hindsight", "", bf["text"], "",
              (f"Paired differences `{bf['learned']}` − `{bf['best']}` over the seeds both finished (95% t-interval, "
              "clipped to [−1, 1]):"), "",
              "| Δ final beyond | 95% CI | Δ AUC beyond | 95% CI | Δ final easy | 95% CI | seeds |",
              "|---|---|---|---|---|---|---|",
              (f"| {_f(d['final_beyond_diff'])} | {ci_text(d['final_beyond_diff_ci'], _n(d))} | {_f(d['auc_beyond_diff'])} | "
              f"{ci_text(d['auc_beyond_diff_ci'], _n(d))} | {_f(d['final_easy_diff'])} | "
              f"{ci_text(d['final_easy_diff_ci'], _n(d))} | {_n(d)} |")]
        L += _note(L)
    vn = rep.get("versus_none")
    if vn:
        L += ["## Does any arm end higher than plain GRPO (`none`) beyond the boundary?", "", vn["text"], ""]
        if vn["vs"]:
            L += ["Paired differences arm − `none` over the seeds both finished (95% t-interval, clipped to [−1, 1]):", "",
                  "| arm | Δ final beyond | 95% CI | Δ final easy | 95% CI | seeds |", "|---|---|---|---|---|---|"]
            for a in [a for a in rep["arms_order"] if a in vn["vs"]]:
                d, n = vn["vs"][a], _n(vn["vs"][a])
                L.append(f"| `{a}` | {_f(d['final_beyond_diff'])} | {ci_text(d['final_beyond_diff_ci'], n)} | "
                         f"{_f(d['final_easy_diff'])} | {ci_text(d['final_easy_diff_ci'], n)} | {n} |")
            L += _note(L)
    vl = rep.get("versus_learned")
    if vl:
        L += ["## The learned controller over other action spaces", "", vl["text"], "",
              (f"Paired differences arm − `{vl['learned']}` over the seeds both finished (95% t-interval, clipped to "
              "[−1, 1]):"), "",
              "| arm | Δ final beyond | 95% CI | Δ AUC beyond | 95% CI | Δ final easy | 95% CI | seeds |",
              "|---|---|---|---|---|---|---|---|"]
        for a in [a for a in rep["arms_order"] if a in vl["vs"]]:
            d, n = vl["vs"][a], _n(vl["vs"][a])
            L.append(f"| `{a}` | {_f(d['final_beyond_diff'])} | {ci_text(d['final_beyond_diff_ci'], n)} | "
                     f"{_f(d['auc_beyond_diff'])} | {ci_text(d['auc_beyond_diff_ci'], n)} | "
                     f"{_f(d['final_easy_diff'])} | {ci_text(d['final_easy_diff_ci'], n)} | {n} |")
        L += _note(L)
    L += ["## Results per arm (means over seeds)", "",
          ("`seeds`: the seeds behind each mean; `seeds with none`: those the budget-to-match columns pair with "
          "`none`'s (its final success over the same seeds is the target)."), "",
          ("| arm | controller | seeds | final easy | final beyond | 95% CI | AUC beyond | budget to match none (easy) "
          "| budget to match none (beyond) | seeds with none | zero-var share | acceptance | interv. share "
          "| rollouts/decision | wall s | ctl overhead |"),
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in order:
        v = arms[a]
        has_none = rep.get("none_final_easy") is not None
        match = ("–" if not has_none else "never" if v["budget_to_match_none"] is None
                 else f"{v['budget_to_match_none']:.0f}")
        beyond = v.get("budget_to_match_none_beyond")
        match_b = "–" if not has_none else "never" if beyond is None else f"{beyond:.0f}"
        with_none = len(v.get("budget_to_match_none_seeds") or []) if has_none else "–"
        L.append(f"| `{a}` | {v['controller']} | {v['n_seeds']} | {_f(v['final_easy'])} | {_f(v['final_beyond'])} | "
                 f"{ci_text(v['final_beyond_ci'], v['n_seeds'])} | {_f(v['auc_beyond'])} | {match} | {match_b} | "
                 f"{with_none} | {_f(v['zero_variance_share'])} | {_f(v['acceptance'])} | "
                 f"{_f(v['intervention_budget_share'])} | {_f(v['rollouts_per_decision'], 2)} | "
                 f"{_f(v['wall_seconds'], 0)} | {_f(v['controller_overhead'], 4)} |")
    L += _note(L)[:-1]
    b = rep["budget"]
    spent = sorted({round(x) for x in b["per_arm"].values() if x is not None})
    L += ["", f"Budget spent per run: {', '.join(map(str, spent))} "
              f"({'the same for every arm' if b['equal'] else 'NOT the same for every arm'}). "
              + (f"`none`'s final easy success, the target of 'budget to match none (easy)': {rep['none_final_easy']:.3f}"
                 + (f"; its final success beyond the boundary, the target of 'budget to match none (beyond)': "
                    f"{rep['none_final_beyond']:.3f}." if _finite(rep.get("none_final_beyond")) else ".")
                 + _fewer_with_none(rep)
                 if rep.get("none_final_easy") is not None else "No `none` arm: 'budget to match none' is empty."), ""]
    cells = list(dict.fromkeys(c for a in order for c in arms[a].get("final_beyond_cells", {})))
    if cells:
        L += ["## Final success beyond the boundary per family and level (means over seeds)", "",
              "Where a difference comes from: each level beyond the boundary on its own (per-seed values in "
              "report.json)" + (", with the paired mean difference from `none`" if "none" in arms else "") + ".", "",
              *_arm_table(order, cells, lambda a, c: _beyond_cell(arms, a, c), arms), ""]
    L += ["## What the controllers chose", "",
          "| arm | seeds | how@where: decisions (rollouts), summed over training, mean over seeds |", "|---|---|---|"]
    for a in order:
        ch = arms[a]["choices"]
        if ch:
            L.append(f"| `{a}` | {arms[a]['n_seeds']} | " + ", ".join(f"{k}: {c['decisions']:.0f} ({c['rollouts']:.0f})"
                                              for k, c in sorted(ch.items(), key=lambda kv: -kv[1]['rollouts'])) + " |")
        else:
            L.append(f"| `{a}` | {arms[a]['n_seeds']} | no interventions |")
    L.append("")
    L += _markdown_by_cell(rep)
    L += _markdown_shift(rep)
    if rep["failed"]:
        L += ["## Failed jobs", "", "| job | status | exit code | last stderr lines |", "|---|---|---|---|"]
        for f in rep["failed"]:
            tail = "<br>".join(_md_escape(x) for x in (f["stderr_tail"] or [f.get("error") or ""])[-5:])
            L.append(f"| `{f['job']}` | {f['status']} | {f['returncode']} | {tail} |")
        L.append("")
    L += ["## Figures", ""]
    for name, what in (("learning_curves.png", "held-out success against budget spent"),
                       ("final_beyond.png", "final success beyond the boundary per arm"),
                       ("choices.png", "intervention rollouts per step by how@where"),
                       ("how_many.png", "rollouts per decision and intervention budget share per step"),
                       ("choices_by_level.png", ("share of groups intervened and the operator chosen most, per family "
                                                "and level over training"))):
        if name in rep.get("figures", []):
            L += [f"![{what}]({name})", ""]
    return "\n".join(L)


def _markdown_by_cell(rep: dict) -> list[str]:
    arms, order = rep["arms"], rep["arms_order"]
    cells = cell_order(c for a in order for c in arms[a].get("choices_by_cell", {}))
    if not cells:
        return []
    L = ["## What the controllers chose per family and level", "",
         ("Share of the cell's groups intervened over training (pooled over steps and seeds) and the how@where chosen "
         "most there; over time in `choices_by_level.png`."), ""]

    def chosen(a: str, c: str) -> str:
        v = arms[a].get("choices_by_cell", {}).get(c)
        if not v or v["intervened_share"] is None:
            return "–"
        return f"{v['intervened_share']:.2f}" + (f" {v['dominant']}" if v["dominant"] else "")
    return L + _arm_table(order, cells, chosen, arms) + [""]


def _arm_table(order: list[str], cells: list[str], text, arms: dict) -> list[str]:
    """A table with a row per arm, its number of seeds and a column per cell, ``text(arm, cell)`` in each."""
    return (["| arm | seeds | " + " | ".join(cells) + " |", "|---|---|" + "---|" * len(cells)]
            + [f"| `{a}` | {arms[a]['n_seeds']} | " + " | ".join(text(a, c) for c in cells) + " |" for a in order])


def _n(d: dict) -> int:
    """The seeds behind a paired comparison (``n``; read from ``paired_seeds`` in a report.json without it)."""
    return d["n"] if "n" in d else len(d.get("paired_seeds") or [])


def _fewer_with_none(rep: dict) -> str:
    """What the budget-to-match columns compare with for an arm that finished fewer seeds than ``none``."""
    arms = rep["arms"]
    n = arms["none"]["n_seeds"] if "none" in arms else None
    fewer = [a for a in rep["arms_order"] if n is not None and len(arms[a].get("budget_to_match_none_seeds") or []) < n]
    if not fewer:
        return ""
    return (f" Those are `none`'s means over its {n} seeds; for " + ", ".join(f"`{a}`" for a in fewer)
            + ", which share fewer seeds with it, the target is `none`'s mean over the shared seeds (`seeds with none`).")


def _note(lines: list[str]) -> list[str]:
    """The footnote of the table just written, when an interval in it is marked ``†``; and a blank line."""
    table = []
    for ln in reversed(lines):
        if not ln.startswith("|"):
            break
        table.append(ln)
    return (["", FEW_SEEDS_NOTE] if any("†" in ln for ln in table) else []) + [""]


def _beyond_cell(arms: dict, a: str, c: str) -> str:
    """Arm ``a``'s final success beyond the boundary in cell ``c``, with its paired mean difference from ``none``."""
    x = arms[a].get("final_beyond_cells", {}).get(c)
    d = None
    if "none" in arms and a != "none" and x is not None:
        common = [sd for sd in arms[a]["seeds"] if sd in arms["none"]["seeds"]]
        diffs = [arms[a]["per_seed"][str(sd)].get("final_beyond_cells", {}).get(c, float("nan"))
                 - arms["none"]["per_seed"][str(sd)].get("final_beyond_cells", {}).get(c, float("nan"))
                 for sd in common]
        d = mean(diffs) if diffs else None
    return _f(x, 2) + (f" ({d:+.2f})" if d is not None and np.isfinite(d) else "")


def _markdown_shift(rep: dict) -> list[str]:
    sh, arms, order = rep.get("shift"), rep["arms"], rep["arms_order"]
    if sh is None:
        return []
    adv = rep.get("after_shift") or {}
    L = [f"## After the task-mix shift at step {sh['step']}", "", adv.get("text", ""), "",
         (f"Steps to follow: steps after the shift until the controller's choice distribution on the new mix stays "
         f"within {sh['tolerance']} (total variation) of its own steady state ({sh['steady_state']}), each step's "
         f"distribution pooled over {sh['window']}; mean over the seeds that settled, \"never\" counting the others "
         "(docs/metrics.md, Adaptivity)."), ""]
    ref = adv.get("reference")
    head = ("| arm | seeds | steps to follow | never (seeds) | success at the shift | final on the mix | 95% CI | AUC after "
            "| 95% CI |")
    if ref:
        head += (f" Δ final − `{ref}` | 95% CI | Δ AUC − `{ref}` | 95% CI | Δ steps − `{ref}` | 95% CI | "
                 "paired seeds |")
    L += [head, "|" + "---|" * (head.count("|") - 1)]
    for a in order:
        v = arms[a]
        row = (f"| `{a}` | {v['n_seeds']} | {_f(v['steps_to_follow'], 1)} | {v['steps_to_follow_never']} | "
               f"{_f(v['shift_initial'])} | {_f(v['shift_final'])} | {ci_text(v['shift_final_ci'], v.get('shift_final_n'))} | "
               f"{_f(v['shift_auc'])} | {ci_text(v['shift_auc_ci'], v.get('shift_auc_n'))} |")
        if ref:
            d = adv["vs"].get(a)
            if d is None:
                row += " – | – | – | – | – | – | – |"
            else:
                ns = [d.get(f"{f}_n", len(d.get(f"{f}_paired_seeds") or [])) for f in SHIFT_FIELDS]
                row += "".join(f" {_f(d[f'{f}_diff'], 1 if f == 'steps_to_follow' else 3)} | "
                               f"{ci_text(d[f'{f}_diff_ci'], n, nd=1 if f == 'steps_to_follow' else 3)} |"
                               for f, n in zip(SHIFT_FIELDS, ns))
                row += f" {'/'.join(map(str, sorted(set(ns))))} |"
        L.append(row)
    return L + _note(L)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("<", "&lt;")
