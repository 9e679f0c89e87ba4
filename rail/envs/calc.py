"""``calc``: chains of integer arithmetic done one tool call at a time.

A task of level ``k`` is a start value in [1, 20] followed by ``k`` operations ``(op, operand)`` with ``op``
in ``+ - *`` and ``operand`` in [1, 9]. Operations are resampled until every intermediate value stays in
[0, 999], so every number the environment ever shows is one of the words ``0 .. 999``. The model is meant to
call ``calc(a, op, b)`` once per operation (the chain gives an ordered rubric: item ``k`` takes the result
of item ``k - 1`` as its first argument), then ``answer`` the final value.

Arguments are parsed as plain ASCII digit strings with ``int()``; model text is never evaluated.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np

from rail.envs.base import (ERR_ANSWER_ARITY, ERR_MALFORMED, ERR_TOOL, Action, ProceduralEnv, RubricItem,
                            Step, Task, words)
from rail.envs.toolcalls import function_schema

OPS = ("+", "-", "*")
OP_WORDS = {"+": "add", "-": "subtract", "*": "multiply by"}
MAX_VALUE = 999

ERR_CALC_ARGS = "error : calc takes a number , an operator and a number"
ERR_RANGE = "error : out of range"
ERRORS = (ERR_CALC_ARGS, ERR_RANGE, ERR_ANSWER_ARITY, ERR_TOOL, ERR_MALFORMED)

SYSTEM_PROMPT = ("you are a calculator agent . call calc ( number , operator , number ) for each operation , "
                 "then answer ( number ) .")

#: Fixed words of the prompt, evidence and rubric descriptions (everything that is not a number or operator).
_TEMPLATE_WORDS = "start with add subtract multiply by what is the result answer ( ) , . ? : - >"

_DIGITS = re.compile(r"\d+", re.ASCII)


def apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def parse_number(text: str) -> int | None:
    """A non-negative integer from ASCII digits (leading zeros allowed), else ``None``.

    Values above 999 come back as 1000: they are out of range either way, and a huge digit string is never
    handed to ``int()`` (which refuses more than a few thousand digits).
    """
    if not _DIGITS.fullmatch(text):
        return None
    text = text.lstrip("0") or "0"
    return int(text) if len(text) <= 3 else MAX_VALUE + 1


class CalcEnv(ProceduralEnv):
    """Apply ``level`` operations to a start value with ``calc(a, op, b)``, then ``answer``."""

    name = "calc"
    tool = "calc"
    levels = (1, 2, 3, 4, 5, 6, 7, 8)

    def __init__(self, seed: int = 0):
        self.seed = seed

    # ----------------------------------------------------------------- tasks
    def _task(self, start: int, ops: Sequence[tuple[str, int]]) -> Task:
        """Build the task for a start value and an operation chain: prompt, rubric, action guide."""
        key = f"{self.name}:{start}:" + "".join(f"{op}{b}" for op, b in ops)
        prompt = f"start with {start}" + "".join(f" , {OP_WORDS[op]} {b}" for op, b in ops)
        prompt += " . what is the result ?"
        rubric, guide, cur = [], [], start
        for op, b in ops:
            nxt = apply(cur, op, b)
            act = Action("calc", (str(cur), op, str(b)))
            rubric.append(RubricItem(f"{act.render()} -> {nxt}", "call", act, str(nxt), f"{cur} {op} {b} is {nxt}"))
            guide.append(act)
            cur = nxt
        final = Action("answer", (str(cur),))
        rubric.append(RubricItem(final.render(), "answer", final, None, f"the answer is {cur}"))
        guide.append(final)
        return Task(key, self.name, len(ops), prompt, str(cur), tuple(rubric), tuple(guide))

    def _draw(self, rng: np.random.Generator, level: int) -> Task:
        start = int(rng.integers(1, 21))
        cur, ops = start, []
        for _ in range(level):
            while True:  # terminates: from any value in [0, 999] either + or - of some operand stays in range
                op, b = OPS[int(rng.integers(len(OPS)))], int(rng.integers(1, 10))
                if 0 <= apply(cur, op, b) <= MAX_VALUE:
                    break
            ops.append((op, b))
            cur = apply(cur, op, b)
        return self._task(start, ops)

    # ----------------------------------------------------------------- tools
    def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def tools(self) -> list[dict]:
        return [
            function_schema("calc", "Apply one arithmetic operation; returns the result (0 to 999).",
                            [("a", "integer", "the left operand"), ("op", "string", "the operator"),
                             ("b", "integer", "the right operand")], enums={"op": OPS}),
            function_schema("answer", "Give the final answer and end the episode.",
                            [("number", "integer", "the final value")]),
        ]

    def _call(self, task: Task, action: Action) -> tuple[str, bool, bool]:
        parsed = self._operands(action)
        if parsed is None:
            return ERR_CALC_ARGS, False, False
        a, op, b = parsed
        if a > MAX_VALUE or b > MAX_VALUE:
            return ERR_RANGE, False, False
        result = apply(a, op, b)
        if not 0 <= result <= MAX_VALUE:
            return ERR_RANGE, False, False
        return str(result), True, False

    @staticmethod
    def _operands(action: Action) -> tuple[int, str, int] | None:
        """``(a, op, b)`` of a ``calc`` call with well-formed arguments, else ``None``."""
        if len(action.args) != 3:
            return None
        a, op, b = parse_number(action.args[0]), action.args[1], parse_number(action.args[2])
        if a is None or b is None or op not in OPS:
            return None
        return a, op, b

    # ----------------------------------------------------------------- scoring
    def item_holds(self, task: Task, item: RubricItem, step: Step) -> bool:
        """A call item holds for a successful ``calc`` with the same values (``+`` and ``*`` either way round;
        operands compared as integers, so ``calc(07, +, 2)`` counts for ``calc(7, +, 2)``). The answer item
        holds for an answer equal to it as text, like :meth:`reward`."""
        a = step.action
        if a is None:
            return False
        if item.kind == "answer":
            return a.tool == "answer" and len(a.args) == 1 and a.args[0].strip() == item.action.args[0]
        if not step.ok or a.tool != "calc":
            return False
        got, want = self._operands(a), self._operands(item.action)
        if got is None or want is None or got[1] != want[1]:
            return False
        return got == want or (want[1] in "+*" and (got[2], got[1], got[0]) == want)

    def vocabulary(self) -> list[str]:
        """Numbers 0..999, operators, tool names, and every fixed word of prompts, evidence and errors."""
        fixed = words(" ".join([SYSTEM_PROMPT, _TEMPLATE_WORDS, *ERRORS]))
        return sorted({*fixed, *(str(i) for i in range(MAX_VALUE + 1)), *OPS, "calc", "answer"})
