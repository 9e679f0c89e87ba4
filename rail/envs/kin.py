"""``kin``: named relations that are compositions of the ``lookup`` world's relations — knowledge, not length.

The world is the ``lookup`` knowledge graph of the same seed, with its one tool, ``lookup(entity, relation)``,
which knows only the six base relations. A ``kin`` task names a *derived* relation instead, e.g. ``find the
steward of e12``; every derived relation is a fixed composition of three base relations (``steward`` might be
``boss`` then ``friend`` then ``mother``), drawn once from the environment seed. So every task, at every level,
is three lookups and an answer: level ``k`` differs from level 1 only in *which* names it asks about (the
``k``-th tier of :data:`NAMES`, four per tier), never in length.

That makes the capability boundary a boundary of knowledge: the warm start demonstrates the definitions of its
own levels' names and nothing else, so beyond them a base rollout has to guess three relations out of 216
sequences and reward is all but absent — while a rubric hint states the definition (``steward is boss then
friend then mother``) and a policy that reads definitions in its context can then succeed. It is the regime
rollout-time interventions exist for: the reward is missing, the skill is short and learnable, and the help
reveals what the policy lacks.

Reading a definition in context is what a pretrained model brings; the built-in model learns it from guided
warm-start demonstrations about *nonce* names (:data:`NONCE_NAMES`, :meth:`KinEnv.demonstration_task`), whose
definitions are drawn afresh for every demonstration, so they teach reading guidance and no tier's knowledge.

Every text the environment emits uses words from :meth:`KinEnv.vocabulary` only, with punctuation as separate
words, because the built-in policy has a word-level tokenizer built from that vocabulary.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from rail.envs.base import Action, ProceduralEnv, RubricItem, Step, Task, words
from rail.envs.lookup import ERRORS, RELATIONS, LookupEnv, lookup_tools

#: The derived relation names, four per level (tier k = names[4(k-1) : 4k]). Only names: what each one means
#: is drawn from the environment seed, not taken from English.
NAMES = ("grandparent", "sibling", "cousin", "uncle",
         "patron", "rival", "ally", "deputy",
         "steward", "envoy", "herald", "squire",
         "heir", "ward", "guardian", "vassal",
         "ancestor", "successor", "predecessor", "colleague",
         "companion", "protege", "partner", "elder",
         "niece", "nephew", "godparent", "stepparent",
         "tutor", "sponsor", "landlord", "tenant")
PER_LEVEL = 4
PARTS = 3  # base relations per definition
#: Names that only guided warm-start demonstrations use, each time with a fresh random definition.
NONCE_NAMES = ("blick", "dax", "wug", "fep", "toma", "zup", "gorp", "lorp", "mib", "nerk", "quaz", "snib")

SYSTEM_PROMPT = ("you are a kin agent . a kin relation is three relations in a row . call lookup ( entity , "
                 "relation ) to follow a relation , then answer ( entity ) .")

#: Fixed words of the prompt, evidence and rubric descriptions (everything that is not a name).
_TEMPLATE_WORDS = "find the of which entity is it is then answer ( ) , . ? : - >"


class KinEnv(ProceduralEnv):
    """``find the <name> of <entity>``: three ``lookup`` calls (the name's definition), then ``answer``."""

    name = "kin"
    tool = "lookup"
    levels = (1, 2, 3, 4, 5, 6, 7, 8)

    def __init__(self, seed: int = 0, n_entities: int = 240):
        self.seed = seed
        self.world = LookupEnv(seed=seed, n_entities=n_entities)
        seqs = list(itertools.product(RELATIONS, repeat=PARTS))
        order = np.random.default_rng([seed, 4242]).permutation(len(seqs))
        # Distinct definitions for all 32 names (216 sequences exist), fixed by the seed.
        self.definitions: dict[str, tuple[str, ...]] = {n: seqs[int(order[i])] for i, n in enumerate(NAMES)}

    def names(self, level: int) -> tuple[str, ...]:
        """The derived relation names tasks of ``level`` ask about."""
        self._check_level(level)
        return NAMES[PER_LEVEL * (level - 1): PER_LEVEL * level]

    # ----------------------------------------------------------------- tasks
    def _task(self, start: str, name: str, level: int, definition: tuple[str, ...] | None = None) -> Task:
        definition = definition or self.definitions[name]
        key = f"{self.name}:{start}:{name}"
        prompt = f"find the {name} of {start} . which entity is it ?"
        evidence = f"{name} is " + " then ".join(definition)  # what a hint reveals: the whole definition
        rubric, guide, answer = self.world.chain(start, definition, evidence)
        return Task(key, self.name, level, prompt, answer, rubric, guide)

    def _start(self, rng: np.random.Generator) -> str:
        return self.world.entities[int(rng.integers(len(self.world.entities)))]

    def _draw(self, rng: np.random.Generator, level: int) -> Task:
        start = self._start(rng)
        names = self.names(level)
        return self._task(start, names[int(rng.integers(len(names)))], level)

    def demonstration_task(self, rng: np.random.Generator, levels: Sequence[int], guided: bool) -> Task:
        """A warm-start task. A guided demonstration asks about a nonce name with a definition drawn afresh
        (never a tier's): the guidance is the only way to know it, so the demonstration teaches reading guidance
        and nothing about the levels beyond the warm start."""
        if not guided:
            return super().demonstration_task(rng, levels, guided)
        start = self._start(rng)
        name = NONCE_NAMES[int(rng.integers(len(NONCE_NAMES)))]
        definition = tuple(RELATIONS[int(i)] for i in rng.integers(len(RELATIONS), size=PARTS))
        return self._task(start, name, 0, definition)

    # ----------------------------------------------------------------- tools
    def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def tools(self) -> list[dict]:
        return lookup_tools()

    def _call(self, task: Task, action: Action) -> tuple[str, bool, bool]:
        return self.world._call(task, action)

    # ----------------------------------------------------------------- scoring
    def item_holds(self, task: Task, item: RubricItem, step: Step) -> bool:
        return self.world.item_holds(task, item, step)

    def vocabulary(self) -> list[str]:
        """The lookup world's words, the derived names, and every fixed word of prompts, evidence and errors."""
        fixed = words(" ".join([SYSTEM_PROMPT, _TEMPLATE_WORDS, *ERRORS]))
        return sorted({*fixed, *self.world.vocabulary(), *NAMES, *NONCE_NAMES})
