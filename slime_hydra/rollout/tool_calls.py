"""A model's tool-call text -> OpenAI ``tool_calls``, by model family (``rollout.tool_parser``):

- ``qwen3`` (Qwen2.5/3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- ``glm4`` (GLM-4.5/4.6): ``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>``, or
  (GLM-4-0414) ``<tool_call>name\n{...}</tool_call>``;
- ``llama3`` (Llama 3.1-3.3): ``<|python_tag|>`` or a bare ``{"name": ..., "parameters": {...}}`` turn;
- ``calc``: the built-in ``builtin:calc`` tokenizer's ``<call>expression`` (examples/calculator);
- ``none``: no tool calls.

On the SGLang engine the same families go through SGLang's own ``FunctionCallParser`` (:data:`SGLANG_NAMES`).
A parser takes the text and the request's ``tools`` and returns ``(content, [(name, arguments dict)])``. As
SGLang's server does: the content is the text before the calls (for llama3, and after them), a call to a function
the request does not offer is dropped, and GLM's arguments are typed by the tools' schemas (without ``tools``: every
call is kept, and an argument is JSON where it parses). tests/rollout/test_tool_calls_sglang.py compares the two.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

Call = Tuple[str, Dict[str, Any]]
Parsed = Tuple[str, List[Call]]
Tools = Optional[List[Dict[str, Any]]]  # the request's OpenAI ``tools``
SGLANG_NAMES = {"qwen3": "qwen25", "glm4": "glm45", "llama3": "llama3"}


def _offered(calls: List[Call], tools: Tools) -> List[Call]:
    """The calls to functions the request offers (SGLang drops the others); all of them without ``tools``."""
    if tools is None:
        return calls
    names = {(t.get("function") or {}).get("name") for t in tools}
    return [c for c in calls if c[0] in names]


def _json_calls(objs: List[Any], args_key: str) -> List[Call]:
    calls = []
    for d in objs:
        if isinstance(d, dict) and isinstance(d.get("name"), str):
            args = d.get(args_key) or d.get("arguments") or {}
            with contextlib.suppress(json.JSONDecodeError):  # arguments that are no JSON: not a call
                args = json.loads(args) if isinstance(args, str) else args
                if isinstance(args, dict):
                    calls.append((d["name"], args))
    return calls


def _tagged(text: str, calls: List[Call], tools: Tools) -> Parsed:
    """A reply with ``<tool_call>...</tool_call>`` blocks: as SGLang's, its content is the text before the first
    block (what follows is dropped), without one it is all content."""
    first = re.search(r"<tool_call>.*?</tool_call>", text, flags=re.S)
    return (text, []) if first is None else (text[: first.start()].strip(), _offered(calls, tools))


def qwen3(text: str, tools: Tools = None) -> Parsed:
    objs = []
    for block in re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, flags=re.S):
        with contextlib.suppress(json.JSONDecodeError):  # not a call
            objs.append(json.loads(block))
    return _tagged(text, _json_calls(objs, "arguments"), tools)


def _is_string(schema: Any) -> bool:
    """Whether a parameter's JSON schema makes it a string (SGLang's reading: a union with a string is one)."""
    if not isinstance(schema, dict):
        return False
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), "string")
    if t is not None:
        return t == "string"
    if isinstance(schema.get("enum"), list):  # values of one type give it, mixed ones a string
        types = {type(v) for v in schema["enum"]}
        return len(types) != 1 or str in types
    return any(_is_string(s) for s in schema.get("anyOf") or schema.get("oneOf") or [])


def _glm_value(raw: str, string: bool) -> Any:
    """GLM's templates write a string argument as it is and any other as JSON: a string parameter's ``4``,
    ``true`` or ``3.10`` is that text (a JSON string literal is decoded)."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    return raw if string and not isinstance(value, str) else value


def glm4(text: str, tools: Tools = None) -> Parsed:
    schemas = {(t.get("function") or {}).get("name"): ((t.get("function") or {}).get("parameters") or {})
               for t in tools or []}
    calls = []
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, flags=re.S):
        name, _, rest = body.partition("<arg_key>")
        if not rest and "{" in name:  # GLM-4-0414: name, a newline, JSON arguments
            head, _, args = name.partition("{")
            with contextlib.suppress(json.JSONDecodeError):
                calls.append((head.strip(), json.loads("{" + args)))
            continue
        name = name.strip()
        props = (schemas.get(name) or {}).get("properties") or {}
        pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", "<arg_key>" + rest, flags=re.S)
        calls.append((name, {k.strip(): _glm_value(v, _is_string(props.get(k.strip()))) for k, v in pairs}))
    return _tagged(text, calls, tools)


def llama3(text: str, tools: Tools = None) -> Parsed:
    """``<|python_tag|>`` (or a turn that starts with ``{``) and JSON calls separated by ``;``; the content is
    the text before the tag and after the calls."""
    head, tag, body = text.partition("<|python_tag|>")
    if not tag:
        head, body = "", text.lstrip()
        if not body.startswith("{"):
            return text, []
    objs, i, decoder = [], 0, json.JSONDecoder()
    while True:
        while i < len(body) and (body[i] == ";" or body[i].isspace()):
            i += 1
        try:
            obj, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            break
        objs.append(obj)
    calls = _json_calls(objs, "parameters")
    return (head + body[i:].strip(), _offered(calls, tools)) if calls else (text, [])


def calc(text: str, tools: Tools = None) -> Parsed:
    content, *calls = text.split("<call>")
    return content, [("calculator", {"expression": c}) for c in calls]


PARSERS: Dict[str, Callable[..., Parsed]] = {"qwen3": qwen3, "glm4": glm4, "llama3": llama3, "calc": calc,
                                             "none": lambda text, tools=None: (text, [])}


def guess(chat_template: Optional[str]) -> str:
    """The parser a chat template's tool-call syntax implies."""
    t = chat_template or ""
    for marker, name in (("<arg_key>", "glm4"), ("<tool_call>", "qwen3"), ("<|python_tag|>", "llama3"),
                         ("<call>", "calc")):
        if marker in t:
            return name
    return "none"


def _decoded(args: Any) -> Any:
    """Arguments the model wrote as a JSON string, which SGLang passes on as that string: the object in it."""
    with contextlib.suppress(json.JSONDecodeError, TypeError):
        return json.loads(args) if isinstance(args, str) else args
    return args


def sglang_parser(name: str, tools: List[Dict[str, Any]]) -> Callable[[str], Parsed]:
    """SGLang's own parser for family ``name`` (sglang must be installed)."""
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    parser = FunctionCallParser([Tool.model_validate(t) for t in tools], SGLANG_NAMES[name])

    def parse(text: str) -> Parsed:
        if not parser.has_tool_call(text):
            return text, []
        try:
            content, calls = parser.parse_non_stream(text)
        except Exception:  # SGLang's server answers a parser error with the text and no calls
            return text, []
        return content, [(c.name, _decoded(json.loads(c.parameters or "{}"))) for c in calls]

    return parse
