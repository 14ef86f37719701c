"""Jinja chat templates: each family's template (spark_cli/data/templates) renders tools, an
assistant call and its result in the family's own format, and the format read back from the
template parses the call it writes; sandboxing, errors, --chat-template-file."""

from __future__ import annotations

import json

import pytest

from spark_cli.core.chat_output import OutputParser
from spark_cli.core.chat_template import BUNDLED_DIR, ChatTemplate, TemplateError, TemplateSet, bundled, from_file
from spark_cli.core.tool_calls import format_for, param_types
from spark_cli.errors import UsageError

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
ARGS = {"city": "Paris", "days": 3}
RESULT = "Sunny, 21 C"
HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]

# template -> (format, arch, the generation prompt's end)
FAMILIES = {"qwen3": ("hermes", "qwen3moe", "<|im_start|>assistant\n"),
            "qwen3.6": ("qwen3_coder", "qwen35moe", "<think>\n"),
            "glm45": ("glm45", "glm4moe", "<|assistant|>"),
            "deepseek": ("deepseek", "deepseek2", "<｜Assistant｜></think>"),
            "gpt-oss": ("harmony", "gpt-oss", "<|start|>assistant"),
            "mistral": ("mistral", "llama", ("[/INST]", "[/TOOL_RESULTS]"))}  # no generation prompt


def test_every_bundled_template_is_covered():
    assert sorted(p.stem for p in BUNDLED_DIR.glob("*.jinja")) == sorted(FAMILIES)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_template_renders_tools_calls_and_results(name):
    fmt, arch, tail = FAMILIES[name]
    t = ChatTemplate(bundled(name), name, bos_token="<BOS>", eos_token="<EOS>")
    assert format_for(t.source, arch).name == fmt and format_for(t.source).name == fmt
    text = t.render(HISTORY, tools=[TOOL])
    assert "Weather now" in text and "Be brief." in text and "Weather in Paris?" in text
    assert text.endswith(tail if isinstance(tail, str) else tail[1])
    assert text.index("Weather in Paris?") < text.index("Paris", text.index("Weather in Paris?") + 17) < text.index(RESULT)
    assert "None" not in text  # no Python None leaked into the prompt
    without = t.render(HISTORY[:2], tools=None)
    assert "get_weather" not in without and without.endswith(tail if isinstance(tail, str) else tail[0])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_call_a_template_writes_parses_back(name):
    """Render the assistant call; the family's parser reads it from the rendered turn."""
    fmt_name, arch, _ = FAMILIES[name]
    t = ChatTemplate(bundled(name), name)
    before = t.render(HISTORY[:2], tools=[TOOL], add_generation_prompt=True)
    after = t.render(HISTORY[:3], tools=[TOOL], add_generation_prompt=False)
    common = 0
    while common < min(len(before), len(after)) and before[common] == after[common]:
        common += 1
    turn = after[common:]
    fmt = format_for(t.source, arch)
    start = turn.find(fmt.start)
    assert start >= 0, turn
    p = OutputParser(fmt, types=param_types([TOOL]))
    p.feed(turn[start:])
    p.finish()
    calls = p.result().tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS)]


def test_thinking_switch_and_extras():
    q = ChatTemplate(bundled("qwen3"))
    assert q.render(HISTORY[:2], extras={"enable_thinking": False}).endswith("<think>\n\n</think>\n\n")
    g = ChatTemplate(bundled("gpt-oss"))
    assert "Reasoning: high" in g.render(HISTORY[:2], extras={"reasoning_effort": "high"})
    assert "Reasoning: medium" in g.render(HISTORY[:2])


def test_a_template_without_tools_gets_them_as_hermes_text():
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    t = ChatTemplate(chatml)
    text = t.render(HISTORY, tools=[TOOL])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n") and "<tools>" in text and '"get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in text
    assert "<tools>" not in t.render(HISTORY)  # no tools: only the call written as text


def test_template_errors_name_the_template_and_the_exception():
    t = ChatTemplate("{{ raise_exception('only user and assistant roles') }}", "tokenizer.chat_template.tool_use")
    with pytest.raises(TemplateError, match=r"tokenizer.chat_template.tool_use: only user and assistant roles"):
        t.render(HISTORY)
    with pytest.raises(TemplateError, match=r"my.jinja: .*Error"):
        ChatTemplate("{{ messages[0].content.nope() }}", "my.jinja").render(HISTORY)


def test_the_sandbox_refuses_attribute_escapes():
    with pytest.raises(TemplateError, match="SecurityError|unsafe"):
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}").render(HISTORY)


def test_tojson_keeps_non_ascii_and_named_templates_pick_tool_use():
    assert ChatTemplate("{{ messages[0] | tojson }}").render([{"role": "user", "content": "café"}]) == \
        '{"role": "user", "content": "café"}'
    s = TemplateSet({"tokenizer.chat_template": "plain", "tokenizer.chat_template.tool_use": "{{ tools }}"})
    assert s.pick(False).source == "plain" and s.pick(True).name == "tokenizer.chat_template.tool_use"
    assert TemplateSet({}).pick(True) is None


def test_chat_template_file(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}")
    assert from_file(f).pick(False).render(HISTORY[1:2]) == "[user] Weather in Paris?"
    for text, why in (("", "empty"), ("{% for %}", "does not compile")):
        f.write_text(text)
        with pytest.raises(UsageError, match=f"--chat-template-file .*{why}"):
            from_file(f)
    with pytest.raises(UsageError, match="--chat-template-file"):
        from_file(tmp_path)  # a folder


@pytest.mark.model
@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss", "glm4moe"])
def test_tiny_models_carry_their_family_template(name):
    from spark_cli.core.gguf_info import load_geometry
    from spark_cli.models.tiny_models import TINY_TEMPLATES, build_tiny_model

    g = load_geometry(build_tiny_model(name), require_moe=False)
    assert dict(g.chat_templates)["tokenizer.chat_template"] == bundled(TINY_TEMPLATES[name])


# where a system message sent mid-conversation lands: in place (after the user's turn) or joined
# into the template's one system slot (before it)
MID_SYSTEM = {"qwen3": "in place", "qwen3.6": "in place", "glm45": "in place", "deepseek": "joined",
              "gpt-oss": "joined", "mistral": "joined"}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_system_message_inside_anthropic_messages_renders_where_the_family_puts_it(name):
    from spark_cli.serve.anthropic import MessagesRequest, to_chat
    from spark_cli.serve.protocol import ChatRequest

    body = {"max_tokens": 8, "system": "TOP-SYSTEM", "messages": [
        {"role": "user", "content": "USER-TURN"}, {"role": "system", "content": "MID-SYSTEM"}]}
    chat = ChatRequest.model_validate(to_chat(MessagesRequest.model_validate(body)))
    text = ChatTemplate(bundled(name), name).render(chat.message_dicts())
    top, user, mid = text.index("TOP-SYSTEM"), text.index("USER-TURN"), text.index("MID-SYSTEM")
    assert top < user
    assert (user < mid) if MID_SYSTEM[name] == "in place" else (top < mid < user), text


def test_a_template_that_refuses_a_later_system_message_gets_it_joined_into_the_first():
    strict = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
              "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
              "<{{ m.role }}>{{ m.content }}{% endfor %}")
    first_only = ("{% if messages[0].role == 'system' %}<system>{{ messages[0].content }}{% endif %}"
                  "{% for m in messages %}{% if m.role != 'system' %}<{{ m.role }}>{{ m.content }}{% endif %}"
                  "{% endfor %}")
    msgs = [{"role": "user", "content": "hi"}, {"role": "system", "content": "later"}]
    assert ChatTemplate(strict).render(msgs) == "<system>later<user>hi"
    top = [{"role": "system", "content": "first"}, *msgs]
    assert ChatTemplate(strict).render(top) == "<system>first\n\nlater<user>hi"
    assert ChatTemplate(first_only).render(top) == "<system>first\n\nlater<user>hi"  # it left `later` out
    with pytest.raises(TemplateError, match="at the beginning"):  # nothing to join: the template's own error
        ChatTemplate(strict.replace("not loop.first", "true")).render([{"role": "system", "content": "x"}])


def test_templates_see_the_date(monkeypatch):
    """strftime_now, and llama-server's date_string and datetime: today, or SPARK_TEMPLATE_DATE's day."""
    import datetime

    from spark_cli.core.chat_template import DATE_ENV

    t = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}|{{ date_string }}|{{ datetime }}")
    monkeypatch.delenv(DATE_ENV, raising=False)
    assert t.render([]).split("|")[0] == datetime.date.today().isoformat()
    monkeypatch.setenv(DATE_ENV, "2025-02-03")
    assert t.render([]) == "2025-02-03|03 Feb 2025|Feb 03 2025"
    assert t.render([], extras={"date_string": "then"}).split("|")[1] == "then"
    monkeypatch.setenv(DATE_ENV, "tomorrow")
    with pytest.raises(TemplateError, match=f"{DATE_ENV}=tomorrow: not a date"):
        t.render([])


def test_null_or_undefined_beside_a_string_is_empty_as_llama_cpps_jinja():
    t = ChatTemplate("{{ 'a' + functions + 'b' }}{{ none_var + 'c' }}")
    assert t.render([], extras={"none_var": None}) == "abc"
    with pytest.raises(TemplateError, match="UndefinedError"):
        ChatTemplate("{{ 1 + functions }}").render([])
