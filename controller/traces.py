"""Decision traces: read, replay and evaluate ``decisions.dsjson``.

Each line is one joined event (decision + outcome) in the order it was learned. Besides VW's own keys it
carries ``_mode`` (shadow/live), ``_actions`` (action names by index), ``_costs``, ``_pi`` (the bandit's
PMF at decision time), ``_h`` (the heuristic's deterministic choice), ``_q`` (the reward model's
predictions) and ``_learn_seq``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from controller import estimators
from controller.vw import LABEL_KEYS, Bandit


class TraceError(ValueError):
    pass


def parse_event(line: str | bytes, where: str) -> dict:
    """One event from one trace line, checked: a JSON object, label keys before ``c``, a numeric propensity in
    (0, 1], an integer ``_learn_seq`` when present. ``where`` (``file:line``) starts every error."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceError(f"{where}: not UTF-8 text ({e.reason}); the trace is damaged from this line on") from None
    try:
        ev = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e}); the trace is corrupt from this line on") from None
    if not isinstance(ev, dict):
        raise TraceError(f"{where}: not an event (a JSON object), got {type(ev).__name__}")
    keys = list(ev)
    if "c" not in ev or any(k not in ev or keys.index(k) > keys.index("c") for k in LABEL_KEYS):
        raise TraceError(f"{where}: label keys must all come before \"c\" (VW's DSJson parser drops them otherwise)")
    p = ev["_label_probability"]
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
        raise TraceError(f"{where}: propensity {p!r} is not a number in (0, 1]")
    seq = ev.get("_learn_seq", 0)
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise TraceError(f"{where}: _learn_seq {seq!r} is not an integer")
    ev["_line"], ev["_where"] = line, where
    return ev


def check_logged(ev: dict) -> None:
    """What :func:`evaluate` reads of an event beyond VW's keys: the action names, the chosen index, the
    heuristic's and the reward model's vectors (one entry per action), the cost and the mode."""
    acts = ev.get("_actions")
    ok = (isinstance(acts, list) and acts and all(isinstance(a, str) for a in acts)
          and isinstance(ev.get("_labelIndex"), int) and 0 <= ev["_labelIndex"] < len(acts)
          and all(isinstance(ev.get(k), list) and len(ev[k]) == len(acts)
                  and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in ev[k])
                  for k in ("_h", "_q", "_pi"))
          and isinstance(ev.get("_label_cost"), (int, float)) and not isinstance(ev["_label_cost"], bool)
          and ev.get("_mode") in ("shadow", "live"))
    if not ok:
        raise TraceError(f"{ev['_where']}: not a rail decision event (_actions, _labelIndex, _h, _q, _pi, _label_cost "
                         "and _mode are required, one _h, _q and _pi entry per action)")


def find_trace(path: str | Path) -> Path | None:
    """The decision trace a user names: the file itself, or a run directory's ``traces/decisions.dsjson`` (or a
    traces directory's ``decisions.dsjson``); None when there is none."""
    p = Path(path)
    for cand in (p, p / "traces" / "decisions.dsjson", p / "decisions.dsjson"):
        if cand.is_file():
            return cand
    return None


def read(path: str | Path) -> list[dict]:
    """Every event of a trace, checked (:func:`parse_event`) and in learn order."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{p}: no such trace file")
    out = []
    for n, line in enumerate(p.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        ev = parse_event(line, f"{p}:{n}")
        if ev.get("_learn_seq", len(out)) != len(out):
            raise TraceError(f"{p}:{n}: learn order broken (expected {len(out)}, got {ev.get('_learn_seq')})")
        out.append(ev)
    return out


def _meta(path: Path) -> dict:
    meta = path.parent / "controller.json"
    if not meta.exists():
        return {}
    try:
        d = json.loads(meta.read_bytes().decode("utf-8"))
        if not isinstance(d, dict) or not isinstance(d.get("settings", {}), dict):
            raise ValueError("not a JSON object with a settings table")
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise TraceError(f"{meta}: unreadable ({e}); restore it: it holds the settings the trace is replayed with "
                         "(traces/controller.json of the run)") from None
    return d


def replay(path: str | Path, settings: dict | None = None) -> Bandit:
    """A fresh bandit that learned every event in learn order (reproduces the online model)."""
    p = Path(path)
    s = settings or _meta(p).get("settings", {})
    b = Bandit(s.get("epsilon", 0.1), s.get("lr", 0.5), s.get("clip_p", 0.01), s.get("bits", 18))
    for ev in read(p):
        b.learn(ev["_line"])
    return b


def _is(action: str, name: str) -> bool:
    """Whether logged action ``action`` (``how@where`` or ``how@wherexK``, K rollouts) is intervention ``name``."""
    return action == name or action.split("x")[0] == name or action.startswith(name + "x")


def _fixed(name: str, actions: list[str]) -> list[float]:
    """A fixed controller's PMF over one event's actions."""
    k = len(actions)
    if name == "uniform":
        return [1.0 / k] * k
    if name == "none":
        pick = 0
    else:  # "how@where": the first such intervention when legal, else none
        pick = next((i for i, a in enumerate(actions) if _is(a, name)), 0)
    return [1.0 if i == pick else 0.0 for i in range(k)]


def evaluate(path: str | Path, policies: list[str] | None = None, alpha: float = 0.05) -> dict:
    """Off-policy estimates (IPS, SNIPS, DR with (1 - alpha) intervals) over a trace for: the logged policy
    (on-policy mean), the learned bandit (replayed from scratch, predicting before it learns each event), the
    shadowed heuristic, doing nothing, uniform, and any ``how@where`` fixed rule in ``policies``."""
    p = Path(path)
    if not 0.0 < alpha < 1.0:
        raise TraceError(f"--alpha {alpha}: must be in (0, 1) (0.05: 95 % intervals)")
    events = read(p)
    if not events:
        raise TraceError(f"{p}: the trace holds no events")
    for e in events:
        check_logged(e)
    offered = {a for e in events for a in e["_actions"]}
    for name in policies or []:
        if not any(_is(a, name) for a in offered):  # never legal: 'none' under another name, say so instead
            shown = sorted({a.split("x")[0] if "@" in a else a for a in offered} - {"none"})
            raise TraceError(f"--policy {name}: no event of {p} offers it; its interventions: "
                             f"{', '.join(shown) or 'none'}")
    r = [-float(e["_label_cost"]) for e in events]
    prop = [float(e["_label_probability"]) for e in events]
    chosen = [int(e["_labelIndex"]) for e in events]
    q = [e["_q"] for e in events]
    s = _meta(p).get("settings", {})
    b = Bandit(s.get("epsilon", 0.1), s.get("lr", 0.5), s.get("clip_p", 0.01), s.get("bits", 18))
    learned = []
    for e in events:
        learned.append(b.predict(e["c"]))
        b.learn(e["_line"])
    pmfs = {"learned": learned, "heuristic": [e["_h"] for e in events]}
    for name in ["none", "uniform", *(policies or [])]:
        pmfs[name] = [_fixed(name, e["_actions"]) for e in events]
    out = {"events": len(events), "modes": {m: sum(e["_mode"] == m for e in events) for m in ("shadow", "live")},
           "logged": estimators.mean_ci(r, alpha).to_dict(), "policies": {}}
    for name, pi in pmfs.items():
        at = [x[a] for x, a in zip(pi, chosen)]
        out["policies"][name] = {
            "ips": estimators.ips(r, prop, at, alpha).to_dict(),
            "snips": estimators.snips(r, prop, at, alpha).to_dict(),
            "dr": estimators.dr(r, prop, chosen, pi, q, alpha).to_dict(),
            "match_rate": sum(x[a] for x, a in zip(pi, chosen)) / len(chosen),
        }
    return out


def format_evaluation(res: dict) -> str:
    lines = [f"{res['events']} events ({res['modes']['shadow']} shadow, {res['modes']['live']} live); "
             f"logged policy's mean reward {res['logged']['value']:.4f} "
             f"[{res['logged']['lower']:.4f}, {res['logged']['upper']:.4f}]", "",
             f"{'policy':24s} {'IPS':>8s} {'SNIPS':>8s} {'DR':>8s}   DR interval"]
    for name, d in res["policies"].items():
        lines.append(f"{name:24s} {d['ips']['value']:8.4f} {d['snips']['value']:8.4f} {d['dr']['value']:8.4f}   "
                     f"[{d['dr']['lower']:.4f}, {d['dr']['upper']:.4f}]")
    return "\n".join(lines)


_EVENT_ID = re.compile(r"s(\d+)-g?(.+)#\d+")
_ACTION = re.compile(r"(.+@[^x]+?)x(\d+)(?:,m=(\d+))?")


def event_step(ev: dict) -> int | None:
    """The training step of an event, from its id (``s<step>-g<group>#<n>``); None for an id of another form."""
    m = _EVENT_ID.fullmatch(str(ev.get("EventId", "")))
    return int(m.group(1)) if m else None


def action_words(name: str) -> str:
    """A logged action name in words: ``rubric_hint@startx2`` -> ``rubric_hint@start x2``, an action guide's plan
    length as ``plan 3``; ``none`` as is."""
    m = _ACTION.fullmatch(name)
    if not m:
        return name
    return f"{m.group(1)} x{m.group(2)}" + (f" plan {m.group(3)}" if m.group(3) else "")


def describe(ev: dict) -> str:
    """One decision in plain words: step, cell, group (and round after the first), what was chosen with its
    propensity and the mode, the heuristic's choice where it differs, the outcome of an intervention that ran,
    and the reward the bandit learned."""
    check_logged(ev)
    s = ev.get("c", {}).get("s", {}) if isinstance(ev.get("c"), dict) else {}
    cell = s.get("family_level") or f"{s.get('family', '?')}/{s.get('level', '?')}"
    m = _EVENT_ID.fullmatch(str(ev.get("EventId", "")))
    where = f"step {m.group(1)}  {cell} group {m.group(2)}" if m else f"{ev.get('EventId', '?')}  {cell}"
    rnd = s.get("round", 0)
    if isinstance(rnd, (int, float)) and rnd > 0:
        where += f" round {int(rnd)}"
    acts, i = ev["_actions"], ev["_labelIndex"]
    how = f"p={float(ev['_label_probability']):.2f}, {ev['_mode']}"
    h = max(range(len(acts)), key=lambda k: ev["_h"][k])
    if h != i:
        how += f"; heuristic: {action_words(acts[h])}"
    line = f"{where}: chose {action_words(acts[i])} ({how})"
    out = ev.get("_outcome") if isinstance(ev.get("_outcome"), dict) else {}
    if "rollouts" in out:
        line += f"; {out.get('successes', 0)}/{out['rollouts']} succeeded"
        if out.get("accepted", out["rollouts"]) != out["rollouts"]:
            line += f", {out['accepted']} accepted"
        if "absorbed" in out:
            line += f", absorbed {out['absorbed']:.3g}"
    return f"{line}; reward {-float(ev['_label_cost']):.2f}"


def show(path: str | Path, limit: int | None = None, step: int | None = None) -> list[str]:
    """The decisions of a trace in plain words (:func:`describe`), one per line, in learn order: those of ``step``
    only when given, the first ``limit`` of them and a last line counting the rest."""
    p = Path(path)
    events = read(p)
    if step is not None:
        chosen = [e for e in events if event_step(e) == step]
        if not chosen:
            steps = sorted({s for s in map(event_step, events) if s is not None})
            span = f"its steps: {steps[0]}..{steps[-1]}" if steps else "its events name no step"
            raise TraceError(f"--step {step}: no decision at that step in {p} ({span})")
        events = chosen
    lines = [describe(e) for e in events[:limit]]
    if limit is not None and len(events) > limit:
        lines.append(f"... {len(events) - limit} more (--limit)")
    return lines
