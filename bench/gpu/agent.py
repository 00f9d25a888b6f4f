"""A two-turn agent for the GPU bench (scenario ``agent_endpoint_gpu``): the prompt, the model's answer, a
follow-up user message, a second answer. ``run`` goes through the agent endpoint with the OpenAI SDK,
``generate`` makes the same calls with ChatRollout directly; the reward is the run's (``reward.custom``)."""

from __future__ import annotations

from typing import Any, Dict

from slime_hydra.rollout.multiturn import ChatRollout

FOLLOW_UP = {"role": "user", "content": "t9 t9 t9 t9"}


async def run(client: Any, sample: dict, turns: int = 2, turn_max_tokens: int = 128) -> None:
    messages = [{"role": "user", "content": sample["prompt"]}]
    for t in range(turns):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=turn_max_tokens)
        messages += [reply.choices[0].message.model_dump(exclude_none=True)] + [FOLLOW_UP] * (t < turns - 1)
    return None


async def generate(ctx: Any, sample: Any, sampling_params: Dict[str, Any], evaluation: bool = False, *,
                   turns: int = 2, turn_max_tokens: int = 128) -> Any:
    chat = ChatRollout(ctx.tokenizer, sample)
    for t in range(turns):
        if await chat.assistant_turn(ctx, sampling_params, max_new_tokens=turn_max_tokens) is None or chat.done:
            break
        if t < turns - 1:
            chat.add_messages([FOLLOW_UP])
    return chat.finish()
