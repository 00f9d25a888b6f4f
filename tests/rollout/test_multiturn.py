"""Multi-turn rollouts: tokens and loss masks come from the real chat template over the whole
conversation (tool tokens masked, model tokens with the engine's log-probs), including consecutive
tool messages, abort + resume, and the calculator example's tool and parser. A scripted engine
stands in for the model, so every expected token is known."""

from __future__ import annotations

import asyncio
import copy
import re
from typing import Any, Dict, List, Tuple

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from examples.calculator.agent import TOOLS, calculate
from examples.calculator.direct import generate as calc_generate, parse_turn, reward as calc_reward
from slime_hydra.data.sample import Sample, Status
from slime_hydra.data.tokenizer import builtin_tokenizer
from slime_hydra.rollout.generate import GenerateContext
from slime_hydra.rollout.multiturn import ChatRollout, TemplateError, final_answer, render, template_delta


class ScriptedEngine:
    """ctx for generate functions: each /generate answers the next scripted turn (token strings,
    finish reason); records every payload."""

    def __init__(self, tokenizer, turns: List[Tuple[List[str], str]]):
        self.tokenizer, self.turns, self.payloads = tokenizer, list(turns), []
        self.cfg, self.aborting = None, False
        self.next_lp = -0.125

    async def post(self, path: str, payload: Dict[str, Any]) -> Dict[str, Any]:
        assert path == "/generate"
        self.payloads.append(copy.deepcopy(payload))  # as sent (the sample grows later)
        pieces, finish = self.turns.pop(0)
        ids = [self.tokenizer.convert_tokens_to_ids(p) for p in pieces]
        assert len(ids) <= payload["sampling_params"]["max_new_tokens"]
        lps = []
        for _ in ids:
            lps.append(self.next_lp)
            self.next_lp -= 0.125
        return {
            "text": self.tokenizer.decode(ids, skip_special_tokens=True),
            "output_ids": ids,
            "meta_info": {
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
                "finish_reason": {"type": finish},
                "weight_version": "3",
            },
        }


def model_logprobs(sample: Sample) -> List[float]:
    return [lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if m]


# ------------------------------------------------------------------ builtin:calc, the example
def test_calc_template_groups_consecutive_tool_messages():
    tok = builtin_tokenizer("builtin:calc")
    msgs = [
        {"role": "user", "content": "2*3-1"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+2"}}},
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": ""}}},
            ],
        },
        {"role": "tool", "content": "3"},
        {"role": "tool", "content": "5"},
    ]
    whole = render(tok, msgs, add_generation_prompt=True)
    assert whole == "<user>2*3-1<assistant><call>1+2<call><eos><tool>3,5<assistant>"
    # rendering each tool message on its own gives different text: why masks come from diffs
    alone = "".join(render(tok, [m]) for m in msgs[2:])
    assert alone == "<tool>3<tool>5" != template_delta(tok, msgs[:2], msgs, add_generation_prompt=False) == "<tool>3,5"
    # diffs one message at a time agree with the whole conversation
    assert (
        "".join(template_delta(tok, msgs[:i], msgs[: i + 1], add_generation_prompt=False) for i in (2, 3))
        == "<tool>3,5"
    )


def test_calc_conversation_tokens_and_mask_match_the_template():
    """Two calls in one turn -> two consecutive tool messages -> answer. The token sequence is the
    template's rendering of the whole conversation, the mask marks exactly the model's tokens."""
    tok = builtin_tokenizer("builtin:calc")
    engine = ScriptedEngine(tok, [(["<call>", "1", "+", "2", "<call>", "<eos>"], "stop"), (["5", "<eos>"], "stop")])
    s = Sample(prompt="2*3-1", label="5")
    out = asyncio.run(calc_generate(engine, s, {"max_new_tokens": 40}, max_turns=3))
    msgs = out.metadata["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "assistant"]
    assert [m["content"] for m in msgs[2:4]] == ["3", "5"]  # "1+2", then the user's expression
    full = render(tok, msgs)
    assert full == "<user>2*3-1<assistant><call>1+2<call><eos><tool>3,5<assistant>5<eos>"
    assert out.tokens == tok.encode(full, add_special_tokens=False)
    prompt = tok.encode("<user>2*3-1<assistant>", add_special_tokens=False)
    assert out.prompt_length == len(prompt) and out.response_length == len(out.tokens) - len(prompt)
    #                 <call>1+2<call><eos> <tool>3,5<assistant>  5<eos>
    assert out.loss_mask == [1] * 6 + [0] * 5 + [1] * 2
    assert model_logprobs(out) == [-0.125 * k for k in range(1, 9)]
    assert all(lp == 0.0 for lp, m in zip(out.rollout_log_probs, out.loss_mask) if not m)
    assert out.status == Status.COMPLETED and out.weight_versions == ["3", "3"]
    assert out.metadata["num_turns"] == 2 and out.metadata["tool_calls"] == 2
    assert out.metadata["template_mismatch"] == 0
    assert final_answer(out) == "5" and calc_reward(None, out) == 1.0
    # the second request continued from the conversation so far, budget reduced by what was used
    second = engine.payloads[1]
    assert second["input_ids"] == tok.encode(
        "<user>2*3-1<assistant><call>1+2<call><eos><tool>3,5<assistant>", add_special_tokens=False
    )
    assert second["sampling_params"]["max_new_tokens"] == 40 - 11


def test_turn_cap_appends_the_templates_end_of_turn_masked():
    """One-token turns (the example's setting): the model never generates <eos>; the template's
    <eos> that closes its turn is appended with mask 0 before the tool message."""
    tok = builtin_tokenizer("builtin:calc")
    engine = ScriptedEngine(tok, [(["<call>"], "length"), (["4"], "length")])
    s = asyncio.run(
        calc_generate(engine, Sample(prompt="37*48-1772", label="4"), {"max_new_tokens": 12}, turn_max_tokens=1)
    )
    assert s.response == "<call><eos><tool>4<assistant>4"
    assert s.loss_mask == [1, 0, 0, 0, 0, 1]
    assert s.status == Status.COMPLETED and calc_reward(None, s) == 1.0
    assert [p["sampling_params"]["max_new_tokens"] for p in engine.payloads] == [1, 1]
    # a guess without the tool is not rewarded (require_tool), unless asked
    guess = asyncio.run(
        calc_generate(
            ScriptedEngine(tok, [(["4"], "length")]),
            Sample(prompt="37*48-1772", label="4"),
            {"max_new_tokens": 12},
            turn_max_tokens=1,
        )
    )
    assert final_answer(guess) == "4" and calc_reward(None, guess) == 0.0
    assert calc_reward(None, guess, require_tool=False) == 1.0


def test_budget_runs_out():
    tok = builtin_tokenizer("builtin:calc")
    engine = ScriptedEngine(tok, [(["<call>", "<eos>"], "stop"), (["7", "7"], "length")])
    s = asyncio.run(calc_generate(engine, Sample(prompt="1+1", label="2"), {"max_new_tokens": 7}))
    assert s.status == Status.TRUNCATED and s.response_length == 7  # 2 model + 3 tool + 2 model
    assert engine.payloads[1]["sampling_params"]["max_new_tokens"] == 2
    assert calc_reward(None, s) == 0.0


def test_abort_then_resume_continues_the_turn():
    """Partial rollout: a turn cut off by an abort keeps its tokens; the next rollout continues
    the same turn from sample.tokens with the budget left, then the conversation goes on."""
    tok = builtin_tokenizer("builtin:calc")
    s = Sample(prompt="9*9-80", label="1")
    first = ScriptedEngine(tok, [(["<call>", "9"], "abort")])
    s = asyncio.run(calc_generate(first, s, {"max_new_tokens": 20}))
    assert s.status == Status.ABORTED and s.response == "<call>9" and s.metadata["turn_start"] == 0
    assert s.metadata["num_turns"] == 0
    tokens_at_abort = list(s.tokens)
    second = ScriptedEngine(tok, [(["*", "9", "<eos>"], "stop"), (["8", "1", "<eos>"], "stop")])
    s = asyncio.run(calc_generate(second, s, {"max_new_tokens": 20}))
    assert second.payloads[0]["input_ids"] == tokens_at_abort
    assert second.payloads[0]["sampling_params"]["max_new_tokens"] == 18
    assert s.metadata["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"expression": "9*9"}
    assert s.metadata["messages"][2]["content"] == "81"
    assert s.tokens == tok.encode(render(tok, s.metadata["messages"]), add_special_tokens=False)
    assert s.loss_mask == [1] * 5 + [0] * 4 + [1] * 3


def test_aborting_context_answers_without_an_engine():
    class NoEngine:
        async def post(self, path, payload):
            raise AssertionError("no request while aborting")

    tok = builtin_tokenizer("builtin:calc")
    ctx = GenerateContext(cfg=None, tokenizer=tok, client=NoEngine(), aborting=True)
    s = asyncio.run(calc_generate(ctx, Sample(prompt="1+1", label="2"), {"max_new_tokens": 8}))
    assert s.status == Status.ABORTED and s.response_length == 0 and s.weight_versions == []
    assert (
        asyncio.run(ctx.post("/generate", {"input_ids": [[1], [2]]}))[1]["meta_info"]["finish_reason"]["type"]
        == "abort"
    )


def test_calculator_tool_and_parser():
    assert calculate("37*48-1772") == "4" and calculate("-3+10%4") == "-1"
    for bad in ("", "1/2", "2**3", "1+", "import os", "9%0", "(1+2)"):
        assert calculate(bad) == "?", bad
    assert parse_turn("7<eos>") == {"role": "assistant", "content": "7"}
    msg = parse_turn("ok<call>1+1<call>")
    assert msg["content"] == "ok" and [c["function"]["arguments"]["expression"] for c in msg["tool_calls"]] == [
        "1+1",
        "",
    ]
    assert TOOLS[0]["function"]["name"] == "calculator"


# --------------------------------------------------- a Qwen-shaped template (a real tool format)
NL = "{{ '\\n' }}"  # newlines as expressions: HF's jinja trims the ones after block tags
QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system" + NL + "Tools: {% for t in tools %}{{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>" + NL + "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    + NL
    + "<tool_response>"
    + NL
    + "{{ m['content'] }}"
    + NL
    + "</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>" + NL + "{% endif %}"
    "{%- elif m['role'] == 'assistant' %}<|im_start|>assistant" + NL + "{{ m['content'] }}"
    "{%- for c in m.get('tool_calls', []) %}<tool_call>{{ c['function']['name'] }}</tool_call>{% endfor %}"
    "<|im_end|>"
    + NL
    + "{%- else %}<|im_start|>{{ m['role'] }}"
    + NL
    + "{{ m['content'] }}<|im_end|>"
    + NL
    + "{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant" + NL + "{% endif %}"
)
SPECIAL = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def qwen_like_tokenizer() -> PreTrainedTokenizerFast:
    vocab = ["<pad>", *SPECIAL, *[chr(c) for c in range(32, 127)], "\n"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<pad>", *SPECIAL])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>")
    fast.chat_template = QWEN_LIKE
    return fast


def parse_qwen(text: str) -> Dict[str, Any]:
    text = text.removesuffix("<|im_end|>")
    calls = re.findall(r"<tool_call>(.*?)</tool_call>", text)
    msg: Dict[str, Any] = {"role": "assistant", "content": re.sub(r"<tool_call>.*?</tool_call>", "", text)}
    if calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": {}}} for n in calls]
    return msg


def chars(text: str) -> List[str]:
    return re.findall("|".join(map(re.escape, SPECIAL)) + r"|[\s\S]", text)


def test_qwen_like_template_mask_is_the_diff_over_the_whole_conversation():
    """Model turns end with <|im_end|>; the template adds "\\n" after it (masked). Two tool results
    share one user turn. Expected mask, found independently: 1 exactly on the characters between
    "<|im_start|>assistant\\n" and the end of the following "<|im_end|>" in the full rendering."""
    tok = qwen_like_tokenizer()
    turns = [
        (chars("<tool_call>a</tool_call><tool_call>b</tool_call><|im_end|>"), "stop"),
        (chars("x=1, y=2<|im_end|>"), "stop"),
    ]
    engine = ScriptedEngine(tok, turns)
    sample = Sample(prompt=[{"role": "user", "content": "go"}])
    tools = [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}]

    async def agent():
        chat = ChatRollout(tok, sample, tools=tools, parse=parse_qwen)
        msg = await chat.assistant_turn(engine, {"max_new_tokens": 200})
        chat.add_messages([{"role": "tool", "content": "x=1"}, {"role": "tool", "content": "y=2"}])
        await chat.assistant_turn(engine, {"max_new_tokens": 200})
        assert msg["tool_calls"] and chat.done is False
        return chat.finish()

    s = asyncio.run(agent())
    full = render(tok, s.metadata["messages"], tools=tools)
    assert (
        "<|im_start|>user\n<tool_response>\nx=1\n</tool_response>\n<tool_response>\ny=2\n</tool_response><|im_end|>"
        in full
    )
    # the sequence is the template's (minus the final "\n" after the last turn, never needed)
    assert tok.decode(s.tokens, skip_special_tokens=False) == full[:-1]
    assert s.tokens == tok.encode(full[:-1], add_special_tokens=False)
    mask = [0] * len(chars(full[:-1]))
    for m in re.finditer(re.escape("<|im_start|>assistant\n") + r"(.*?<\|im_end\|>)", full, flags=re.S):
        start = len(chars(full[: m.start(1)]))
        for i in range(start, start + len(chars(m.group(1)))):
            mask[i] = 1
    prompt_len = len(chars(render(tok, [{"role": "user", "content": "go"}], tools=tools, add_generation_prompt=True)))
    assert s.prompt_length == prompt_len and s.loss_mask == mask[prompt_len:]
    assert model_logprobs(s) == [-0.125 * k for k in range(1, 1 + sum(s.loss_mask))]


def test_template_that_is_not_prefix_stable_is_an_error():
    tok = qwen_like_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ messages | length }}"
    with pytest.raises(TemplateError, match="prefix-stable"):
        template_delta(
            tok,
            [{"role": "user", "content": "a"}],
            [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}],
        )
