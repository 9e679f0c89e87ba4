"""The figures of ``rail report`` (matplotlib, Agg backend): learning curves, final success beyond the boundary,
the controllers' choices over training and per level, and how many rollouts each decision spent."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from rail.lab import adaptivity
from rail.lab.report_common import MIN_SEEDS, cell_order, mean, smooth

#: The margin around rates on a figure's y-axis, and the least span it shows.
PAD, MIN_SPAN = 0.02, 0.05


def rate_ylim(values, floor_zero: bool = False) -> tuple[float, float]:
    """Y-limits for rates: around ``values`` (means and intervals, each clipped to [0, 1]) with a small margin,
    never beyond [−PAD, 1 + PAD] and at least MIN_SPAN tall; from 0 with ``floor_zero`` (bars)."""
    v = [min(max(float(x), 0.0), 1.0) for x in values if x is not None and math.isfinite(x)]
    if not v:
        return (0.0 if floor_zero else -PAD), MIN_SPAN
    lo, hi = min(v), max(v)
    margin = max(PAD, 0.08 * (hi - lo))
    bottom = 0.0 if floor_zero else max(-PAD, lo - margin)
    top = min(1.0 + PAD, max(hi + margin, bottom + MIN_SPAN))
    return min(bottom, top - MIN_SPAN), top


def _shown(arm: dict) -> bool:
    """Whether an arm's intervals are drawn and scale an axis: from MIN_SEEDS seeds on."""
    return arm["n_seeds"] >= MIN_SEEDS


def curve_ylim(rep: dict, k: str) -> tuple[float, float]:
    """learning_curves.png's y-limits for ``k`` (``beyond``, ``easy``): the seed means of every arm and the
    (clipped) bands of the arms with at least MIN_SEEDS seeds."""
    arms = rep["arms"]
    vals = [v for a in rep["arms_order"] for v in arms[a]["curve"][k]]
    vals += [b for a in rep["arms_order"] if _shown(arms[a]) for iv in arms[a]["curve"][f"{k}_ci"] if iv for b in iv]
    return rate_ylim(vals)


def bar_ylim(rep: dict) -> tuple[float, float]:
    """final_beyond.png's y-limits: from 0 to above the means, the initial level and the (clipped) intervals
    of the arms with at least MIN_SEEDS seeds."""
    arms = rep["arms"]
    vals = [arms[a]["final_beyond"] for a in rep["arms_order"]]
    vals += [mean(arms[a]["initial_beyond"] for a in rep["arms_order"])]
    vals += [b for a in rep["arms_order"] if _shown(arms[a]) and arms[a]["final_beyond_ci"]
             for b in arms[a]["final_beyond_ci"]]
    return rate_ylim(vals, floor_zero=True)


def _label(arm: str, v: dict) -> str:
    """An arm's name on a figure, ``†`` and its number of seeds when that is under MIN_SEEDS."""
    return arm if _shown(v) else f"{arm} (n={v['n_seeds']}†)"


def _by_operator(series: dict[str, Any]) -> dict[str, np.ndarray]:
    """Per-key series summed per operator (:func:`rail.lab.adaptivity.operator`): the figures colour operators,
    whatever the temperature."""
    out: dict[str, np.ndarray] = {}
    for k, v in series.items():
        op = adaptivity.operator(k)
        out[op] = out.get(op, 0) + np.asarray(v, dtype=float)
    return out


def _colors(names: list[str]) -> dict[str, Any]:
    import matplotlib

    # distinct hues first (tab10, then Dark2, then Set3), never two shades of one hue side by side (the choice maps
    # show a share as lightness); no greys: the choice maps draw "no group of the cell" in grey
    cmaps = [matplotlib.colormaps[m] for m in ("tab10", "Dark2", "Set3")]
    palette = [c for cm in cmaps for c in (cm(i) for i in range(cm.N)) if max(c[:3]) - min(c[:3]) > 0.05]
    return {a: palette[i % len(palette)] for i, a in enumerate(names)}


def draw_figures(rep: dict, root: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    arms, order = rep["arms"], rep["arms_order"]
    col = _colors(order)
    written = []
    levels = rep.get("levels", {})
    n_seeds = max((arms[a]["n_seeds"] for a in order), default=0)

    # learning curves: beyond and easy held-out success against budget spent
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharex=True)
    for ax, k, title in ((axes[0], "beyond", f"beyond the boundary (levels {levels.get('beyond')})"),
                         (axes[1], "easy", f"easy levels {levels.get('easy')}")):
        for a in order:
            c = arms[a]["curve"]
            x = np.array(c["budget_spent"], dtype=float)
            y = np.array([np.nan if v is None else v for v in c[k]], dtype=float)
            ax.plot(x, y, marker="o", ms=3, lw=2 if a == "rail" else 1.3, color=col[a], label=_label(a, arms[a]))
            ci = c[f"{k}_ci"]
            if _shown(arms[a]) and ci and all(ci):
                ax.fill_between(x, [v[0] for v in ci], [v[1] for v in ci], color=col[a], alpha=0.12, lw=0)
        ax.set_ylim(*curve_ylim(rep, k))
        ax.set_title(f"held-out unguided success, {title}")
        ax.set_xlabel(f"budget spent ({_unit(rep)})")
        ax.set_ylabel("success (pass@1)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, ncol=2, loc="best")
    band = (f"mean over seeds, 95% t-band from {MIN_SEEDS} seeds on; † fewer seeds, no band" if n_seeds >= MIN_SEEDS
            else f"mean over seeds; † fewer than {MIN_SEEDS} seeds: no band")
    fig.suptitle(f"ablation {rep.get('ablation')}: learning curves ({band})")
    fig.tight_layout()
    fig.savefig(root / "learning_curves.png", dpi=110)
    plt.close(fig)
    written.append("learning_curves.png")

    # final beyond success per arm with its interval
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(order) + 2), 4))
    means = [np.nan if arms[a]["final_beyond"] is None else arms[a]["final_beyond"] for a in order]
    ax.bar(range(len(order)), means, color=[col[a] for a in order])
    shown = [i for i, a in enumerate(order) if _shown(arms[a]) and arms[a]["final_beyond_ci"] and np.isfinite(means[i])]
    if shown:  # intervals from MIN_SEEDS seeds on (clipped to [0, 1])
        cis = [arms[order[i]]["final_beyond_ci"] for i in shown]
        ax.errorbar(shown, [means[i] for i in shown], fmt="none", ecolor="k", capsize=4,
                    yerr=[[max(means[i] - c[0], 0.0) for i, c in zip(shown, cis)],
                          [max(c[1] - means[i], 0.0) for i, c in zip(shown, cis)]])
    init = mean(arms[a]["initial_beyond"] for a in order)
    if init is not None:
        ax.axhline(init, color="k", lw=1, ls="--", label=f"initial ({init:.3f})")
        ax.legend(fontsize=8)
    ax.set_ylim(*bar_ylim(rep))
    ax.set_xticks(range(len(order)), [_label(a, arms[a]) for a in order], rotation=30, ha="right")
    ax.set_ylabel("final success beyond the boundary")
    ax.set_title(f"final held-out success beyond the boundary\n(mean over seeds; 95% interval from {MIN_SEEDS} seeds "
                 "on, † fewer seeds: none)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(root / "final_beyond.png", dpi=110)
    plt.close(fig)
    written.append("final_beyond.png")

    # the controller's choices: intervention rollouts per step, stacked by how@where (temperatures summed: one
    # colour per operator, so the colours stay distinct; the tables keep every temperature apart)
    active = [a for a in order if arms[a]["_choices_series"]["by_key"]]
    per_arm = {a: _by_operator({k: v["rollouts"] for k, v in arms[a]["_choices_series"]["by_key"].items()})
               for a in active}
    use: dict[str, float] = {}  # the most used operators get the first, most distinct colours
    for ops in per_arm.values():
        for op, y in ops.items():
            use[op] = use.get(op, 0.0) + float(y.sum())
    kcol = _colors(sorted(use, key=lambda k: (-use[k], k)))
    keys = sorted(use)
    if active:
        ncols = min(3, len(active))
        nrows = math.ceil(len(active) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.4 * nrows), squeeze=False, sharey=True)
        for i, a in enumerate(active):
            ax = axes[i // ncols][i % ncols]
            ch = arms[a]["_choices_series"]
            x = np.array(ch["step"])
            w = max(1, len(x) // 15)
            per_op = per_arm[a]
            ks = [k for k in keys if k in per_op]
            ys = [smooth(per_op[k], w) for k in ks]
            ax.stackplot(x, *ys, labels=ks, colors=[kcol[k] for k in ks], alpha=0.85)
            ax.set_title(a)
            ax.set_xlabel("training step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if i % ncols == 0:
                ax.set_ylabel("intervention rollouts / step")
            ax.grid(alpha=0.3)
        for j in range(len(active), nrows * ncols):
            axes[j // ncols][j % ncols].axis("off")
        handles = [plt.Rectangle((0, 0), 1, 1, color=kcol[k]) for k in keys]
        fig.legend(handles, keys, loc="lower center", ncol=min(5, len(keys)), fontsize=8)
        fig.suptitle("where and how the controllers intervened (how@where; mean over seeds, smoothed)")
        fig.tight_layout(rect=(0, 0.06 + 0.02 * math.ceil(len(keys) / 5), 1, 0.96))
    else:
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.text(0.5, 0.5, "no arm intervened", ha="center", va="center")
        ax.axis("off")
    fig.savefig(root / "choices.png", dpi=110)
    plt.close(fig)
    written.append("choices.png")

    # how many: rollouts per decision, and the share of each step's budget spent on interventions
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    for a in order:
        ch = arms[a]["_choices_series"]
        x = np.array(ch["step"])
        if not len(x):
            continue
        w = max(1, len(x) // 15)
        if ch["by_key"]:
            dec = np.sum([v["decisions"] for v in ch["by_key"].values()], axis=0)
            rol = np.sum([v["rollouts"] for v in ch["by_key"].values()], axis=0)
            ratio = np.where(dec > 0, rol / np.maximum(dec, 1e-9), np.nan)
            axes[0].plot(x, ratio, marker=".", ls="-", lw=1.2, color=col[a], label=a)
        axes[1].plot(x, smooth(np.array(ch["intervention_budget_share"]), w), lw=1.3, color=col[a], label=a)
    axes[0].set_title("how many: intervention rollouts per decision")
    axes[0].set_ylabel("rollouts / decision")
    axes[1].set_title("share of each step's budget spent on interventions")
    axes[1].set_ylabel("intervention budget share")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(root / "how_many.png", dpi=110)
    plt.close(fig)
    written.append("how_many.png")

    _draw_choices_by_level(rep, root, plt, kcol)
    written.append("choices_by_level.png")
    return written


def _draw_choices_by_level(rep: dict, root: Path, plt, kcol: dict) -> None:
    """Per intervening arm, a map of family/level cells (rows) against training steps (columns, in bins of about
    1/40 of the run): the colour of the how@where chosen most in the bin, as strong as the share of the cell's
    groups intervened (white: none; grey: no group of that cell trained in the bin); the shift step dashed."""
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    arms, order = rep["arms"], rep["arms_order"]
    active = [a for a in order if any(sum(c["intervened"]) > 0 for c in arms[a]["_cells_series"]["series"].values())]
    keys = sorted({adaptivity.operator(k) for a in active for c in arms[a]["_cells_series"]["series"].values()
                   for k in c["keys"]})
    fallback = _colors(keys)
    for k in keys:
        kcol.setdefault(k, fallback[k])
    shift = rep.get("shift")
    if not active:
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.text(0.5, 0.5, "no arm intervened" if any(arms[a]["_cells_series"]["series"] for a in order) else
                "no per family/level choices logged (choice/ metrics)", ha="center", va="center")
        ax.axis("off")
        fig.savefig(root / "choices_by_level.png", dpi=110)
        plt.close(fig)
        return
    ncols = min(2, len(active))
    nrows = math.ceil(len(active) / ncols)
    names = cell_order(c for a in active for c in arms[a]["_cells_series"]["series"])  # the same rows for every arm
    n_cells = len(names)
    fig, axes = plt.subplots(nrows, ncols, figsize=(7 * ncols, (1.2 + 0.32 * n_cells) * nrows + 0.8), squeeze=False)
    for i, a in enumerate(active):
        ax = axes[i // ncols][i % ncols]
        cs = arms[a]["_cells_series"]
        steps = np.array(cs["step"], dtype=float)
        w = max(1, math.ceil(len(steps) / 40))
        bins = [slice(j, min(j + w, len(steps))) for j in range(0, len(steps), w)]
        img = np.ones((len(names), len(bins), 3))
        for r, c in enumerate(names):
            ser = cs["series"].get(c)
            if ser is None:  # no group of this cell in this arm's runs
                img[r] = 0.85
                continue
            grp, itv = np.array(ser["groups"]), np.array(ser["intervened"])
            dec = _by_operator(ser["keys"])
            for j, b in enumerate(bins):
                g = grp[b].sum()
                if g <= 0:
                    img[r, j] = 0.85
                    continue
                tot = {k: v[b].sum() for k, v in dec.items()}
                top = max(tot, key=tot.get) if tot and max(tot.values()) > 0 else None
                share = min(1.0, itv[b].sum() / g)
                if top is not None and share > 0:
                    img[r, j] = (1 - share) * np.ones(3) + share * np.array(kcol[top][:3])
        x0 = steps[0] - 0.5 if len(steps) else 0
        x1 = steps[-1] + 0.5 if len(steps) else 1
        ax.imshow(img, aspect="auto", interpolation="nearest", extent=(x0, x1, len(names) - 0.5, -0.5))
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_title(a)
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if shift is not None:
            ax.axvline(shift["step"] - 0.5, color="k", ls="--", lw=1.2)
    for j in range(len(active), nrows * ncols):
        axes[j // ncols][j % ncols].axis("off")
    handles = [Patch(color=kcol[k]) for k in keys] + [Patch(color=(0.85, 0.85, 0.85))]
    fig.legend(handles, keys + ["no group of the cell"], loc="lower center", ncol=min(5, len(keys) + 1), fontsize=8)
    fig.suptitle("what the controllers chose per family and level: colour = the how@where chosen most, strength = share "
                 "of the cell's groups intervened" + (f" (dashed: task-mix shift at step {shift['step']})" if shift else ""),
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.05 + 0.02 * math.ceil((len(keys) + 1) / 5), 1, 0.95))
    fig.savefig(root / "choices_by_level.png", dpi=110)
    plt.close(fig)


def _unit(rep: dict) -> str:
    return rep.get("budget", {}).get("unit") or "budget units"
