"""A tool call as environments and tool-call formats see it: :class:`Action`, and the built-in grammar
``name(arg, ...)`` (:func:`parse_action`).

Its own module because both sides use it: the environment protocol (:mod:`rail.envs.base`, which re-exports it)
and the tool-call formats (:mod:`rail.envs.toolcalls`), which the protocol's :class:`~rail.envs.base.ToolRunner`
uses in turn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

#: A call is ``name(arg, ...)``; whitespace anywhere is tolerated because a word-level tokenizer decodes
#: ``lookup(e1, mother)`` as ``lookup ( e1 , mother )``.
_CALL = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\((.*)\)\s*$", re.S)


#: The ``tool`` of an action that is no call but a plain assistant message (its text in ``args[0]``): how a
#: reference trajectory ends its reply to one user message in an environment of several user turns.
MESSAGE = ""


@dataclass(frozen=True)
class Action:
    """One tool call: a tool name and its arguments, either positional strings (``args``, the built-in families)
    or named JSON values (``kwargs``: ``(name, JSON text)`` pairs sorted by name, for an environment with
    ``named_arguments``; build them with :meth:`named`). ``tool == MESSAGE``: no call, a plain message."""

    tool: str
    args: tuple[str, ...] = ()
    kwargs: tuple[tuple[str, str], ...] = ()

    @classmethod
    def named(cls, tool: str, arguments: dict) -> "Action":
        """A call with named arguments; values must be JSON values (ValueError otherwise, e.g. NaN or a set)."""
        try:
            kw = tuple(sorted((str(k), json.dumps(v, sort_keys=True, ensure_ascii=False, allow_nan=False))
                              for k, v in arguments.items()))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{tool}: arguments are not JSON values ({e})") from None
        return cls(tool, (), kw)

    @classmethod
    def message(cls, text: str) -> "Action":
        """A plain assistant message (no call)."""
        return cls(MESSAGE, (text,))

    @property
    def arguments(self) -> dict:
        """The named arguments as Python values (empty for a positional call)."""
        return {k: json.loads(v) for k, v in self.kwargs}

    def render(self) -> str:
        """``name(arg, ...)``; named arguments as Python literals, ``name(key='value', n=2)`` (the form BFCL's
        ground truth is written in); a message is its text."""
        if self.tool == MESSAGE:
            return self.args[0] if self.args else ""
        if self.kwargs:
            return f"{self.tool}({', '.join(f'{k}={v!r}' for k, v in self.arguments.items())})"
        return f"{self.tool}({', '.join(self.args)})"


def parse_action(text: str) -> Action | None:
    """Parse ``tool(arg, ...)`` from model text; ``None`` when it is not a well-formed call.

    Arguments may not contain parentheses or commas; nothing is evaluated.
    """
    m = _CALL.match(text)
    if m is None:
        return None
    inner = m.group(2).strip()
    if "(" in inner or ")" in inner:
        return None
    args = tuple(a.strip() for a in inner.split(",")) if inner else ()
    if any(a == "" for a in args):
        return None
    return Action(m.group(1), args)
