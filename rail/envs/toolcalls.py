"""Tool schemas and the tool-call formats models write: parse a turn's text into an :class:`Action`, render an
action the way the model writes it.

Environments describe their tools as JSON schemas in the OpenAI function format (``{"type": "function",
"function": {"name", "description", "parameters": {"type": "object", "properties", "required"}}}``); the chat
template lists them (``apply_chat_template(..., tools=...)``), and the formats below check calls against them.
``rollout.tool_format`` picks the format (an explicit name -> implementation dict, :data:`FORMATS`):

- ``builtin`` -- ``name(arg, ...)``, the built-in model's grammar (:func:`rail.envs.base.parse_action`);
- ``hermes`` -- ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the Qwen2.5 / Qwen3 / Hermes format;
- ``json`` -- the whole turn is one bare JSON object ``{"name": ..., "arguments": {...}}``.

Parsing uses :func:`json.loads` only; nothing a model writes is ever evaluated. A turn that is not exactly one
well-formed call of a listed tool, with every required argument of the declared type and no other, parses to
``None``, which the environment turns into an error observation.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Protocol, Sequence

from rail.envs.base import Action, parse_action

#: JSON-schema types an argument may declare, and the Python values a parsed call may carry for each.
_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,)}


def function_schema(name: str, description: str, params: Sequence[tuple[str, str, str]],
                    enums: dict[str, Sequence[Any]] | None = None) -> dict:
    """A tool in the OpenAI function format: ``params`` are ``(name, json type, description)``, all required,
    in the order a positional :class:`Action` lists its arguments."""
    props: dict[str, dict] = {}
    for pname, ptype, pdesc in params:
        if ptype not in _TYPES:
            raise ValueError(f"tool {name}: parameter {pname} has type {ptype!r}; one of {', '.join(_TYPES)}")
        props[pname] = {"type": ptype, "description": pdesc}
        if enums and pname in enums:
            props[pname]["enum"] = list(enums[pname])
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": [p for p, _, _ in params]}}}


def _functions(schemas: Sequence[dict]) -> dict[str, dict]:
    return {s["function"]["name"]: s["function"] for s in schemas}


def arguments_of(action: Action, schemas: Sequence[dict]) -> dict[str, Any]:
    """The JSON arguments of a positional ``action``: named by its tool's schema, typed as it declares
    (an ``integer`` argument that is a digit string becomes an int)."""
    fn = _functions(schemas).get(action.tool)
    if fn is None:
        raise ValueError(f"no schema for tool {action.tool!r}; tools: {', '.join(_functions(schemas))}")
    props = fn["parameters"]["properties"]
    if len(action.args) != len(props):
        raise ValueError(f"{action.render()}: {action.tool} takes {len(props)} arguments ({', '.join(props)})")
    out: dict[str, Any] = {}
    for (pname, spec), value in zip(props.items(), action.args):
        if spec["type"] == "integer" and re.fullmatch(r"-?\d+", value):
            out[pname] = int(value)
        elif spec["type"] == "number" and re.fullmatch(r"-?\d+(\.\d+)?", value):
            out[pname] = float(value) if "." in value else int(value)
        else:
            out[pname] = value
    return out


def action_from_call(name: Any, arguments: Any, schemas: Sequence[dict]) -> Action | None:
    """Check a JSON call against the schemas; the positional :class:`Action`, or ``None`` when the tool is not
    listed, an argument is missing, unknown or of the wrong type."""
    if not isinstance(name, str):
        return None
    fn = _functions(schemas).get(name)
    if fn is None:
        return None
    if isinstance(arguments, str):  # OpenAI-style: the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    props = fn["parameters"]["properties"]
    required = fn["parameters"].get("required", list(props))
    if set(arguments) - set(props) or set(required) - set(arguments):
        return None
    args = []
    for pname, spec in props.items():
        if pname not in arguments:
            return None  # positional actions need every argument
        v = arguments[pname]
        ok = _TYPES.get(spec.get("type", "string"), (str,))
        if isinstance(v, bool) and bool not in ok:  # True is an int in Python, not in JSON schema
            return None
        if not isinstance(v, ok) or (isinstance(v, float) and not math.isfinite(v)):
            return None
        args.append(v if isinstance(v, str) else json.dumps(v))
    return Action(name, tuple(args))


def _load_call(body: str, schemas: Sequence[dict]) -> Action | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or set(obj) - {"name", "arguments"}:
        return None
    return action_from_call(obj.get("name"), obj.get("arguments", {}), schemas)


class ToolFormat(Protocol):
    name: str

    def render(self, action: Action, schemas: Sequence[dict]) -> str:
        """The assistant turn's text that makes this call, as the model writes it."""

    def inline(self, action: Action, schemas: Sequence[dict]) -> str:
        """The call as listed inside other text (a plan of reference actions)."""

    def parse(self, text: str, schemas: Sequence[dict]) -> Action | None:
        """The one call an assistant turn makes, or ``None`` when it is not exactly one well-formed call."""


class BuiltinFormat:
    """``name(arg, ...)``: the built-in model's grammar; arity and values are the environment's to check."""

    name = "builtin"

    def render(self, action: Action, schemas: Sequence[dict]) -> str:
        return action.render()

    inline = render

    def parse(self, text: str, schemas: Sequence[dict]) -> Action | None:
        return parse_action(text)


class JsonFormat:
    """The whole turn is one JSON object ``{"name": ..., "arguments": {...}}`` (surrounding whitespace allowed)."""

    name = "json"

    def render(self, action: Action, schemas: Sequence[dict]) -> str:
        return json.dumps({"name": action.tool, "arguments": arguments_of(action, schemas)})

    inline = render

    def parse(self, text: str, schemas: Sequence[dict]) -> Action | None:
        return _load_call(text.strip(), schemas)


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


class HermesFormat:
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen2.5, Qwen3, Hermes). Text around the
    block (the model thinking aloud) is allowed; a turn with no block, or with more than one, is not a call."""

    name = "hermes"

    def render(self, action: Action, schemas: Sequence[dict]) -> str:
        return f"<tool_call>\n{JsonFormat().render(action, schemas)}\n</tool_call>"

    def inline(self, action: Action, schemas: Sequence[dict]) -> str:
        return JsonFormat().render(action, schemas)

    def parse(self, text: str, schemas: Sequence[dict]) -> Action | None:
        blocks = _HERMES.findall(text)
        if len(blocks) != 1:
            return None
        return _load_call(blocks[0].strip(), schemas)


FORMATS: dict[str, ToolFormat] = {"builtin": BuiltinFormat(), "hermes": HermesFormat(), "json": JsonFormat()}


def get_format(name: str) -> ToolFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown tool format {name!r}; one of {', '.join(FORMATS)}")
    return FORMATS[name]
