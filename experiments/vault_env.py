# A held-out check of the claim testbed: an environment with a reachability boundary written outside the package,
# against the protocol in docs/environments.md only (no base class), the way a user would write one; its one option,
# nonce_demonstrations, adds the demonstration hook kin uses for levels that differ in knowledge (it does not make
# vault read hints: docs/environments.md).
# docs/claim/README.md reports the probe and the controllers on both.
#   python experiments/probe_boundary.py --families experiments.vault_env:VaultEnv \
#       --set 'env.families=["experiments.vault_env:VaultEnv"]' --tasks 16 --out runs/vault-probe
#   rail ablate --config experiments/ablations/claim.toml --arms none,ladder,rail --out runs/ablate-vault \
#       --set 'env.families=["experiments.vault_env:VaultEnv"]'
#   the same with guided demonstrations about nonce vaults, as kin has them:
#       --set 'env.families=["experiments.vault_env:VaultEnv"]' --set 'env.options={"experiments.vault_env:VaultEnv" = {nonce_demonstrations = true}}'
"""``vault``: open a named vault by pressing its three-button code, then ``open(vault)``.

Every vault's code is three presses out of six buttons, drawn once from the environment seed; level ``k`` asks
about the ``k``-th tier of vault names (four per tier), so levels differ in what the policy must know, never in
length. ``press`` only says ``click`` — nothing in an episode tells a wrong code from a right one until the end —
so beyond the levels the warm start demonstrates, a rollout has to guess one code in 216. A rubric hint states
the code (``the cellar code is red then blue then red``).
"""

from __future__ import annotations

import re
import zlib
from typing import Sequence

import numpy as np

from rail.envs import Action, RubricItem, Step, Task
from rail.envs.toolcalls import function_schema

BUTTONS = ("red", "blue", "green", "amber", "white", "black")
VAULTS = ("cellar", "attic", "tower", "crypt",
          "forge", "mill", "harbor", "chapel",
          "archive", "armory", "bridge", "granary",
          "garden", "stable", "kitchen", "library",
          "gate", "well", "barn", "loft",
          "dock", "keep", "hall", "yard")
PER_LEVEL = 4
#: Vault names only guided warm-start demonstrations use (``nonce_demonstrations``), each time with a fresh code.
NONCE_VAULTS = ("blick", "dax", "wug", "fep", "toma", "zup")
SYSTEM_PROMPT = ("you open vaults . a vault opens with a code of three buttons . call press ( button ) for each "
                 "button of the code , then open ( vault ) .")


class VaultEnv:
    """``open the <vault> of house <n>``: three ``press`` calls (the vault's code), then ``open(<vault>)``."""

    name = "vault"
    levels = (1, 2, 3, 4, 5, 6)

    def __init__(self, seed: int = 0, houses: int = 100, nonce_demonstrations: bool = False):
        if houses < 10:
            raise ValueError(f"vault: houses = {houses}: at least 10, so every level has held-out tasks")
        self.seed, self.houses, self.nonce = seed, houses, bool(nonce_demonstrations)
        rng = np.random.default_rng([seed, 777])
        self.codes = {v: tuple(BUTTONS[int(i)] for i in rng.integers(len(BUTTONS), size=3)) for v in VAULTS}

    # --------------------------------------------------------------- what the model sees
    def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def tools(self) -> list[dict]:
        return [function_schema("press", "Press one button of the vault's code.", [("button", "string", "a button")],
                                enums={"button": list(BUTTONS)}),
                function_schema("open", "Try to open the vault and end the episode.",
                                [("vault", "string", "the vault's name")])]

    def vocabulary(self) -> list[str]:
        fixed = "open the of house which is code then click error unknown button tool malformed call : ."
        text = " ".join([SYSTEM_PROMPT, fixed, *BUTTONS, *VAULTS, *NONCE_VAULTS, *map(str, range(self.houses))])
        return sorted(set(re.findall(r"\w+|[^\w\s]", text)))

    # --------------------------------------------------------------- tasks
    def _task(self, vault: str, house: int, level: int, code: tuple[str, ...] | None = None) -> Task:
        code = code or self.codes[vault]
        evidence = f"the {vault} code is " + " then ".join(code)
        rubric = tuple(RubricItem(f"press({b}) #{i + 1}", "call", Action("press", (b,)), "click", evidence)
                       for i, b in enumerate(code))
        rubric += (RubricItem(f"open({vault})", "answer", Action("open", (vault,)), None, evidence),)
        return Task(id=f"vault:{vault}:{house}", family=self.name, level=level,
                    prompt=f"open the {vault} of house {house} .", answer=vault, rubric=rubric,
                    action_guide=tuple(item.action for item in rubric))

    def demonstration_task(self, rng: np.random.Generator, levels: Sequence[int], guided: bool) -> Task:
        """With ``nonce_demonstrations``, a guided warm-start demonstration opens a nonce vault with a code drawn
        afresh, so it teaches reading the hint and no level's codes (docs/environments.md); otherwise a training
        task of ``levels``, as without this method."""
        if not (guided and self.nonce):
            return self.sample_tasks(rng, levels, 1)[0]
        vault = NONCE_VAULTS[int(rng.integers(len(NONCE_VAULTS)))]
        code = tuple(BUTTONS[int(i)] for i in rng.integers(len(BUTTONS), size=3))
        return self._task(vault, int(rng.integers(self.houses)), 0, code)

    @staticmethod
    def held_out(task: Task) -> bool:
        return zlib.crc32(task.id.encode()) % 5 == 0

    def _draw(self, rng: np.random.Generator, level: int) -> Task:
        if level not in self.levels:
            raise ValueError(f"vault: level {level} not in {self.levels}")
        tier = VAULTS[PER_LEVEL * (level - 1): PER_LEVEL * level]
        return self._task(tier[int(rng.integers(len(tier)))], int(rng.integers(self.houses)), level)

    def sample_tasks(self, rng: np.random.Generator, levels: Sequence[int], n: int) -> list[Task]:
        out = []
        while len(out) < n:
            task = self._draw(rng, int(levels[int(rng.integers(len(levels)))]))
            if not self.held_out(task):
                out.append(task)
        return out

    def eval_tasks(self, level: int, n: int) -> list[Task]:
        rng, out, seen = np.random.default_rng([self.seed, level, 5]), [], set()
        for _ in range(1000 * max(n, 1)):
            task = self._draw(rng, level)
            if self.held_out(task) and task.id not in seen:
                seen.add(task.id)
                out.append(task)
                if len(out) == n:
                    break
        return out

    # --------------------------------------------------------------- tools and scoring
    def execute(self, task: Task, action: Action | None) -> tuple[str, bool, bool]:
        if action is None:
            return "error : malformed call", False, False
        if action.tool == "open" and len(action.args) == 1:
            return "", True, True
        if action.tool == "press" and len(action.args) == 1:
            if action.args[0].strip() in BUTTONS:
                return "click", True, False
            return "error : unknown button", False, False
        return "error : unknown tool", False, False

    def reward(self, task: Task, steps: Sequence[Step]) -> float:
        presses = [s.action.args[0].strip() for s in steps
                   if s.action is not None and s.action.tool == "press" and s.ok]
        last = steps[-1] if steps else None
        opened = (last is not None and last.done and last.action is not None and last.action.tool == "open"
                  and last.action.args[0].strip() == task.answer)
        code = tuple(item.action.args[0] for item in task.rubric if item.action.tool == "press")  # also a nonce vault's
        return 1.0 if opened and tuple(presses) == code else 0.0

    def item_holds(self, task: Task, item: RubricItem, step: Step) -> bool:
        a = step.action
        if a is None or a.tool != item.action.tool or len(a.args) != 1:
            return False
        return a.args[0].strip() == item.action.args[0] and (item.kind == "answer" or step.ok)
