"""The calculator agent of examples/calculator/agent.py written against slime_hydra's own ``ChatRollout`` API (a
``rollout.generate`` function) instead of the OpenAI SDK: the direct path that the endpoint builds on, and the
bench's baseline for the endpoint's cost (bench scenario ``agent_endpoint``)::

    python run.py experiment=calculator_agent rollout.agent=null \
        'rollout.generate={_target_: examples.calculator.direct.generate, max_turns: 3, turn_max_tokens: 1}'

    <user>37*48-1772<assistant><call><eos><tool>4<assistant>4<eos>
                    ^^^^^^ model ^^^^^     ^^^^^^^^ tool ^^^ model
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from examples.calculator.agent import TOOLS, calculate
from slime_hydra.data.sample import Sample
from slime_hydra.rollout.multiturn import ChatRollout, final_answer

CALL, EOS = "<call>", "<eos>"


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
