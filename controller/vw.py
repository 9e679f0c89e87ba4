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

LABEL_KEYS = ("_label_cost", "_label_probability", "_label_Action", "_labelIndex")


def policy_args(epsilon: float, lr: float, clip_p: float, bits: int = 18) -> list[str]:
    return ["--cb_explore_adf", "--quiet", "-q", "sa", "--epsilon", str(epsilon), "--power_t", "0",
            "-l", str(lr), "--clip_p", str(clip_p), "-b", str(bits)]


def reward_model_args(lr: float, bits: int = 18) -> list[str]:
    return ["--cb_adf", "--quiet", "-q", "sa", "--power_t", "0", "-l", str(lr), "-b", str(bits)]


class Bandit:
    """The policy and reward-model workspaces behind ``predict`` / ``scores`` / ``learn``."""

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
        self._pp = vw.DSJsonFormatParser(self.policy)
        self._rp = vw.DSJsonFormatParser(self.reward_model)

    @staticmethod
    def context_json(shared: dict, actions: list[dict]) -> dict:
        """The DSJson ``c`` object: shared namespace ``s``, one ``a`` namespace per action."""
        return {"s": shared, "_multi": [{"a": a} for a in actions]}

    def predict(self, context: dict) -> list[float]:
        """The exploration PMF over the actions of ``context``, indexed by action."""
        n = len(context["_multi"])
        ranked = self.policy.predict_one(self._pp.parse_json(json.dumps({"c": context})))
        pmf = [0.0] * n
        for i, p in ranked:
            pmf[int(i)] = float(p)
        total = sum(max(p, 0.0) for p in pmf)
        if not math.isfinite(total) or total <= 0:
            return [1.0 / n] * n
        return [max(p, 0.0) / total for p in pmf]

    def scores(self, context: dict) -> list[float]:
        """Predicted reward of every action (the reward model's predicted cost, negated), indexed by action."""
        n = len(context["_multi"])
        ranked = self.reward_model.predict_one(self._rp.parse_json(json.dumps({"c": context})))
        out = [0.0] * n
        for i, cost in ranked:
            out[int(i)] = -float(cost)
        return out

    def learn(self, line: str) -> None:
        """Learn one labelled DSJson event (both workspaces)."""
        self.policy.learn_one(self._pp.parse_json(line))
        self.reward_model.learn_one(self._rp.parse_json(line))

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


def dsjson_line(event_id: str, context: dict, chosen: int, pmf: list[float], cost: float, extra: dict) -> str:
    """One DSJson event in the key order VW's parser needs: label keys, then ids, ``a``/``p`` (1-based action
    ids, chosen first, with the full PMF), then ``c``, then custom fields (which the parser ignores)."""
    p = max(pmf[chosen], 1e-12)
    order = [chosen] + [i for i in range(len(pmf)) if i != chosen]
    rec = {
        "_label_cost": cost,
        "_label_probability": p,
        "_label_Action": chosen + 1,
        "_labelIndex": chosen,
        "Version": "1",
        "EventId": event_id,
        "a": [i + 1 for i in order],
        "p": [pmf[i] for i in order],
        "c": context,
    }
    rec.update(extra)
    return json.dumps(rec, separators=(",", ":"))
