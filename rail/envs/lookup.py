"""``lookup``: multi-hop questions over a seeded synthetic knowledge graph.

The world is a table ``(entity, relation) -> entity`` over entities ``e0 .. e{n-1}`` and six relations,
drawn once from the environment seed, so every run with the same seed asks about the same world. A task of
level ``h`` names a start entity and ``h`` relations; the answer is the entity reached by following them in
order. The model can only find it by calling ``lookup`` once per hop, which gives a dense, ordered rubric:
hop ``k`` is checkable on its own, and the chain shows where a trajectory went wrong.

Every text the environment emits (prompt, system prompt, observations, evidence, errors) uses words from
:meth:`LookupEnv.vocabulary` only, with punctuation as separate words, because the built-in policy has a
word-level tokenizer built from that vocabulary.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from rail.envs.base import (ERR_ANSWER_ARITY, ERR_MALFORMED, ERR_TOOL, Action, ProceduralEnv, RubricItem,
                            Step, Task, words)
from rail.envs.toolcalls import function_schema

RELATIONS = ("mother", "father", "boss", "friend", "mentor", "neighbor")

#: Error observations, exact texts (the tests and the vocabulary depend on them).
ERR_LOOKUP_ARITY = "error : lookup takes an entity and a relation"
ERR_ENTITY = "error : unknown entity"
ERR_RELATION = "error : unknown relation"
ERRORS = (ERR_LOOKUP_ARITY, ERR_ENTITY, ERR_RELATION, ERR_ANSWER_ARITY, ERR_TOOL, ERR_MALFORMED)

SYSTEM_PROMPT = ("you are a search agent . call lookup ( entity , relation ) to follow a relation , "
                 "then answer ( entity ) .")

#: Fixed words of the prompt, evidence and rubric descriptions (everything that is not a name).
_TEMPLATE_WORDS = "start at follow then which entity do you reach the of is answer ( ) , . ? : - >"


def lookup_tools() -> list[dict]:
    """``lookup(entity, relation)`` and ``answer(entity)`` as JSON schemas (``lookup`` and ``kin`` share them)."""
    return [
        function_schema("lookup", "Follow a relation from an entity; returns the entity it leads to.",
                        [("entity", "string", "an entity name, e.g. e12"),
                         ("relation", "string", "the relation to follow")], enums={"relation": RELATIONS}),
        function_schema("answer", "Give the final answer and end the episode.",
                        [("entity", "string", "the entity the question asks for")]),
    ]


class LookupEnv(ProceduralEnv):
    """Follow ``level`` relations from a start entity with ``lookup(entity, relation)``, then ``answer``."""

    name = "lookup"
    tool = "lookup"
    levels = (1, 2, 3, 4, 5, 6, 7, 8)

    def __init__(self, seed: int = 0, n_entities: int = 240):
        if n_entities < 2:
            raise ValueError(f"n_entities = {n_entities}: need at least 2 (no entity relates to itself)")
        self.seed = seed
        self.entities = tuple(f"e{i}" for i in range(n_entities))
        self._index = {e: i for i, e in enumerate(self.entities)}
        rng = np.random.default_rng(seed)
        # Draw from the n-1 other entities and shift past the source, so no entity maps to itself.
        t = rng.integers(0, n_entities - 1, size=(n_entities, len(RELATIONS)))
        t += t >= np.arange(n_entities)[:, None]
        self._table = t

    # ----------------------------------------------------------------- the world
    def follow(self, entity: str, relation: str) -> str:
        """The target of ``relation`` from ``entity`` (both must be valid names)."""
        return self.entities[self._table[self._index[entity], RELATIONS.index(relation)]]

    # ----------------------------------------------------------------- tasks
    def chain(self, start: str, rels: Sequence[str], evidence: str | None = None):
        """``(rubric, action guide, answer)`` of following ``rels`` from ``start``: one ``lookup`` item per hop,
        then the answer. Each hop's evidence is ``evidence`` if given, else the hop's own fact."""
        rubric, guide, cur = [], [], start
        for r in rels:
            nxt = self.follow(cur, r)
            act = Action("lookup", (cur, r))
            rubric.append(RubricItem(f"{act.render()} -> {nxt}", "call", act, nxt, evidence or f"the {r} of {cur} is {nxt}"))
            guide.append(act)
            cur = nxt
        final = Action("answer", (cur,))
        rubric.append(RubricItem(f"{final.render()}", "answer", final, None, f"the answer is {cur}"))
        guide.append(final)
        return tuple(rubric), tuple(guide), cur

    def _task(self, start: str, rels: Sequence[str]) -> Task:
        """Build the task for a start entity and a relation chain: prompt, rubric, action guide."""
        key = f"{self.name}:{start}:{'.'.join(rels)}"
        prompt = f"start at {start} , follow {rels[0]}" + "".join(f" , then {r}" for r in rels[1:])
        prompt += " . which entity do you reach ?"
        rubric, guide, answer = self.chain(start, rels)
        return Task(key, self.name, len(rels), prompt, answer, rubric, guide)

    def _draw(self, rng: np.random.Generator, level: int) -> Task:
        start = self.entities[int(rng.integers(len(self.entities)))]
        rels = [RELATIONS[int(i)] for i in rng.integers(len(RELATIONS), size=level)]
        return self._task(start, rels)

    # ----------------------------------------------------------------- tools
    def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def tools(self) -> list[dict]:
        return lookup_tools()

    def _call(self, task: Task, action: Action) -> tuple[str, bool, bool]:
        if len(action.args) != 2:
            return ERR_LOOKUP_ARITY, False, False
        entity, relation = action.args
        if entity not in self._index:
            return ERR_ENTITY, False, False
        if relation not in RELATIONS:
            return ERR_RELATION, False, False
        return self.follow(entity, relation), True, False

    # ----------------------------------------------------------------- scoring
    def item_holds(self, task: Task, item: RubricItem, step: Step) -> bool:
        """A call item holds for a successful, identical lookup; the answer item for an identical answer."""
        a = step.action
        if a is None:
            return False
        if item.kind == "answer":
            return a.tool == "answer" and len(a.args) == 1 and a.args[0].strip() == item.action.args[0]
        return step.ok and a == item.action

    def vocabulary(self) -> list[str]:
        """Entity and relation names, tool names, and every fixed word of prompts, evidence and errors."""
        fixed = words(" ".join([SYSTEM_PROMPT, _TEMPLATE_WORDS, *ERRORS]))
        return sorted({*fixed, *self.entities, *RELATIONS, "lookup", "answer"})
