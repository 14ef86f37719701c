"""Tool-call formats and reasoning: model text in, OpenAI message parts out (golden cases per
family), streamed deltas joined equal to the whole answer, text without a call stays content."""

from __future__ import annotations

import json

import pytest

from spark_cli.core.chat_output import OutputParser, join
from spark_cli.core.tool_calls import FORMATS, format_for, param_types

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}
TYPES = param_types([WEATHER])
DS = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\", \"days\": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
DS31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\", \"days\": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"

# (format, model text, content, [(name, arguments as an object)])
GOLDEN = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
     "Let me look.\n", [("get_weather", {"city": "Paris", "days": 2})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
     "", [("get_weather", {"city": "Paris", "days": 2})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>\n</tool_call>",
     "", [("get_weather", {"city": "42"})]),  # a string parameter stays a string
    ("glm45", "Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
     "Checking.", [("get_weather", {"city": "Paris", "days": 2})]),
    ("deepseek", DS, "", [("get_weather", {"city": "Paris", "days": 2})]),
    ("deepseek", "Sure." + DS31, "Sure.", [("get_weather", {"city": "Paris", "days": 2})]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
     "", [("get_weather", {"city": "Paris", "days": 2})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [("get_weather", {"city": "Paris"})]),
    ("harmony", "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}',
     "", [("get_weather", {"city": "Paris", "days": 2})]),
    ("harmony", '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
     "", [("get_weather", {"city": "Paris"})]),
]


def _parser(fmt: str, **kw) -> OutputParser:
    return OutputParser(FORMATS[fmt], types=TYPES, **kw)


def _whole(fmt: str, text: str, **kw):
    p = _parser(fmt, **kw)
    p.feed(text)
    p.finish()
    return p.result()


def _streamed(fmt: str, text: str, **kw):
    p = _parser(fmt, **kw)
    deltas = [d for ch in text for d in p.feed(ch)] + p.finish()
    return join(deltas), p.result()


@pytest.mark.parametrize("fmt,text,content,calls", GOLDEN)
def test_golden_tool_calls(fmt, text, content, calls):
    out = _whole(fmt, text)
    assert out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == calls
    assert all(c.id.startswith("call_") for c in out.tool_calls) and len({c.id for c in out.tool_calls}) == len(calls)


@pytest.mark.parametrize("fmt,text,content,calls", GOLDEN)
def test_streamed_deltas_join_to_the_whole_answer(fmt, text, content, calls):
    joined, result = _streamed(fmt, text)
    whole = _whole(fmt, text)
    assert joined.content == result.content == whole.content
    assert joined.reasoning_content == whole.reasoning_content
    assert [(c.name, c.arguments) for c in joined.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert [c.id for c in joined.tool_calls] == [c.id for c in result.tool_calls]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("text", ["The weather in Paris is mild.", "Use <b>tags</b> and [brackets] freely.", ""])
def test_text_without_a_call_stays_content(fmt, text):
    out = _whole(fmt, text)
    assert (out.content, out.tool_calls) == (text, [])
    assert _streamed(fmt, text)[0].content == text


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "glm45"])
def test_a_broken_call_is_content(fmt):
    text = "<tool_call>\n{not json</tool_call>" if fmt == "hermes" else "<tool_call></tool_call>"
    out = _whole(fmt, text)
    assert out.tool_calls == [] and out.content == text


def test_tool_choice_none_parses_nothing():
    text = GOLDEN[0][1]
    p = OutputParser(FORMATS["hermes"], tools=False)
    p.feed(text)
    p.finish()
    assert p.result().content == text and p.result().tool_calls == []


@pytest.mark.parametrize("text,in_reasoning,reasoning,content", [
    ("<think>\nSome thought.\n</think>\n\nThe answer.", False, "Some thought.\n", "The answer."),
    ("Some thought.\n</think>\n\nThe answer.", True, "Some thought.\n", "The answer."),
    ("No thinking here.", False, "", "No thinking here."),
    ("<think>unfinished", False, "unfinished", ""),
])
def test_think_goes_to_reasoning_content(text, in_reasoning, reasoning, content):
    for fmt in ("hermes", "qwen3_coder", "deepseek"):
        out = _whole(fmt, text, in_reasoning=in_reasoning)
        assert (out.reasoning_content, out.content) == (reasoning, content)
        joined, _ = _streamed(fmt, text, in_reasoning=in_reasoning)
        assert (joined.reasoning_content, joined.content) == (reasoning, content)


def test_reasoning_format_none_keeps_it_inline():
    text = "<think>hmm</think>Answer"
    assert _whole("hermes", text, reasoning="none").content == text


def test_reasoning_then_call():
    text = '<think>I should call it.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    out = _whole("hermes", text)
    assert out.reasoning_content == "I should call it." and out.content == ""
    assert json.loads(out.tool_calls[0].arguments) == {"city": "Oslo"}


def test_harmony_channels():
    text = ("<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final"
            "<|message|>Hello there!")
    out = _whole("harmony", text)
    assert (out.reasoning_content, out.content, out.tool_calls) == ("The user greets.", "Hello there!", [])
    joined, _ = _streamed("harmony", text)
    assert (joined.reasoning_content, joined.content) == ("The user greets.", "Hello there!")


@pytest.mark.parametrize("template,arch,want", [
    ("{{ '<|channel|>' }}", "", "harmony"), ("", "gpt-oss", "harmony"),
    ("<｜tool▁calls▁begin｜>", "deepseek2", "deepseek"), ("<arg_key>", "glm4moe", "glm45"),
    ("<tool_call>\n<function=x>\n<parameter=y>", "qwen3moe", "qwen3_coder"),
    ("[TOOL_CALLS]", "llama", "mistral"), ("<tool_call>", "qwen3moe", "hermes"), ("{{ x }}", "olmoe", "hermes"),
])
def test_format_for_template(template, arch, want):
    assert format_for(template, arch).name == want
