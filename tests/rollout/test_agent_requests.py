"""The agent endpoint's pure logic (slime_hydra/rollout/agent.py, tool_calls.py): which requests it refuses,
how OpenAI messages compare with the session's, the tool-call parsers of each model family, and a template
that drops past <think> blocks the way Qwen3's does, against a scripted engine."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_multiturn import NL, ScriptedEngine, chars, qwen_like_tokenizer

from slime_hydra.data.sample import Sample
from slime_hydra.rollout.agent import RequestError, check_request, key, normalize
from slime_hydra.rollout.multiturn import ChatRollout, TemplateError, render, rerendered_delta, template_delta
from slime_hydra.rollout.tool_calls import PARSERS, guess

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("extra, error", [
    ({"n": 2}, "n=2 is not supported"), ({"stream": True}, "stream=True is not supported"),
    ({"tool_choice": "required"}, "tool_choice='required'"), ({"top_logprobs": 5}, "top_logprobs=5"),
    ({"response_format": {"type": "json_object"}}, "parameter 'response_format' is not supported"),
    ({"messages": []}, "'messages' must be a non-empty list"),
])
def test_requests_the_endpoint_cannot_honour_are_refused(extra, error):
    with pytest.raises(RequestError, match=error.replace("(", r"\(").replace("[", r"\[")):
        check_request({**CHAT, **extra}, "messages")


def test_supported_and_neutral_parameters_pass():
    check_request({**CHAT, "n": 1, "stream": False, "tool_choice": "auto", "temperature": 0.7, "top_p": 1.0,
                   "max_tokens": 4, "stop": ["x"], "logprobs": True, "seed": None}, "messages")
    check_request({"model": "m", "prompt": "abc", "max_tokens": 3}, "prompt")
    with pytest.raises(RequestError, match="'prompt' must be a non-empty str"):
        check_request({"model": "m", "prompt": ["a", "b"]}, "prompt")


def test_messages_compare_by_role_content_and_calls_not_by_ids_or_formats():
    ours = normalize({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"x": 1, "y": "a"}}}]})
    sdk = normalize({"role": "assistant", "content": "", "refusal": None, "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": '{"y": "a", "x": 1}'}}]})
    assert key(ours) == key(sdk)
    assert key(normalize({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})
               ) == ("user", "ab", ())
    assert normalize({"role": "developer", "content": "s"})["role"] == "system"
    assert key(normalize({"role": "user", "content": "a"})) != key(normalize({"role": "user", "content": "b"}))
    with pytest.raises(RequestError, match="role"):
        normalize({"role": "robot", "content": "x"})


@pytest.mark.parametrize("parser, text, content, calls", [
    ("qwen3", 'I will look.\n<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call>',
     "I will look.", [("get", {"city": "Paris"})]),
    ("qwen3", "<think>hm</think>no call", "<think>hm</think>no call", []),
    ("qwen3", "<tool_call>not json</tool_call>", "", []),
    ("glm4", "ok<tool_call>get\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>n</arg_key>"
     "<arg_value>2</arg_value></tool_call>", "ok", [("get", {"city": "Paris", "n": 2})]),
    ("glm4", '<tool_call>get\n{"city": "Paris"}</tool_call>', "", [("get", {"city": "Paris"})]),
    ("llama3", '<|python_tag|>{"name": "get", "parameters": {"city": "Paris"}}', "", [("get", {"city": "Paris"})]),
    ("llama3", '{"name": "get", "parameters": {"city": "Paris"}}', "", [("get", {"city": "Paris"})]),
    ("llama3", "The answer is 4.", "The answer is 4.", []),
    ("calc", "<call>1+2<call>", "", [("calculator", {"expression": "1+2"}), ("calculator", {"expression": ""})]),
    ("none", "<tool_call>x</tool_call>", "<tool_call>x</tool_call>", []),
])
def test_tool_call_parsers(parser, text, content, calls):
    assert PARSERS[parser](text) == (content, calls)


def test_tool_call_parsers_follow_the_requests_tools():
    """With the request's tools, as SGLang's parsers (tests/rollout/test_tool_calls_sglang.py compares the two): a
    call to a function not offered is dropped, and a GLM argument the schema makes a string stays its text."""
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object", "properties": {
        "zip": {"type": "string"}, "n": {"type": "integer"}}}}}]
    glm = ("<tool_call>get\n<arg_key>zip</arg_key>\n<arg_value>75001</arg_value>\n"
           "<arg_key>n</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
    assert PARSERS["glm4"](glm, tools) == ("", [("get", {"zip": "75001", "n": 2})])
    assert PARSERS["glm4"](glm) == ("", [("get", {"zip": 75001, "n": 2})])  # no schema: JSON where it parses
    assert PARSERS["qwen3"]('<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>', tools) == ("", [])
    assert PARSERS["llama3"]('{"name": "get", "parameters": {"zip": "a;b"}}\nDone.', tools) == (
        "Done.", [("get", {"zip": "a;b"})])


def test_the_parser_is_guessed_from_the_chat_template():
    from slime_hydra.data.tokenizer import builtin_tokenizer

    assert guess(builtin_tokenizer("builtin:calc").chat_template) == "calc"
    assert guess("...{{ '<tool_call>' }}...") == "qwen3" and guess("<arg_key><tool_call>") == "glm4"
    assert guess("<|python_tag|>") == "llama3" and guess(None) == "none"


# Qwen3's rule: an assistant turn before the last user message loses its <think> block.
THINK_DROPPING = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m['role'] == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m['role'] == 'assistant' %}<|im_start|>assistant" + NL +
    "{%- if loop.index0 < ns.last and '</think>' in m['content'] %}{{ m['content'].split('</think>')[-1] }}"
    "{%- else %}{{ m['content'] }}{%- endif %}<|im_end|>" + NL +
    "{%- else %}<|im_start|>{{ m['role'] }}" + NL + "{{ m['content'] }}<|im_end|>" + NL + "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant" + NL + "{%- endif %}")


def test_a_template_dropping_past_think_blocks_keeps_the_generated_sequence():
    """The second user message makes the template drop the first turn's <think> block: the trained sequence
    keeps the tokens the model generated (think included) and appends exactly the template's new messages."""
    tok = qwen_like_tokenizer()
    tok.chat_template = THINK_DROPPING
    first = "<think>a</think>4<|im_end|>"
    engine = ScriptedEngine(tok, [(chars(first), "stop"), (chars("5<|im_end|>"), "stop")])
    sample = Sample(prompt=[{"role": "user", "content": "2+2"}])
    msgs = [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "<think>a</think>4"},
            {"role": "user", "content": "+1"}]
    with pytest.raises(TemplateError):  # the renderings are not prefix-stable
        template_delta(tok, msgs[:2], msgs)

    async def agent():
        chat = ChatRollout(tok, sample)
        await chat.assistant_turn(engine, {"max_new_tokens": 50})
        chat.add_messages([msgs[2]])
        await chat.assistant_turn(engine, {"max_new_tokens": 50})
        return chat.finish()

    s = asyncio.run(agent())
    text = tok.decode(s.tokens, skip_special_tokens=False)
    assert text == ("<|im_start|>user\n2+2<|im_end|>\n<|im_start|>assistant\n<think>a</think>4<|im_end|>\n"
                    "<|im_start|>user\n+1<|im_end|>\n<|im_start|>assistant\n5<|im_end|>")
    assert s.metadata["rerendered"] == 1 and s.metadata["template_mismatch"] == 0
    trained = [t for t, m in zip(s.tokens[s.prompt_length:], s.loss_mask) if m]
    assert tok.decode(trained, skip_special_tokens=False) == first + "5<|im_end|>"
    assert render(tok, s.metadata["messages"]).count("<think>") == 0  # what the template itself would show


def test_rerendered_delta_finds_the_new_messages_after_the_last_turn():
    before = "U1|A:<t>x</t>4;"
    after = "U1|A:4;U2|A:"
    assert rerendered_delta(before, after) == "U2|A:"
    with pytest.raises(TemplateError, match="does not contain"):
        rerendered_delta("abc", "xyz")


def test_tool_arguments_reach_the_template_as_a_dict():
    args = json.dumps({"expression": ""})
    call = {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": args}}
    m = normalize({"role": "assistant", "content": "", "tool_calls": [call]})
    assert m["tool_calls"][0]["function"]["arguments"] == {"expression": ""}
