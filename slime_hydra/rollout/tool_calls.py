"""A model's tool-call text -> OpenAI ``tool_calls``, by model family (``rollout.tool_parser``):

- ``qwen3`` (Qwen2.5/3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- ``glm4`` (GLM-4.5/4.6): ``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>``, or
  (GLM-4-0414) ``<tool_call>name\n{...}</tool_call>``;
- ``llama3`` (Llama 3.1-3.3): ``<|python_tag|>`` or a bare ``{"name": ..., "parameters": {...}}`` turn;
- ``calc``: the built-in ``builtin:calc`` tokenizer's ``<call>expression`` (examples/calculator);
- ``none``: no tool calls.

On the SGLang engine the same families go through SGLang's own ``FunctionCallParser`` (:data:`SGLANG_NAMES`).
A parser returns ``(content, [(name, arguments dict)])``.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

Call = Tuple[str, Dict[str, Any]]
Parsed = Tuple[str, List[Call]]
SGLANG_NAMES = {"qwen3": "qwen25", "glm4": "glm45", "llama3": "llama3"}


def _json_calls(blocks: List[str], args_key: str) -> List[Call]:
    calls = []
    for b in blocks:
        try:
            d = json.loads(b)
        except json.JSONDecodeError:
            continue  # not a call: the text stays in the content
        if isinstance(d, dict) and isinstance(d.get("name"), str):
            args = d.get(args_key, d.get("arguments", {}))
            calls.append((d["name"], json.loads(args) if isinstance(args, str) else args or {}))
    return calls


def qwen3(text: str) -> Parsed:
    blocks = re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, flags=re.S)
    return re.sub(r"\s*<tool_call>.*?</tool_call>", "", text, flags=re.S).strip(), _json_calls(blocks, "arguments")


def glm4(text: str) -> Parsed:
    calls = []
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, flags=re.S):
        name, _, rest = body.partition("<arg_key>")
        if not rest and "{" in name:  # GLM-4-0414: name, a newline, JSON arguments
            head, _, args = name.partition("{")
            with contextlib.suppress(json.JSONDecodeError):
                calls.append((head.strip(), json.loads("{" + args)))
            continue
        pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", "<arg_key>" + rest, flags=re.S)
        args = {}
        for k, v in pairs:
            try:
                args[k.strip()] = json.loads(v)
            except json.JSONDecodeError:
                args[k.strip()] = v
        calls.append((name.strip(), args))
    return re.sub(r"\s*<tool_call>.*?</tool_call>", "", text, flags=re.S).strip(), calls


def llama3(text: str) -> Parsed:
    head, tag, body = text.partition("<|python_tag|>")
    body = body if tag else text.strip()
    if not tag and not body.startswith("{"):
        return text, []
    calls = _json_calls([b for b in body.split(";") if b.strip()], "parameters")
    return (head if tag else "") if calls else text, calls


def calc(text: str) -> Parsed:
    content, *calls = text.split("<call>")
    return content, [("calculator", {"expression": c}) for c in calls]


PARSERS: Dict[str, Callable[[str], Parsed]] = {"qwen3": qwen3, "glm4": glm4, "llama3": llama3, "calc": calc,
                                               "none": lambda text: (text, [])}


def guess(chat_template: Optional[str]) -> str:
    """The parser a chat template's tool-call syntax implies."""
    t = chat_template or ""
    for marker, name in (("<arg_key>", "glm4"), ("<tool_call>", "qwen3"), ("<|python_tag|>", "llama3"),
                         ("<call>", "calc")):
        if marker in t:
            return name
    return "none"


def sglang_parser(name: str, tools: List[Dict[str, Any]]) -> Callable[[str], Parsed]:
    """SGLang's own parser for family ``name`` (sglang must be installed)."""
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    parser = FunctionCallParser([Tool.model_validate(t) for t in tools], SGLANG_NAMES[name])

    def parse(text: str) -> Parsed:
        if not parser.has_tool_call(text):
            return text, []
        content, calls = parser.parse_non_stream(text)
        return content, [(c.name, json.loads(c.parameters or "{}")) for c in calls]

    return parse
