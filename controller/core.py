"""The learned intervention controller: decide for a batch of groups under a budget, learn from outcomes,
go live only when off-policy evaluation says it beats the heuristic it shadows.

One decision per group per call of ``decide`` (a trainer may call it again, in later rounds of a step, for the
groups an intervention left without signal). For each group the caller gives a context (shared features), the legal
interventions with their features and costs, and what the shadowed heuristic would do. The controller adds
the "no intervention" action itself (index 0, cost 0). See ``docs/controller.md``.
"""

from __future__ import annotations

import _random
import hashlib
import json
import math
import os
import random
import tempfile
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from controller import estimators
from controller.records import Decision, Intervention
from controller.vw import Bandit, compact, dsjson_text

NONE = "none"
MODES = ("shadow", "live")


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it, fsync, then a rename: a reader (a resumed
    run) sees the old file or the new one, never a partial one, and a failed write leaves no temporary file.
    The same write as ``policy.fileio.write_text_atomic``, kept here because ``controller/`` imports nothing
    from ``policy/``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@dataclass
class Context:
    """What the bandit decides on for one group (a context in Vowpal Wabbit's sense: shared features and the
    actions available): the group's ``features``, the legal ``interventions`` (each with its action features
    and cost; doing nothing is added as action 0), and the name of the intervention the shadowed heuristic would
    take (None: nothing)."""

    group: str
    features: dict
    interventions: Sequence[Intervention]
    heuristic: str | None = None


@dataclass
class Settings:
    """Controller settings (``docs/controller.md``)."""

    epsilon: float = 0.1  # the bandit's exploration when live
    heuristic_epsilon: float = 0.3  # shadow: the heuristic's choice is mixed with this much uniform exploration
    lr: float = 0.5
    clip_p: float = 0.01
    bits: int = 18
    mode: str = "shadow"  # starting mode; "live" skips shadowing
    window: int = 200  # recent events the gate evaluates
    min_events: int = 60  # no gate check before this many events
    check_every: int = 20  # events between gate checks
    margin: float = 0.0  # go live when LB(V(bandit) - V(heuristic)) > margin
    consecutive: int = 2  # ... in this many consecutive checks (and demote likewise)
    alpha: float = 0.05  # one-sided level of the bounds

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for k in ("epsilon", "heuristic_epsilon"):
            if not 0.0 < getattr(self, k) <= 1.0:
                raise ValueError(f"{k} must be in (0, 1]: without exploration nothing can be learned off-policy")
        if not 0.0 < self.clip_p < 1.0:
            raise ValueError("clip_p must be in (0, 1)")
        if self.window < 2 or self.check_every < 1 or self.consecutive < 1:
            raise ValueError("window >= 2, check_every >= 1 and consecutive >= 1 are required")


def _uniform01(seed: int, event_id: str, mt: Any = None) -> float:
    """A decision's uniform draw: ``random.Random(h).random()`` for ``h`` a hash of (seed, event id). ``mt``, a
    generator to reseed for it (the same draw, without building a ``random.Random`` per decision)."""
    h = int.from_bytes(hashlib.blake2b(f"{seed}:{event_id}".encode(), digest_size=8).digest(), "little")
    if mt is None:
        return random.Random(h).random()
    mt.seed(h)
    return mt.random()


def _sample(pmf: Sequence[float], u: float) -> int:
    acc = 0.0
    for i, p in enumerate(pmf):
        acc += p
        if u < acc:
            return i
    return len(pmf) - 1


def _features(d: dict) -> dict:
    """Features as DSJson wants them: strings are categorical, numbers numeric, booleans 0/1; NaN -> 0."""
    out = {}
    for k, v in d.items():
        t = type(v)
        if t is float:  # the common cases first, by exact type
            out[k] = v if v - v == 0.0 else 0.0  # finite (inf - inf and NaN - NaN are NaN)
        elif t is str:
            out[k] = v
        elif isinstance(v, bool):
            out[k] = 1.0 if v else 0.0
        elif isinstance(v, (int, float)):
            out[k] = float(v) if math.isfinite(v) else 0.0
        else:
            out[k] = str(v)
    return out


_NONE_TEXT = '{"a":' + compact({"none": 1.0, "cost": 0.0}) + "}"  # the "no intervention" action, rendered


def _context_text(shared: str, actions: Sequence[str]) -> str:
    """The DSJson ``c`` object (``Bandit.context_json``) as compact JSON, from its rendered parts."""
    return '{"s":' + shared + ',"_multi":[' + ",".join(actions) + "]}"


class LearnedController:
    def __init__(self, settings: Settings | None = None, seed: int = 0, trace_dir: str | os.PathLike | None = None):
        self.s = settings or Settings()
        self.seed = seed
        self.bandit = Bandit(self.s.epsilon, self.s.lr, self.s.clip_p, self.s.bits)
        self.mode = self.s.mode
        self.window: deque = deque(maxlen=self.s.window)
        self.learned = 0  # events learned so far (the learn order)
        self.decided = 0
        self.passes = 0
        self.transitions: list[dict] = []
        self.last_gate: dict = {}
        self._pending: dict[str, tuple] = {}  # event id -> what feedback needs of its decision
        self._terms: deque = deque(maxlen=self.s.window)  # per window event: DR terms, SNIPS weights
        self._rendered: dict = {}  # action names -> (their costs, features, features' order, rendered namespaces)
        self._trace = None  # the trace file, opened for appending on the first line
        self._mt = _random.Random()  # random.Random's C generator, reseeded for every decision's draw
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self._trace_path = None if self.trace_dir is None else self.trace_dir / "decisions.dsjson"
        if self.trace_dir is not None:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            meta = self.trace_dir / "controller.json"
            if not meta.exists():
                write_atomic(meta, json.dumps({"settings": asdict(self.s), "seed": seed, "vw_args": self.bandit.args,
                                               "reward_model_args": self.bandit.rm_args}, indent=1))

    @property
    def trace_path(self) -> Path | None:
        return self._trace_path

    # ------------------------------------------------------------------ decide
    def decide(self, contexts: Sequence[Context], budget: float, tag: str = "") -> list[Decision]:
        """One decision per context (in the order of ``contexts``), spending at most ``budget`` in total.

        Groups are served in order of their best predicted reward (ties: by group id); each chooses among the
        actions that still fit the budget, and the PMF it was drawn from is logged, so every propensity is the
        true probability of what was done.
        """
        prepared = []
        for pos, g in enumerate(contexts):
            acts: list[Intervention | None] = [None, *g.interventions]
            names = [NONE, *(a.name for a in g.interventions)]
            if len(set(names)) != len(names):
                raise ValueError(f"group {g.group}: intervention names must be unique and not {NONE!r}, got {names}")
            if g.heuristic is not None and g.heuristic not in names:
                raise ValueError(f"group {g.group}: heuristic {g.heuristic!r} is not among its interventions")
            # the event's context is rendered once, as the trace will hold it, and parsed once for both workspaces
            shared = compact(_features(g.features))
            costs = [0.0, *(float(a.cost) for a in g.interventions)]
            texts = self._action_texts(names, costs, [{}, *(a.features for a in g.interventions)])
            ctx = _context_text(shared, texts)
            ex = self.bandit.parse(ctx)
            q = self.bandit.score_examples(ex)
            prepared.append((g, acts, names, costs, shared, texts, ctx, ex, q, pos))
        if len(prepared) > 1:
            prepared.sort(key=lambda x: (-max(x[8]), x[0].group))
        left = float(budget)
        out: list = [None] * len(prepared)
        for g, fit, names, costs, shared, texts, ctx, ex, q, pos in prepared:
            if max(costs) > left + 1e-9:  # some actions no longer fit: the context and scores are of those that do
                keep = [i for i, c in enumerate(costs) if c <= left + 1e-9]
                fit, names, costs = [fit[i] for i in keep], [names[i] for i in keep], [costs[i] for i in keep]
                ctx = _context_text(shared, [texts[i] for i in keep])
                ex = self.bandit.parse(ctx)
                q = self.bandit.score_examples(ex)
            pi = self.bandit.predict_examples(ex)
            # the heuristic's deterministic choice, and mixed with uniform exploration ((1 - he) * h + he / k)
            k, he = len(fit), self.s.heuristic_epsilon
            j = names.index(g.heuristic) if g.heuristic in names else 0  # 0: none
            h, h_mix = [0.0] * k, [he / k] * k
            h[j], h_mix[j] = 1.0, (1 - he) + he / k
            logging = h_mix if self.mode == "shadow" else pi
            eid = f"{tag}{g.group}#{self.decided}"
            i = _sample(logging, _uniform01(self.seed, eid, self._mt))
            self.decided += 1
            left -= costs[i]
            self._pending[eid] = (ctx, ex, names, costs, i, logging, pi, h, q, self.mode)
            out[pos] = Decision(eid, g.group, fit[i], logging[i], self.mode)
        return out

    def _action_texts(self, names: list[str], costs: list[float], feats: list[dict]) -> list[str]:
        """Each action's ``a`` namespace as compact JSON (``none`` first). Menus repeat across groups and steps,
        so the texts of a menu (its action names) are kept and reused while every cost and feature is the same,
        in the same order (``-0.0`` matches ``0.0`` there: VW reads the same feature from either text, and the
        trace holds the text it parsed)."""
        key = tuple(names)
        hit = self._rendered.get(key)
        if hit is not None and hit[0] == costs and hit[1] == feats and hit[2] == [tuple(f) for f in feats]:
            return hit[3]
        texts = [_NONE_TEXT, *('{"a":' + compact(_features({**f, "cost": c})) + "}"
                               for f, c in zip(feats[1:], costs[1:]))]
        if len(self._rendered) >= 1024:
            self._rendered.clear()
        self._rendered[key] = (costs, [dict(f) for f in feats], [tuple(f) for f in feats], texts)
        return texts

    # ------------------------------------------------------------------ learn
    def feedback(self, decision_id: str, reward: float, outcome: dict | None = None) -> None:
        """Report the reward (in [0, 1]) of a decision; the bandit learns it and the gate is updated."""
        ev = self._pending.pop(decision_id, None)
        if ev is None:
            raise KeyError(f"unknown or already reported decision {decision_id!r}")
        if not (isinstance(reward, (int, float)) and math.isfinite(reward)):
            raise ValueError(f"decision {decision_id}: reward {reward!r} is not a finite number")
        r = min(1.0, max(0.0, float(reward)))
        ctx, ex, names, costs, i, logging, pi, h, q, mode = ev
        self.bandit.learn_examples(ex, i, -r, max(logging[i], 1e-12))
        if self._trace_path is not None:
            extra = {"_mode": mode, "_actions": names, "_costs": costs, "_pi": pi, "_h": h, "_q": q,
                     "_learn_seq": self.learned}
            if outcome:
                extra["_outcome"] = outcome
            self._append(dsjson_text(decision_id, ctx, i, logging, -r, extra))
        self.learned += 1
        self._remember(r, logging[i], i, pi, h, q)
        if self.learned >= self.s.min_events and self.learned % self.s.check_every == 0:
            self._gate()

    def _append(self, line: str) -> None:
        """One trace line, flushed (a checkpoint taken after it counts it as written)."""
        if self._trace is None:
            self._trace = open(self.trace_path, "a")
        self._trace.write(line + "\n")
        self._trace.flush()

    def _remember(self, r: float, p: float, chosen: int, pi: list, h: list, q: list) -> None:
        """An event joins the gate's window, with its DR terms under the bandit's and the heuristic's PMF (they
        never change, so each is computed once)."""
        self.window.append((r, p, chosen, pi, h, q))
        self._terms.append((estimators.dr_term(r, p, chosen, pi, q), estimators.dr_term(r, p, chosen, h, q),
                            pi[chosen] / p, h[chosen] / p))  # ... and its SNIPS weights

    def abandon(self, decision_id: str) -> None:
        """Forget a decision that was never carried out (nothing is learned from it)."""
        self._pending.pop(decision_id, None)

    def reuse(self, trace: str | os.PathLike) -> dict:
        """Start from an earlier run's learned controller: replay its trace (``decisions.dsjson``) into this bandit,
        take its last ``window`` events into the gate's window, and go live at once when the gate's estimate over
        them already says the bandit beats the heuristic (lower bound above ``margin``). Before any decision of
        this run; this run's trace holds only its own events. Returns what was reused (the events, the gate's
        estimate, the mode)."""
        from controller.traces import check_logged, read

        if self.decided or self.learned:
            raise RuntimeError("reuse: only before this controller's first decision")
        events = read(trace)
        for ev in events:
            check_logged(ev)
        for ev in events:
            self.bandit.learn(ev["_line"])
        for ev in events[-self.s.window:]:
            i = ev["_labelIndex"]
            self._remember(-float(ev["_label_cost"]), float(ev["_label_probability"]), i, list(ev["_pi"]),
                           list(ev["_h"]), list(ev["_q"]))
        est = self.evaluate() if self.window else {}
        live = bool(est) and est["diff_lower"] > self.s.margin
        if live and self.mode == "shadow":
            self.transitions.append({"event": 0, "from": "shadow", "to": "live", "reused": str(trace),
                                     **{k: est[k] for k in ("diff", "diff_lower", "diff_upper", "n")}})
            self.mode = "live"
        self.last_gate = est
        return {"trace": str(trace), "events": len(events), "gate": est, "mode": self.mode}

    # ------------------------------------------------------------------ shadow -> live
    def evaluate(self) -> dict:
        """Off-policy estimates over the recent window: V(bandit), V(heuristic) and their DR difference."""
        if not self.window:
            return {}
        r = [w[0] for w in self.window]
        t, b, w_bandit, w_heuristic = map(list, zip(*self._terms))
        n = len(r)
        diff = estimators.mean_ci([x - y for x, y in zip(t, b)], self.s.alpha, two_sided=False)
        return {
            "n": n,
            "logged": sum(r) / n,
            "bandit_dr": sum(t) / n,  # the DR values (estimators.dr(...).value: the terms' mean)
            "heuristic_dr": sum(b) / n,
            "bandit_snips": estimators.snips_value(w_bandit, r),
            "heuristic_snips": estimators.snips_value(w_heuristic, r),
            "diff": diff.value, "diff_lower": diff.lower, "diff_upper": diff.upper,
        }

    def _gate(self) -> None:
        ev = self.evaluate()
        self.last_gate = ev
        if self.mode == "shadow":
            ok = ev["diff_lower"] > self.s.margin  # the bandit is better than the heuristic
        else:
            ok = -ev["diff_upper"] > self.s.margin  # the heuristic is better than the bandit
        self.passes = self.passes + 1 if ok else 0
        if self.passes >= self.s.consecutive:
            new = "live" if self.mode == "shadow" else "shadow"
            self.transitions.append({"event": self.learned, "from": self.mode, "to": new,
                                     **{k: ev[k] for k in ("diff", "diff_lower", "diff_upper", "n")}})
            self.mode, self.passes = new, 0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        if self._pending:
            raise RuntimeError(f"{len(self._pending)} decisions await feedback; save after reporting them")
        return {"bandit": self.bandit.state_dict(), "mode": self.mode, "learned": self.learned,
                "decided": self.decided, "passes": self.passes, "transitions": self.transitions,
                "window": [list(w) for w in self.window], "last_gate": self.last_gate, "seed": self.seed,
                "settings": asdict(self.s)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpointed state; the trace is cut back to the events it learned first (a
        :class:`~controller.traces.TraceError`, with nothing changed, when it no longer holds them all)."""
        if self.trace_path is not None and self.trace_path.exists():
            self._truncate_trace(int(state["learned"]))
        self.bandit = Bandit(self.s.epsilon, self.s.lr, self.s.clip_p, self.s.bits, state=state["bandit"])
        self.mode, self.learned, self.decided = state["mode"], int(state["learned"]), int(state["decided"])
        self.passes, self.transitions = int(state["passes"]), list(state["transitions"])
        self.window = deque(maxlen=self.s.window)
        self._terms = deque(maxlen=self.s.window)
        for w in state["window"]:
            self._remember(*w)
        self.last_gate = state.get("last_gate", {})
        self._pending = {}

    def _truncate_trace(self, n: int) -> None:
        """Keep the events ``_learn_seq`` 0..n-1 in order: a run killed after its last checkpoint re-decides the
        later ones. A torn, junk or out-of-order line is dropped (with a warning); an event among the first
        ``n`` that is missing or damaged cannot be rebuilt, so that is a TraceError naming the file."""
        import warnings

        from controller.traces import TraceError, parse_event

        if self._trace is not None:  # the open append handle would write past the rewritten file
            self._trace.close()
            self._trace = None
        raw = self.trace_path.read_bytes()
        lines = raw.split(b"\n")[:-1]  # complete lines only: what follows the last newline is a torn write
        keep, dropped = [], []
        for k, line in enumerate(lines, 1):
            if len(keep) == n:
                break
            try:
                ok = parse_event(line, f"{self.trace_path}:{k}").get("_learn_seq") == len(keep)
            except TraceError:
                ok = False
            (keep if ok else dropped).append(line if ok else k)
        if len(keep) < n:
            raise TraceError(f"{self.trace_path}: holds {len(keep)} intact events of the {n} the checkpoint "
                             f"learned (event {len(keep)} is missing or damaged)")
        if dropped:
            warnings.warn(f"{self.trace_path}: dropped {len(dropped)} damaged line(s) among the checkpointed "
                          f"events (line {', '.join(map(str, dropped[:5]))}{', ...' if len(dropped) > 5 else ''})",
                          stacklevel=2)
        text = b"".join(ln + b"\n" for ln in keep)
        if text != raw:
            write_atomic(self.trace_path, text)

    def save(self, path: str | os.PathLike) -> None:
        write_atomic(Path(path), json.dumps(self.state_dict()))

    @classmethod
    def load(cls, path: str | os.PathLike, trace_dir: str | os.PathLike | None = None) -> "LearnedController":
        try:
            state = json.loads(Path(path).read_text())
            settings = Settings(**state["settings"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a controller state file ({e})") from None
        c = cls(settings, seed=int(state["seed"]), trace_dir=trace_dir)
        c.load_state_dict(state)
        return c
