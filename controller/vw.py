"""The one module that talks to Vowpal Wabbit (vowpal-wabbit-next 0.7, VW 9.9).

Everything the controller learns goes through DSJson text: an event is rendered once as a DSJson line (label
keys before ``"c"``), and both the online learner and a later replay parse that same line with VW's own
DSJson parser, so a replay of the trace reproduces the model exactly. Moving to the official
``vowpalwabbit`` package means re-implementing this file only (its parser is ``Workspace("--dsjson")``
+ ``parse``; its cb_explore_adf predictions come indexed by action rather than ranked).

Two workspaces learn from every event:

* the **policy**: ``--cb_explore_adf`` with shared x action interactions (``-q sa``: without them the choice
  cannot depend on the context), constant epsilon exploration and ``--power_t 0`` (a constant, normalised
  step: the policy being trained keeps changing what works), ``--clip_p`` so no propensity is ever near 0;
* the **reward model**: ``--cb_adf`` regression of each action's cost, used by the doubly-robust estimator.
"""

from __future__ import annotations

import base64
import json
import math

import vowpal_wabbit_next as vw
from vowpal_wabbit_next import _core  # the parser and workspaces without the per-call label checks

LABEL_KEYS = ("_label_cost", "_label_probability", "_label_Action", "_labelIndex")


def policy_args(epsilon: float, lr: float, clip_p: float, bits: int = 18) -> list[str]:
    return ["--cb_explore_adf", "--quiet", "-q", "sa", "--epsilon", str(epsilon), "--power_t", "0",
            "-l", str(lr), "--clip_p", str(clip_p), "-b", str(bits)]


def reward_model_args(lr: float, bits: int = 18) -> list[str]:
    return ["--cb_adf", "--quiet", "-q", "sa", "--power_t", "0", "-l", str(lr), "-b", str(bits)]


class Bandit:
    """The policy and reward-model workspaces behind ``predict`` / ``scores`` / ``learn``.

    The online path parses an event's context once (``parse``), predicts on those examples with both
    workspaces and, at feedback, labels the chosen action's example and learns from the same examples
    (``learn_examples``): what VW would have parsed from the event's labelled DSJson line, without rendering and
    parsing it again. One parse serves both workspaces because they parse alike (the same bits, interactions
    and hashing; both read CB labels); tests check both shortcuts against VW parsing the trace's lines
    separately for each workspace. It calls vowpal-wabbit-next's core directly: its Python wrappers check every
    example's label type on each call, which cost more than VW's own work here.
    """

    def __init__(self, epsilon: float = 0.1, lr: float = 0.5, clip_p: float = 0.01, bits: int = 18,
                 state: dict | None = None):
        self.args = policy_args(epsilon, lr, clip_p, bits)
        self.rm_args = reward_model_args(lr, bits)
        if state is not None:
            self.policy = vw.Workspace(self.args, model_data=base64.b64decode(state["policy"]))
            self.reward_model = vw.Workspace(self.rm_args, model_data=base64.b64decode(state["reward_model"]))
        else:
            self.policy = vw.Workspace(self.args)
            self.reward_model = vw.Workspace(self.rm_args)
        self._pw, self._rw = self.policy._workspace, self.reward_model._workspace  # the core workspaces

    @staticmethod
    def context_json(shared: dict, actions: list[dict]) -> dict:
        """The DSJson ``c`` object: shared namespace ``s``, one ``a`` namespace per action."""
        return {"s": shared, "_multi": [{"a": a} for a in actions]}

    # ------------------------------------------------------------------ the online path
    def parse(self, context_text: str) -> list:
        """The examples (shared first) of an unlabelled event whose ``c`` object is ``context_text``."""
        return _parse(self._pw, '{"c":' + context_text + "}")

    def predict_examples(self, examples: list) -> list[float]:
        """The exploration PMF over the actions, indexed by action."""
        n = len(examples) - 1  # the shared example comes first
        pmf = [0.0] * n
        for i, p in self._pw.predict_multi_ex_one(examples):
            pmf[i] = p
        if min(pmf) < 0.0:  # never seen; clipped as a PMF must be
            pmf = [max(p, 0.0) for p in pmf]
        total = sum(pmf)
        if not math.isfinite(total) or total <= 0:
            return [1.0 / n] * n
        return [p / total for p in pmf]

    def score_examples(self, examples: list) -> list[float]:
        """Predicted reward of every action (the reward model's predicted cost, negated), indexed by action."""
        out = [0.0] * (len(examples) - 1)
        for i, cost in self._rw.predict_multi_ex_one(examples):
            out[i] = -cost
        return out

    def learn_examples(self, examples: list, chosen: int, cost: float, probability: float) -> None:
        """Learn one event from its parsed examples (both workspaces): the chosen action's example gets the label
        DSJson's ``_label_*`` keys would give it (1-based action, cost, probability)."""
        examples[chosen + 1]._set_label(vw.CBLabel(label=(chosen + 1, cost, probability)))
        self._pw.learn_multi_ex_one(examples)
        self._rw.learn_multi_ex_one(examples)

    # ------------------------------------------------------------------ from DSJson text (replay, evaluation)
    def predict(self, context: dict) -> list[float]:
        """The exploration PMF over the actions of ``context``, indexed by action."""
        return self.predict_examples(_parse(self._pw, json.dumps({"c": context})))

    def scores(self, context: dict) -> list[float]:
        """Predicted reward of every action (the reward model's predicted cost, negated), indexed by action."""
        return self.score_examples(_parse(self._rw, json.dumps({"c": context})))

    def learn(self, line: str) -> None:
        """Learn one labelled DSJson event (both workspaces)."""
        self._pw.learn_multi_ex_one(_parse(self._pw, line))
        self._rw.learn_multi_ex_one(_parse(self._rw, line))

    def state_dict(self) -> dict:
        return {"policy": base64.b64encode(self.policy.serialize()).decode(),
                "reward_model": base64.b64encode(self.reward_model.serialize()).decode()}

    def weights_equal(self, other: "Bandit") -> bool:
        """Same learned state in both workspaces: per feature the weight, its AdaGrad accumulator and its
        normaliser (slots 0-2 of VW's stride; slot 3 is scratch space a loaded model does not restore, and the
        serialized bytes also count predictions)."""
        import numpy as np

        return (np.array_equal(self.policy.weights()[..., :3], other.policy.weights()[..., :3])
                and np.array_equal(self.reward_model.weights()[..., :3], other.reward_model.weights()[..., :3]))


def _parse(workspace, text: str) -> list:
    """VW's DSJson parser on one line, as core examples (shared first)."""
    return _core._parse_line_dsjson(workspace, text)


_COMPACT = json.JSONEncoder(separators=(",", ":"))


def compact(obj) -> str:
    """JSON as the traces write it (no spaces)."""
    return _COMPACT.encode(obj)


def dsjson_line(event_id: str, context: dict, chosen: int, pmf: list[float], cost: float, extra: dict) -> str:
    """One DSJson event in the key order VW's parser needs: label keys, then ids, ``a``/``p`` (1-based action
    ids, chosen first, with the full PMF), then ``c``, then custom fields (which the parser ignores)."""
    return dsjson_text(event_id, compact(context), chosen, pmf, cost, extra)


def dsjson_text(event_id: str, context_text: str, chosen: int, pmf: list[float], cost: float, extra: dict) -> str:
    """``dsjson_line`` with the ``c`` object already rendered as compact JSON (the same bytes)."""
    p = max(pmf[chosen], 1e-12)
    order = [chosen] + [i for i in range(len(pmf)) if i != chosen]
    head = compact({
        "_label_cost": cost,
        "_label_probability": p,
        "_label_Action": chosen + 1,
        "_labelIndex": chosen,
        "Version": "1",
        "EventId": event_id,
        "a": [i + 1 for i in order],
        "p": [pmf[i] for i in order],
    })
    tail = compact(extra)[1:] if extra else "}"
    return head[:-1] + ',"c":' + context_text + ("," + tail if extra else tail)
