"""``bfcl``: the multi-turn categories of the Berkeley Function Calling Leaderboard, from the ``bfcl-eval`` package.

The package ships what this environment reads, and nothing is downloaded: the question files
``data/BFCL_v4_multi_turn_<category>.json`` (per task: the user turns, the ``initial_config`` of each involved
API class; ``miss_func`` also the functions held out until a later turn), the ground truth per user turn
(``data/possible_answer/``: call strings such as ``mv(source='a.pdf', destination='temp')``), the function docs
of each API class (``data/multi_turn_func_doc/``) and the stateful API classes themselves (GorillaFileSystem,
MathAPI, MessageAPI, TwitterAPI, TicketAPI, TradingBot, TravelAPI, VehicleControlAPI).

- **An episode** is the task's sequence of user turns. The assistant calls tools, one call per message, until it
  writes a message that is not a call; that ends its reply to the user turn (as in BFCL's harness, where a
  response that decodes to no call moves on), and the next user message arrives (:attr:`Step.user`). Every
  rollout runs on fresh instances of the involved API classes, loaded from the task's ``initial_config``.
- **Calls are parsed, never evaluated.** BFCL's harness runs call strings through ``eval``; here a model's call
  is parsed in its tool format (``json.loads``, or :mod:`ast` with literal arguments only), checked against the
  tool's schema and dispatched by name to a documented public method of one of the task's API classes (as
  BFCL's executor dispatches; ``miss_func``'s held-out functions are listed only from their turn on, in BFCL's
  own user message). Anything else is an error result (``Error during execution: ...``, BFCL's wording) and
  the turn goes on. The ground truth's call strings are read the same way.
- **Verifier**: BFCL's semantics, with BFCL's own ``state_checker`` and ``response_checker``: after each user
  turn whose ground truth is not empty, every instance's public state equals the state the ground-truth calls
  produce, the turn made at least one call, and the ground truth's results of that turn are among the results
  of all calls so far. Reward = 1 when every user turn passes (BFCL's all-or-nothing accuracy), else 0; the
  per-turn partial credit is the rubric's progress.
- **Rubric**: one milestone per user turn (its ground-truth state reached), achieved at the message that ends
  the turn; a hint reveals the turn's ground-truth calls in the model's tool format; a guided step writes the
  turn's first call. **Action guide**: the ground-truth calls, each user turn closed by a short reply.
- **Level** = the number of user turns (1..8). **Split**: a task is held out when its scenario number ``n`` (the
  id's last field, shared by the four categories' versions of one scenario) has ``zlib.crc32(f"bfcl:{n}") % 5 ==
  0``: 47 of the 200 scenarios, so no held-out scenario is trained on in any category.

Options (``[env.options.bfcl]``): ``categories``, a list of ``base``, ``miss_func``, ``miss_param``,
``long_context`` (default ``["base"]``); ``docs``, ``"full"`` (BFCL's function docs as they are, the default) or
``"compact"`` (without the class preamble each description repeats: shorter prompts, e.g. for a CPU smoke run).
Held-out results are reported per category (rows ``bfcl/base``, ...).
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from importlib import resources
from typing import Sequence

import numpy as np
from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC, PROMPT_STYLE_TEMPLATES
from bfcl_eval.constants.executable_backend_config import (CLASS_FILE_PATH_MAPPING, MULTI_TURN_FUNC_DOC_FILE_MAPPING,
                                                           STATELESS_CLASSES)
from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import response_checker, state_checker

from rail.envs.base import MESSAGE, Action, RubricItem, Step, Task, is_held_out
from rail.envs.toolcalls import check_arguments, literal_value

CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
#: The API classes of the multi-turn categories (the package also has memory and web-search backends, which need
#: libraries this environment does not install).
API_CLASSES = ("GorillaFileSystem", "MathAPI", "MessageAPI", "TwitterAPI", "TicketAPI", "TradingBot", "TravelAPI",
               "VehicleControlAPI")

_STYLE = PROMPT_STYLE_TEMPLATES["classic"]
SYSTEM_PROMPT = (f"{_STYLE['persona']} {_STYLE['task']}\n\n{_STYLE['multiturn_behavior']}\n\n"
                 "Make one function call per message. A message that makes no call ends your turn.")
#: How a reference trajectory ends its reply to a user turn: after the turn's calls, and for a turn whose ground
#: truth is empty (a function or a parameter is missing: the model should say so and call nothing).
REPLY_DONE = "Done."
REPLY_MISSING = "I cannot do this: a function or a parameter it needs is missing."
ERROR = "Error during execution: "  # BFCL's prefix of a failed call's result
_PREAMBLE = "Tool description: "
DOCS = ("full", "compact")


def _data():
    return resources.files("bfcl_eval") / "data"


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _openapi(spec: dict) -> dict:
    """A BFCL parameter spec in JSON-schema terms (``dict`` -> ``object``, ``float`` -> ``number``, ...), as
    BFCL's own conversion for function-calling models maps the types (``GORILLA_TO_OPENAPI``)."""
    out = {k: v for k, v in spec.items() if k not in ("properties", "items")}
    out["type"] = GORILLA_TO_OPENAPI.get(spec.get("type", "string"), "string")
    if "properties" in spec:
        out["properties"] = {k: _openapi(v) for k, v in spec["properties"].items()}
    if "items" in spec:
        out["items"] = _openapi(spec["items"])
    return out


def tool_schema(doc: dict, docs: str = "full") -> dict:
    """A BFCL function doc as a tool in the OpenAI function format (its ``response`` schema left out). ``docs =
    "compact"`` drops the preamble every description of a class repeats ("This tool belongs to ... Tool
    description: "), about a third of a task's tool list."""
    params = doc["parameters"]
    description = doc["description"]
    if docs == "compact" and _PREAMBLE in description:
        description = description.split(_PREAMBLE, 1)[1]
    return {"type": "function", "function": {
        "name": doc["name"], "description": description,
        "parameters": {"type": "object", "properties": {k: _openapi(v) for k, v in params["properties"].items()},
                       "required": list(params.get("required", []))}}}


def result_text(value) -> str:
    """A call's result as BFCL's executor records it: a string as is, a dict as JSON, anything else ``str()``."""
    if type(value) is str:
        return value
    if type(value) is dict:
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


@dataclass
class _Case:
    """One BFCL task, read: its RAIL task, user messages, ground truth and tools."""

    task: Task
    category: str
    entry: dict
    turns: list[str]
    ground_truth: list[list[Action]]
    tools: list[dict]  # listed in the prompt (miss_func: without the functions held out)
    reveal: dict[int, list[str]] = field(default_factory=dict)  # turn -> held-out functions its message lists


class BfclEpisode:
    """One rollout: fresh API instances, the user turn reached, every call's result, each closed turn's check."""

    def __init__(self, env: "BfclEnv", case: _Case):
        self.env, self.case = env, case
        self.tools = case.tools
        self.instances = env.instances(case)
        # the whitelist: the documented functions of the task's classes, those held out until a later turn
        # (miss_func) included, as BFCL's executor dispatches them
        self.available = env.functions(case)
        self.turn = 0
        self.calls = 0  # calls made in the current user turn
        self.results: list[str] = []  # every call's result so far, all turns (BFCL's response check reads them)
        self.passed: list[bool] = []  # each closed user turn: did it pass
        self.closed_at: list[int] = []  # the step that closed each user turn
        self.n_steps = 0

    def execute(self, action: Action | None) -> tuple:
        case, i = self.case, self.n_steps
        self.n_steps += 1
        if self.turn >= len(case.turns):
            return "error : the conversation is over", False, True
        if action is None or action.tool == MESSAGE:  # no call: the reply to this user turn is over
            self.passed.append(self.env.turn_passes(case, self.turn, self.instances, self.results, self.calls))
            self.closed_at.append(i)
            self.turn, self.calls = self.turn + 1, 0
            if self.turn == len(case.turns):
                return "", True, True
            return "", True, False, case.turns[self.turn]
        self.calls += 1
        result, ok = self.env.call(self.instances, self.available, action)
        self.results.append(result)
        return result, ok, False


class BfclEnv:
    """BFCL multi-turn tasks of ``categories``; see the module docstring. ``seed`` changes nothing: the data and
    the split are fixed, and which training tasks a step draws comes from the trainer's generator."""

    name = "bfcl"
    named_arguments = True
    levels = tuple(range(1, 9))

    def __init__(self, seed: int = 0, categories: Sequence[str] = ("base",), docs: str = "full"):
        cats = list(categories)
        bad = [c for c in cats if c not in CATEGORIES]
        if not cats or bad or len(set(cats)) != len(cats):
            raise ValueError(f"bfcl: categories = {cats}: a non-empty list of distinct names from {', '.join(CATEGORIES)}")
        if docs not in DOCS:
            raise ValueError(f"bfcl: docs = {docs!r}: one of {', '.join(DOCS)}")
        self.seed, self.categories, self.docs = seed, tuple(cats), docs
        data = _data()
        self._classes, self._schemas, self._owner = {}, {}, {}
        for cls_name in API_CLASSES:
            cls = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[cls_name]), cls_name)
            self._classes[cls_name] = cls
            for doc in _jsonl(data / "multi_turn_func_doc" / MULTI_TURN_FUNC_DOC_FILE_MAPPING[cls_name]):
                name = doc["name"]
                # the whitelist: a documented, public method of the class; nothing else is ever dispatched
                if name.startswith("_") or not inspect.isfunction(getattr(cls, name, None)):
                    raise ValueError(f"bfcl: {cls_name} documents {name}, which is not one of its public methods")
                self._schemas[name] = tool_schema(doc, docs)
                self._owner[name] = cls_name
        self._tools = list(self._schemas.values())
        self._cases: dict[str, _Case] = {}
        for cat in self.categories:
            answers = {a["id"]: a["ground_truth"] for a in _jsonl(data / "possible_answer" / f"BFCL_v4_multi_turn_{cat}.json")}
            for entry in _jsonl(data / f"BFCL_v4_multi_turn_{cat}.json"):
                self._cases[entry["id"]] = self._case(cat, entry, answers[entry["id"]])
        self._train: dict[int, list[_Case]] = {}
        self._held: dict[int, list[_Case]] = {}
        for case in self._cases.values():
            pool = self._held if self.held_out(case.task.id) else self._train
            pool.setdefault(case.task.level, []).append(case)
        self._gt_cache: dict[str, list] = {}
        self._replays: OrderedDict = OrderedDict()

    # ----------------------------------------------------------------- reading the data
    @staticmethod
    def held_out(task_id: str) -> bool:
        """The split: by scenario number, the same for every category (module docstring)."""
        return is_held_out(f"bfcl:{int(task_id.rsplit('_', 1)[1])}")

    def parse_call(self, text: str) -> Action:
        """A ground-truth call string as a named action: :mod:`ast`, literal arguments only, positional ones named
        by the method's signature. ValueError for anything else."""
        node = ast.parse(text, mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.func.id not in self._owner:
            raise ValueError(f"bfcl: not a call of a documented function: {text!r}")
        name = node.func.id
        params = list(inspect.signature(getattr(self._classes[self._owner[name]], name)).parameters)[1:]
        if len(node.args) > len(params):
            raise ValueError(f"bfcl: too many positional arguments: {text!r}")
        args = {p: literal_value(a) for p, a in zip(params, node.args)}
        args.update({kw.arg: literal_value(kw.value) for kw in node.keywords})
        return Action.named(name, args)

    def _case(self, cat: str, entry: dict, ground_truth: list[list[str]]) -> _Case:
        turns, reveal = [], {}
        missed = entry.get("missed_function", {})
        for k, msgs in enumerate(entry["question"]):
            if str(k) in missed:  # miss_func: the held-out functions arrive with BFCL's own user message
                reveal[k] = list(missed[str(k)])
                docs = "\n".join(json.dumps(self._schemas[f]) for f in reveal[k])
                turns.append(f"{docs}\n{DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC}")
            else:
                turns.append("\n".join(m["content"] for m in msgs if m["role"] == "user"))
        hidden = {f for fs in reveal.values() for f in fs}
        tools = [self._schemas[n] for c in entry["involved_classes"] for n, o in self._owner.items()
                 if o == c and n not in hidden]
        gt = [[self.parse_call(c) for c in turn] for turn in ground_truth]
        rubric, guide = [], []
        for k, calls in enumerate(gt):
            reply = Action.message(REPLY_DONE if calls else REPLY_MISSING)
            guide += [*calls, reply]
            if calls:
                desc, evidence = f"user turn {k + 1}: the state its ground-truth calls produce", \
                    "The calls that complete this request:"
            else:
                desc, evidence = f"user turn {k + 1}: nothing to call", \
                    "This request cannot be completed with the functions and information given; say so and call nothing."
            rubric.append(RubricItem(desc, "turn", calls[0] if calls else reply, None, evidence, tuple(calls),
                                     guide_end=len(guide)))
        task = Task(entry["id"], f"bfcl/{cat}", len(turns), turns[0], "", tuple(rubric), tuple(guide))
        return _Case(task, cat, entry, turns, gt, tools, reveal)

    # ----------------------------------------------------------------- the protocol
    def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def tools(self) -> list[dict]:
        """Every documented function of the eight API classes; each task lists its own classes' (:meth:`start`)."""
        return list(self._tools)

    def _pool(self, pools: dict[int, list[_Case]], levels: Sequence[int], what: str) -> list[int]:
        present = [lv for lv in levels if pools.get(lv)]
        if not present:
            raise ValueError(f"bfcl: no {what} tasks of levels {list(levels)} in categories {list(self.categories)} "
                             f"(levels there: {sorted(pools)})")
        return present

    def sample_tasks(self, rng: np.random.Generator, levels: Sequence[int], n: int) -> list[Task]:
        """``n`` training tasks, levels drawn uniformly from those of ``levels`` the training pool holds."""
        present = self._pool(self._train, levels, "training")
        out = []
        for _ in range(n):
            pool = self._train[present[int(rng.integers(len(present)))]]
            out.append(pool[int(rng.integers(len(pool)))].task)
        return out

    def demonstration_task(self, rng: np.random.Generator, levels: Sequence[int], guided: bool) -> Task:
        (task,) = self.sample_tasks(rng, levels, 1)
        return task

    def eval_tasks(self, level: int, n: int) -> list[Task]:
        """The first ``n`` held-out tasks of ``level``, the categories taking turns (fewer if the pool is smaller:
        a level may hold none)."""
        by_cat = [[c.task for c in self._held.get(level, []) if c.category == cat] for cat in self.categories]
        out = []
        for k in range(max((len(b) for b in by_cat), default=0)):
            out += [b[k] for b in by_cat if k < len(b)]
        return out[:n]

    def start(self, task: Task) -> BfclEpisode:
        return BfclEpisode(self, self._cases[task.id])

    def reward(self, task: Task, steps: Sequence[Step]) -> float:
        """1.0 when every user turn was closed and passed BFCL's checks, else 0.0."""
        passed, _ = self._replay(task, steps)
        return 1.0 if len(passed) == task.level and all(passed) else 0.0

    def rubric_achieved(self, task: Task, steps: Sequence[Step]) -> list[int | None]:
        """Per user turn, the step that closed it if it passed its checks."""
        passed, closed_at = self._replay(task, steps)
        return [closed_at[k] if k < len(passed) and passed[k] else None for k in range(task.level)]

    # ----------------------------------------------------------------- execution and checks
    def instances(self, case: _Case) -> dict:
        """Fresh instances of the task's API classes, loaded from its initial_config (long_context: with BFCL's
        long-context additions), as BFCL's executor builds them."""
        long = case.category == "long_context"
        out = {}
        for name in case.entry["involved_classes"]:
            inst = self._classes[name]()
            if name not in STATELESS_CLASSES:
                inst._load_scenario(copy.deepcopy(case.entry["initial_config"].get(name, {})), long_context=long)
            out[name] = inst
        return out

    def functions(self, case: _Case) -> set[str]:
        """The functions a task's calls may run: every documented function of its involved classes."""
        return {n for n, owner in self._owner.items() if owner in case.entry["involved_classes"]}

    def call(self, instances: dict, available: set, action: Action) -> tuple[str, bool]:
        """Dispatch one named call: ``(result, ok)``. Only a documented function of the task's classes runs, with
        arguments its schema accepts; everything else is an error result."""
        name = action.tool
        if name not in available or self._owner.get(name) not in instances:
            return f"{ERROR}no function named {name!r} is available", False
        if action.args:
            return f"{ERROR}{name}() takes its arguments by name", False
        args = action.arguments
        problem = check_arguments(args, self._schemas[name])
        if problem is not None:
            return ERROR + problem, False
        try:
            value = getattr(instances[self._owner[name]], name)(**args)
        except Exception as e:  # noqa: BLE001 - the API's own error is the call's result, as in BFCL
            return f"{ERROR}{e}", False
        return result_text(value), not (isinstance(value, dict) and "error" in value)

    def _ground_truth(self, case: _Case) -> list[tuple[dict, list[str]]]:
        """Per user turn: (the instances after the ground truth's calls up to it, the turn's results); cached."""
        if case.task.id not in self._gt_cache:
            inst, out = self.instances(case), []
            every = self.functions(case)
            for calls in case.ground_truth:
                results = [self.call(inst, every, a)[0] for a in calls]
                out.append((copy.deepcopy(inst), results))
            self._gt_cache[case.task.id] = out
        return self._gt_cache[case.task.id]

    def turn_passes(self, case: _Case, k: int, instances: dict, results: list[str], calls: int) -> bool:
        """BFCL's checks of user turn ``k`` (multi_turn_checker): nothing for an empty ground truth; else at least
        one call this turn, every instance's state equal to the ground truth's, the ground truth's results of
        this turn among all results so far."""
        if not case.ground_truth[k]:
            return True
        if calls == 0:
            return False
        gt_instances, gt_results = self._ground_truth(case)[k]
        if not state_checker(instances, gt_instances)["valid"]:
            return False
        return response_checker(results, gt_results, k)["valid"]

    def _replay(self, task: Task, steps: Sequence[Step]) -> tuple[list[bool], list[int]]:
        """Run ``steps``' actions on a fresh episode: (each closed turn passed, the step that closed it). The
        reward and the rubric of one trajectory ask for the same replay, so the last few are kept."""
        key = (task.id, tuple(st.action for st in steps))
        if key not in self._replays:
            ep = self.start(task)
            for st in steps:
                ep.execute(st.action)
            self._replays[key] = (list(ep.passed), list(ep.closed_at))
            if len(self._replays) > 512:
                self._replays.popitem(last=False)
        return self._replays[key]
