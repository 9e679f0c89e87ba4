"""Tool schemas and the tool-call formats models write: parse a turn's text into an :class:`Action`, render an
action the way the model writes it.

Environments describe their tools as JSON schemas in the OpenAI function format (``{"type": "function",
"function": {"name", "description", "parameters": {"type": "object", "properties", "required"}}}``); the chat
template lists them (``apply_chat_template(..., tools=...)``), and the formats below check calls against them.
``rollout.tool_format`` picks the format (an explicit name -> implementation dict, :data:`FORMATS`):

- ``builtin`` -- ``name(arg, ...)``, the built-in model's grammar (:func:`rail.envs.actions.parse_action`);
- ``hermes`` -- ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the Qwen2.5 / Qwen3 / Hermes format;
- ``json`` -- the whole turn is one bare JSON object ``{"name": ..., "arguments": {...}}``.

Parsing uses :func:`json.loads` and :mod:`ast` (literals only) and nothing else; nothing a model writes is ever
evaluated. A turn that is not exactly one well-formed call of a listed tool, with every required argument of the
declared type and no other, parses to ``None``, which the environment turns into an error observation.

An environment with ``named_arguments`` (``bfcl``) gets :meth:`Action.named` calls instead: any tool name and an
object of JSON values, checked against the schema by the environment (:func:`check_arguments`), so a call to a
wrong tool or with a wrong argument is a tool error, as in the benchmark's own harness. Its ``builtin`` format is
Python call syntax with literal arguments, ``cd(folder='docs')`` (:func:`parse_python_call`).
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Protocol, Sequence

from rail.envs.actions import Action, parse_action

#: JSON-schema types an argument may declare, and the Python values a parsed call may carry for each.
_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
          "object": (dict,)}


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
    """The JSON arguments of ``action``: its named arguments, or its positional ones named by its tool's schema
    and typed as it declares (an ``integer`` argument that is a digit string becomes an int)."""
    if action.kwargs or not action.args:
        return action.arguments
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
        elif spec["type"] == "boolean" and value in ("true", "false"):
            out[pname] = value == "true"
        else:
            out[pname] = value
    return out


def _type_ok(value: Any, spec: dict) -> bool:
    """Whether ``value`` has the JSON-schema type ``spec`` declares (and, for an array, its items' type)."""
    ok = _TYPES.get(spec.get("type", "string"))
    if ok is None:  # a type this checker does not know: any JSON value
        return True
    if isinstance(value, bool) and bool not in ok:  # True is an int in Python, not in JSON schema
        return False
    if not isinstance(value, ok) or (isinstance(value, float) and not math.isfinite(value)):
        return False
    items = spec.get("items")
    return not (isinstance(value, list) and isinstance(items, dict) and "type" in items
                and not all(_type_ok(v, items) for v in value))


def check_arguments(arguments: dict, schema: dict) -> str | None:
    """Why named ``arguments`` do not fit a tool's ``schema`` (OpenAI function format, or its ``function``
    part), or ``None`` when they do: an unknown or missing argument, or one of the wrong type."""
    fn = schema.get("function", schema)
    params = fn.get("parameters", {})
    props = params.get("properties", {})
    unknown = [k for k in arguments if k not in props]
    if unknown:
        return f"{fn['name']}() got unexpected argument(s) {', '.join(unknown)}; it takes {', '.join(props) or 'none'}"
    missing = [k for k in params.get("required", []) if k not in arguments]
    if missing:
        return f"{fn['name']}() is missing required argument(s) {', '.join(missing)}"
    for k, v in arguments.items():
        if not _type_ok(v, props[k]):
            return f"{fn['name']}(): argument {k} must be of type {props[k].get('type')}, got {json.dumps(v)[:80]}"
    return None


def _named_call(name: Any, arguments: Any) -> Action | None:
    """A named call of any tool: the environment checks the tool and the arguments against its schemas."""
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    try:
        return Action.named(name, arguments)
    except ValueError:
        return None


def action_from_call(name: Any, arguments: Any, schemas: Sequence[dict], named: bool = False) -> Action | None:
    """Check a JSON call against the schemas; the positional :class:`Action`, or ``None`` when the tool is not
    listed, an argument is missing, unknown or of the wrong type. ``named``: a named action of any tool whose
    arguments are a JSON object, left to the environment to check."""
    if isinstance(arguments, str):  # OpenAI-style: the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if named:
        return _named_call(name, arguments)
    if not isinstance(name, str):
        return None
    fn = _functions(schemas).get(name)
    if fn is None:
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


def _load_call(body: str, schemas: Sequence[dict], named: bool = False) -> Action | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or set(obj) - {"name", "arguments"}:
        return None
    return action_from_call(obj.get("name"), obj.get("arguments", {}), schemas, named)


def literal_value(node: ast.AST) -> Any:
    """A JSON value from a literal expression node (tuples become lists); ValueError for anything else: a name,
    a call, an attribute, an operator other than a sign. ``ast.literal_eval`` builds the value, evaluating nothing."""
    value = ast.literal_eval(node)

    def js(v):
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            if not math.isfinite(v):
                raise ValueError("not a finite number")
            return v
        if isinstance(v, (list, tuple)):
            return [js(x) for x in v]
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):
            return {k: js(x) for k, x in v.items()}
        raise ValueError(f"not a JSON value: {type(v).__name__}")
    return js(value)


def parse_python_call(text: str, schemas: Sequence[dict]) -> Action | None:
    """One call in Python syntax, ``name(key=literal, ...)`` (also ``[name(...)]``, BFCL's list form), as a named
    :class:`Action`; ``None`` for anything else. The text is parsed with :mod:`ast` and only literal arguments
    are read: ``f(x=__import__('os').system('...'))`` is not a call, and nothing is ever evaluated. Positional
    arguments are named in the order the tool's schema lists its parameters."""
    if len(text) > 100_000:
        return None
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if isinstance(node, ast.List) and len(node.elts) == 1:
        node = node.elts[0]
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return None
    name = node.func.id
    try:
        arguments = {}
        if node.args:
            fn = _functions(schemas).get(name)
            names = list(fn["parameters"]["properties"]) if fn else []
            if len(node.args) > len(names):
                return None
            arguments.update({k: literal_value(a) for k, a in zip(names, node.args)})
        for kw in node.keywords:
            if kw.arg is None or kw.arg in arguments:  # **kwargs, or an argument given twice
                return None
            arguments[kw.arg] = literal_value(kw.value)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None
    return _named_call(name, arguments)


class ToolFormat(Protocol):
    name: str

    def render(self, action: Action, schemas: Sequence[dict]) -> str:
        """The assistant turn's text that makes this call, as the model writes it."""

    def inline(self, action: Action, schemas: Sequence[dict]) -> str:
        """The call as listed inside other text (a plan of reference actions)."""

    def parse(self, text: str, schemas: Sequence[dict], named: bool = False) -> Action | None:
        """The one call an assistant turn makes, or ``None`` when it is not exactly one well-formed call
        (``named``: a named call, :func:`action_from_call`)."""


class BuiltinFormat:
    """``name(arg, ...)``: the built-in model's grammar; arity and values are the environment's to check. Named
    calls are Python call syntax with literal arguments (:func:`parse_python_call`)."""

    name = "builtin"

    def render(self, action: Action, schemas: Sequence[dict]) -> str:
        return action.render()

    inline = render

    def parse(self, text: str, schemas: Sequence[dict], named: bool = False) -> Action | None:
        return parse_python_call(text, schemas) if named else parse_action(text)


class JsonFormat:
    """The whole turn is one JSON object ``{"name": ..., "arguments": {...}}`` (surrounding whitespace allowed)."""

    name = "json"

    def render(self, action: Action, schemas: Sequence[dict]) -> str:
        return json.dumps({"name": action.tool, "arguments": arguments_of(action, schemas)})

    inline = render

    def parse(self, text: str, schemas: Sequence[dict], named: bool = False) -> Action | None:
        return _load_call(text.strip(), schemas, named)


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


class HermesFormat:
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen2.5, Qwen3, Hermes). Text around the
    block (the model thinking aloud) is allowed; a turn with no block, or with more than one, is not a call."""

    name = "hermes"

    def render(self, action: Action, schemas: Sequence[dict]) -> str:
        return f"<tool_call>\n{JsonFormat().render(action, schemas)}\n</tool_call>"

    def inline(self, action: Action, schemas: Sequence[dict]) -> str:
        return JsonFormat().render(action, schemas)

    def parse(self, text: str, schemas: Sequence[dict], named: bool = False) -> Action | None:
        blocks = _HERMES.findall(text)
        if len(blocks) != 1:
            return None
        return _load_call(blocks[0].strip(), schemas, named)


FORMATS: dict[str, ToolFormat] = {"builtin": BuiltinFormat(), "hermes": HermesFormat(), "json": JsonFormat()}


def get_format(name: str) -> ToolFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown tool format {name!r}; one of {', '.join(FORMATS)}")
    return FORMATS[name]
