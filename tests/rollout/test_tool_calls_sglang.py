"""Our tool-call parsers (slime_hydra/rollout/tool_calls.py ``PARSERS``) against SGLang's own FunctionCallParser,
which the agent endpoint uses on the SGLang engine (``tool_calls.sglang_parser``): the same model outputs give the
same calls and content on either engine. SGLang runs in the ``sglang`` fixture's worker (tests/sglang_parser:
sglang 0.5.17, installed once into .cache/sglang-parser); the tests are skipped only when the package index cannot
be reached."""

from __future__ import annotations

import json

import pytest

from sglang_parser import start_parser
from slime_hydra.rollout.tool_calls import PARSERS


@pytest.fixture(scope="module")
def sglang():
    parser = start_parser()
    yield parser
    parser.close()


def _tool(name, **props):
    return {"type": "function", "function": {"name": name, "description": name.replace("_", " "),
                                             "parameters": {"type": "object", "properties": props}}}


TOOLS = [_tool("get_weather", city={"type": "string"}, days={"type": "integer"}, unit={"type": "string"}),
         _tool("search", query={"type": "string"}, filters={"type": "object"}, tags={"type": "array"},
               limit={"anyOf": [{"type": "integer"}, {"type": "null"}]}),
         _tool("get_time")]
WEATHER = {"city": "Paris", "days": 3}
NESTED = {"query": "tokio; async runtime", "filters": {"year": {"gte": 2020}, "lang": ["en", "fr"], "open": True},
          "tags": [1, {"a": None}, "Zürich"], "limit": None}


def qwen(name, args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


def glm(name, args):
    """GLM-4.5's chat template: a string argument as it is, any other as JSON."""
    return ("<tool_call>" + name + "\n" + "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
        "</arg_value>\n" for k, v in args.items()) + "</tool_call>")


def llama(name, args):
    return json.dumps({"name": name, "parameters": args}, ensure_ascii=False)


# (family, model output, content, calls): what SGLang's parser and ours both give
AGREED = [
    # Qwen2.5/3 (Hermes)
    ("qwen3", qwen("get_weather", WEATHER), "", [("get_weather", WEATHER)]),
    ("qwen3", qwen("get_weather", WEATHER) + "\n" + qwen("get_time", {}), "",
     [("get_weather", WEATHER), ("get_time", {})]),
    ("qwen3", "I'll check the forecast first.\n\n" + qwen("get_weather", WEATHER), "I'll check the forecast first.",
     [("get_weather", WEATHER)]),
    ("qwen3", "<think>\nThe user wants the weather in Paris.\n</think>\n\n" + qwen("get_weather", WEATHER),
     "<think>\nThe user wants the weather in Paris.\n</think>", [("get_weather", WEATHER)]),
    ("qwen3", "<think>\nNo tool needed.\n</think>\n\nThe capital of France is Paris.",
     "<think>\nNo tool needed.\n</think>\n\nThe capital of France is Paris.", []),
    ("qwen3", qwen("search", NESTED), "", [("search", NESTED)]),
    ("qwen3", qwen("get_weather", WEATHER) + "\nI have asked for the forecast.", "", [("get_weather", WEATHER)]),
    ("qwen3", qwen("send_email", {"to": "a@b.c"}), "", []),  # a function the request does not offer
    ("qwen3", '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>', "",
     [("get_weather", {"city": "Paris"})]),  # arguments written as a JSON string
    ("qwen3", "<tool_call>\nget_weather(city='Paris')\n</tool_call>", "", []),
    # GLM-4.5/4.6
    ("glm4", glm("get_weather", WEATHER), "", [("get_weather", WEATHER)]),
    ("glm4", glm("get_weather", WEATHER) + "\n" + glm("search", {"query": "Paris museums", "limit": 5}), "",
     [("get_weather", WEATHER), ("search", {"query": "Paris museums", "limit": 5})]),
    ("glm4", "<think>Weather needs a tool.</think>\nLet me look that up.\n" + glm("get_weather", WEATHER),
     "<think>Weather needs a tool.</think>\nLet me look that up.", [("get_weather", WEATHER)]),
    ("glm4", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("glm4", glm("search", NESTED), "", [("search", NESTED)]),
    ("glm4", glm("search", {"query": "42", "tags": ["x"]}), "", [("search", {"query": "42", "tags": ["x"]})]),
    ("glm4", glm("search", {"query": "first line\nsecond line"}), "",
     [("search", {"query": "first line\nsecond line"})]),
    ("glm4", "<tool_call>get_time\n</tool_call>", "", [("get_time", {})]),
    ("glm4", glm("get_weather", WEATHER) + "\nDone.", "", [("get_weather", WEATHER)]),
    ("glm4", glm("send_email", {"to": "a@b.c"}), "", []),
    # Llama 3.1-3.3
    ("llama3", llama("get_weather", WEATHER), "", [("get_weather", WEATHER)]),
    ("llama3", "<|python_tag|>" + llama("get_weather", WEATHER), "", [("get_weather", WEATHER)]),
    ("llama3", llama("get_weather", WEATHER) + "; " + llama("get_time", {}), "",
     [("get_weather", WEATHER), ("get_time", {})]),
    ("llama3", llama("get_weather", WEATHER) + ";" + llama("get_time", {}), "",
     [("get_weather", WEATHER), ("get_time", {})]),
    ("llama3", "Let me check.<|python_tag|>" + llama("get_weather", WEATHER), "Let me check.",
     [("get_weather", WEATHER)]),
    ("llama3", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("llama3", llama("search", NESTED), "", [("search", NESTED)]),  # a ';' inside an argument
    ("llama3", llama("get_weather", WEATHER) + "\nI called the tool.", "I called the tool.",
     [("get_weather", WEATHER)]),
    ("llama3", json.dumps({"name": "get_weather", "arguments": WEATHER}), "", [("get_weather", WEATHER)]),
    ("llama3", llama("send_email", {"to": "a@b.c"}), "", []),
]

# (family, model output, SGLang's content and calls, ours): where our parser is the better OpenAI reply
DIFFERENT = [
    # a string parameter's text is the string: SGLang JSON-decodes it and writes Python's str() of the value
    ("glm4", glm("get_weather", {"unit": "true"}), ("", [("get_weather", {"unit": "True"})]),
     ("", [("get_weather", {"unit": "true"})])),
    ("glm4", glm("search", {"query": "null"}), ("", [("search", {"query": "None"})]),
     ("", [("search", {"query": "null"})])),
    ("glm4", glm("search", {"query": "3.10"}), ("", [("search", {"query": "3.1"})]),
     ("", [("search", {"query": "3.10"})])),
    # GLM-4.7's no-argument call (no newline after the name): SGLang's glm45 parser loses the call and its text
    ("glm4", "<tool_call>get_time</tool_call>", ("", []), ("", [("get_time", {})])),
    # a call without the newlines Qwen's template writes is still a call
    ("qwen3", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', []), ("", [("get_time", {})])),
    # a call cut off by max_tokens: SGLang's content loses what was generated
    ("qwen3", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci',
     ("Checking.", []), ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci', [])),
    ("glm4", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par",
     ("", []), ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", [])),
    # two calls without a separator: SGLang's parser raises, and its server answers with the text
    ("llama3", llama("get_weather", WEATHER) + llama("get_time", {}),
     (llama("get_weather", WEATHER) + llama("get_time", {}), []), ("", [("get_weather", WEATHER), ("get_time", {})])),
    # a JSON object that is not a call stays in the content
    ("llama3", '{"answer": 4} is the JSON you asked for.', ("is the JSON you asked for.", []),
     ('{"answer": 4} is the JSON you asked for.', [])),
    ("llama3", "  " + llama("get_time", {}), (llama("get_time", {}), []), ("", [("get_time", {})])),
]


def _sglangs(sglang, cases):
    """SGLang's (content, calls) of each case, one request per family."""
    out = {}
    for family in {c[0] for c in cases}:
        texts = [c[1] for c in cases if c[0] == family]
        for text, (content, calls) in zip(texts, sglang.tool_calls(family, TOOLS, texts)):
            out[family, text] = (content, [tuple(c) for c in calls])
    return [out[c[0], c[1]] for c in cases]


def test_our_parsers_agree_with_sglangs(sglang):
    for (family, text, content, calls), (s_content, s_calls) in zip(AGREED, _sglangs(sglang, AGREED)):
        ours = PARSERS[family](text, TOOLS)
        assert (s_content.strip(), s_calls) == (content, calls), (family, text)
        assert (ours[0].strip(), ours[1]) == (content, calls), (family, text)


def test_where_our_parsers_differ_from_sglangs(sglang):
    """Each difference, both sides: it shows when a newer SGLang changes its side."""
    for (family, text, s_want, ours_want), (s_content, s_calls) in zip(DIFFERENT, _sglangs(sglang, DIFFERENT)):
        assert (s_content.strip(), s_calls) == s_want, (family, text)
        ours = PARSERS[family](text, TOOLS)
        assert (ours[0].strip(), ours[1]) == ours_want, (family, text)
