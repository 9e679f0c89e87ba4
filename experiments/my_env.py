# A worked example of an environment defined outside the package (docs/environments.md walks through it): `cipher`,
# decode a word letter by letter under a seeded substitution cipher, then answer the plain word. RAIL finds it by
# its import path; every method of the environment protocol is here, written out from scratch.
# Run (from the repository root):
#   rail train --preset smoke --set 'env.families=["experiments.my_env:CipherEnv"]'
#   rail train --preset smoke --config experiments/my_env.toml      # the same, with an option (alphabet = 10)
"""``cipher``: decode a word with ``decode(letter)``, one call per letter, then ``answer(word)``."""

from __future__ import annotations

import re
import zlib
from typing import Sequence

import numpy as np

from rail.envs import Action, RubricItem, Step, Task
from rail.envs.toolcalls import function_schema

LETTERS = "abcdefghijklmnop"
SYSTEM_PROMPT = "you decode words . call decode ( letter ) for each letter , then answer ( word ) ."


class CipherEnv:
    """Level ``L``: a cipher word of ``L`` letters. ``decode(x)`` returns the plain letter of ``x``; the answer is
    the plain word, its letters separated by spaces (``answer(b a d)``). Rubric: one item per letter, in order,
    then the answer; action guide: the decode calls, then the answer."""

    name = "cipher"
    levels = (1, 2, 3, 4, 5, 6, 7, 8)

    def __init__(self, seed: int = 0, alphabet: int = 12):
        if not 2 <= alphabet <= len(LETTERS):
            raise ValueError(f"cipher: alphabet = {alphabet}: between 2 and {len(LETTERS)}")
        self.seed, self.letters = seed, LETTERS[:alphabet]
        perm = np.random.default_rng(seed).permutation(alphabet)  # the world: fixed by the environment seed
        self.plain = {c: self.letters[int(p)] for c, p in zip(self.letters, perm)}

    # --------------------------------------------------------------- what the model sees
    def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def tools(self) -> list[dict]:
        return [function_schema("decode", "The plain letter of a cipher letter.", [("letter", "string", "a cipher letter")],
                                enums={"letter": list(self.letters)}),
                function_schema("answer", "Give the plain word and end the episode.",
                                [("word", "string", "its letters separated by spaces")])]

    def vocabulary(self) -> list[str]:
        """Every word the built-in word-level model must read or write here (punctuation is a word of its own)."""
        fixed = "decode the word : answer ( ) , . error unknown letter tool malformed call letter is"
        return sorted(set(re.findall(r"\w+|[^\w\s]", f"{SYSTEM_PROMPT} {fixed}")) | set(self.letters))

    # --------------------------------------------------------------- tasks
    def _task(self, cipher: Sequence[str]) -> Task:
        plain = [self.plain[c] for c in cipher]
        rubric = tuple(RubricItem(f"decode({c}) -> {p}", "call", Action("decode", (c,)), p, f"the letter {c} is {p}")
                       for c, p in zip(cipher, plain))
        answer = " ".join(plain)
        rubric += (RubricItem(f"answer({answer})", "answer", Action("answer", (answer,)), None,
                              f"the word is {answer}"),)
        return Task(id=f"cipher:{''.join(cipher)}", family=self.name, level=len(cipher),
                    prompt=f"decode the word : {' '.join(cipher)}", answer=answer, rubric=rubric,
                    action_guide=tuple(item.action for item in rubric))

    @staticmethod
    def held_out(task: Task) -> bool:
        """A fixed fifth of all words, whatever the seed or the order tasks are drawn in."""
        return zlib.crc32(task.id.encode()) % 5 == 0

    def _draw(self, rng: np.random.Generator, level: int) -> Task:
        return self._task([self.letters[int(i)] for i in rng.integers(len(self.letters), size=level)])

    def sample_tasks(self, rng: np.random.Generator, levels: Sequence[int], n: int) -> list[Task]:
        out = []
        while len(out) < n:
            task = self._draw(rng, int(levels[int(rng.integers(len(levels)))]))
            if not self.held_out(task):  # training never sees a held-out task
                out.append(task)
        return out

    def eval_tasks(self, level: int, n: int) -> list[Task]:
        """The first ``n`` distinct held-out words of ``level`` from a stream fixed by (seed, level)."""
        rng, out, seen = np.random.default_rng([self.seed, level]), [], set()
        for _ in range(1000 * n):
            task = self._draw(rng, level)
            if self.held_out(task) and task.id not in seen:
                seen.add(task.id)
                out.append(task)
                if len(out) == n:
                    break
        return out

    # --------------------------------------------------------------- tools and scoring
    def execute(self, task: Task, action: Action | None) -> tuple[str, bool, bool]:
        """``(observation, ok, done)``; bad calls are error observations, never exceptions."""
        if action is None:
            return "error : malformed call", False, False
        if action.tool == "answer" and len(action.args) == 1:
            return "", True, True
        if action.tool == "decode" and len(action.args) == 1:
            letter = action.args[0].strip()
            if letter in self.plain:
                return self.plain[letter], True, False
            return "error : unknown letter", False, False
        return "error : unknown tool", False, False

    def reward(self, task: Task, steps: Sequence[Step]) -> float:
        last = steps[-1] if steps else None
        ok = last is not None and last.done and last.action is not None and last.action.tool == "answer"
        return 1.0 if ok and " ".join(last.action.args[0].split()) == task.answer else 0.0

    def item_holds(self, task: Task, item: RubricItem, step: Step) -> bool:
        a = step.action
        if a is None or a.tool != item.action.tool:
            return False
        if item.kind == "answer":
            return len(a.args) == 1 and " ".join(a.args[0].split()) == item.action.args[0]
        return step.ok and a.args == item.action.args
