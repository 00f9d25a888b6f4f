"""A calculator agent written for the OpenAI SDK alone: nothing here knows slime_hydra trains it.

    python run.py experiment=calculator_agent

``run(client, sample)`` is ``rollout.agent``: it talks to the model through the ``openai.AsyncOpenAI`` client it
is handed (a first parameter named ``base_url`` gets the URL instead), runs the calculator when the model calls
it, and returns its own reward. The task (``data.task=calc``): the prompt is an expression whose value is one
digit, e.g. ``37*48-1772`` (= 4); the tiny model cannot multiply, so it must call the calculator and copy its
result. The tiny model's tool-call syntax is one token, ``<call>`` (tokenizer ``builtin:calc``, tool parser
``calc``): a call without an expression means "the user's expression". The reward is 1 for the right final
answer after a calculator call (guessing a digit would otherwise pay one time in ten).
"""

from __future__ import annotations

import ast
import json
from typing import Any

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an integer expression with + - * %; without an expression, the user's.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": []},
    },
}]
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Mod: lambda a, b: a % b}


def calculate(expression: str) -> str:
    """The tool: an integer expression of + - * % -> its value, or "?" if it is not one."""
    if not expression or len(expression) > 64 or set(expression) - set("0123456789+-*%"):
        return "?"

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(node)

    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return "?"
    return str(value) if abs(value) < 10**12 else "?"


async def run(client: Any, sample: dict, max_turns: int = 3, turn_max_tokens: int = 1) -> float:
    """Model turn; if it called the calculator, the results as tool messages and another turn; at most
    ``max_turns``. 1.0 for the right final answer after a call, else 0.0."""
    question = sample["prompt"]
    messages = [{"role": "user", "content": question}]
    called = False
    for _ in range(max_turns):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                     max_tokens=turn_max_tokens)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return float(called and (msg.content or "").strip() == str(sample["label"]))
        called = True
        for call in msg.tool_calls:
            expression = json.loads(call.function.arguments or "{}").get("expression") or question
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
    return 0.0
