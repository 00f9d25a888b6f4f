"""A calculator agent: multi-turn tool use that the tiny random-init model learns in minutes.

    python run.py experiment=calculator_agent

The task (``data.task=calc``, tokenizer ``builtin:calc``): the prompt is an expression whose value
is one digit, e.g. ``37*48-1772`` (= 4); the tiny model cannot multiply, so it must call the
calculator and copy its result. The conversation, rendered by the tokenizer's real chat template:

    <user>37*48-1772<assistant><call><eos><tool>4<assistant>4<eos>
                    ^^^^^^ model ^^^^^     ^^^^^^^^ tool ^^^ model

The tool-call format is as short as it gets so that random sampling finds it: a turn that contains
``<call>`` is a call; the text after it is the expression, and an empty one means "the user's
expression". With ``turn_max_tokens=1`` every turn is one token (the call, then the digit); the
template's ``<eos>`` that closes a turn is then appended masked (the model did not generate it).
Tool tokens are masked, model tokens keep their log-probs (slime_hydra.rollout.multiturn).

``reward`` (``reward.type=custom``) is 1 for the right final answer, and by default only after a
calculator call (``require_tool``): the point of the example is the tool protocol, and guessing a
digit without the tool would otherwise be rewarded one time in ten.
"""

from __future__ import annotations

import ast
from typing import Any, Dict, List, Optional

from slime_hydra.data.sample import Sample
from slime_hydra.rollout.multiturn import ChatRollout, final_answer

TOOLS: List[Dict[str, Any]] = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an integer expression with + - * %; without an expression, the user's.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": []},
    },
}]
CALL, EOS = "<call>", "<eos>"
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


def parse_turn(text: str) -> Dict[str, Any]:
    """An assistant turn's text (special tokens included) -> a chat message; every ``<call>``
    starts a calculator call whose argument is the text up to the next one."""
    if text.endswith(EOS):
        text = text[: -len(EOS)]
    content, *calls = text.split(CALL)
    msg: Dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": c}}}
                             for c in calls]
    return msg


async def generate(ctx: Any, sample: Sample, sampling_params: Dict[str, Any], evaluation: bool = False, *,
                   max_turns: int = 3, turn_max_tokens: Optional[int] = None) -> Sample:
    """The agent loop: model turn; if it called the calculator, the results as tool messages
    (consecutive when it made several calls) and another model turn; at most ``max_turns``."""
    chat = ChatRollout(ctx.tokenizer, sample, tools=TOOLS, parse=parse_turn)
    question = chat.messages[0]["content"]
    while not chat.done and chat.num_turns < max_turns:
        msg = await chat.assistant_turn(ctx, sampling_params, max_new_tokens=turn_max_tokens)
        if msg is None or chat.done or not msg.get("tool_calls"):
            break
        chat.add_messages([{"role": "tool", "name": "calculator",
                            "content": calculate(c["function"]["arguments"].get("expression") or question)}
                           for c in msg["tool_calls"]])
    return chat.finish()


def reward(cfg: Any, sample: Sample, require_tool: bool = True) -> float:
    """1.0 if the conversation ends with the right answer (after a calculator call when
    ``require_tool``), else 0.0."""
    answer = final_answer(sample)
    if answer is None or (require_tool and not sample.metadata.get("tool_calls")):
        return 0.0
    return float(answer.strip() == str(sample.label).strip())
