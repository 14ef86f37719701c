"""Thinking on and off per template family (core/reasoning.py, issue 49): llama-server's
`--reasoning on|off|auto`, a request's enable_thinking / reasoning_effort / reasoning budget, and
the prompt each family renders for "off"."""

from __future__ import annotations

import pytest

from spark_cli.core.chat_template import ChatTemplate, bundled
from spark_cli.core.reasoning import (HARMONY_NO_ANALYSIS, ReasoningDefault, ReasoningError, can_think,
                                      check_budget, template_kwargs)

ASK = [{"role": "user", "content": "What is today?"}]
# DeepSeek-R1's own template: the generation prompt always opens <think>, enable_thinking unread
R1 = "{% for m in messages %}<｜User｜>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
PLAIN = "{% for m in messages %}<|user|>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"

# family -> (template source, the generation prompt's end with thinking on, with it off)
FAMILIES = {
    "qwen3": (bundled("qwen3"), "<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    "qwen3.6": (bundled("qwen3.6"), "<|im_start|>assistant\n<think>\n", "<think>\n\n</think>\n\n"),
    "glm45": (bundled("glm45"), "<|assistant|>", "<|assistant|>\n<think></think>"),
    "deepseek-v3.1": (bundled("deepseek"), "<｜Assistant｜><think>", "<｜Assistant｜></think>"),
    "deepseek-r1": (R1, "<｜Assistant｜><think>\n", "<｜Assistant｜><think>\n</think>"),
    "gpt-oss": (bundled("gpt-oss"), "<|start|>assistant", "<|start|>assistant" + HARMONY_NO_ANALYSIS),
}


def render(source: str, mode: str = "auto", kwargs: dict | None = None, budget: int | None = None) -> str:
    extras = template_kwargs(ReasoningDefault(mode), source, kwargs or {}, budget)
    return ChatTemplate(source).render(ASK, extras=extras)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_on_and_off_per_family(family):
    source, on, off = FAMILIES[family]
    assert render(source, "on").endswith(on)
    assert render(source, "off").endswith(off)
    assert not render(source, "on").endswith(off)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_request_overrides_the_server(family):
    source, on, off = FAMILIES[family]
    assert render(source, "on", {"enable_thinking": False}).endswith(off)
    assert render(source, "off", {"enable_thinking": True}).endswith(on)
    assert render(source, "on", budget=0).endswith(off)  # a budget of 0: no thinking


def test_auto_thinks_where_the_template_can():
    assert render(bundled("qwen3.6")).endswith("<think>\n")
    assert render(R1).endswith("<think>\n")
    assert render(bundled("deepseek")).endswith("</think>")  # DeepSeek-V3.1 thinks only when asked, as llama-server
    assert not can_think(PLAIN) and can_think(R1) and can_think(bundled("gpt-oss"))
    assert render(PLAIN, "off") == render(PLAIN, "on") == "<|user|>What is today?<|assistant|>"


def test_no_generation_prompt_no_thinking_form():
    extras = template_kwargs(ReasoningDefault("off"), R1, {})
    assert ChatTemplate(R1).render(ASK, add_generation_prompt=False, extras=extras) == "<｜User｜>What is today?"


def test_enable_thinking_must_be_a_boolean():
    with pytest.raises(ReasoningError, match='invalid type for "enable_thinking"') as e:
        template_kwargs(ReasoningDefault(), R1, {"enable_thinking": "false"})
    assert e.value.param == "chat_template_kwargs.enable_thinking"


@pytest.mark.parametrize("value,ok", [(None, None), (-1, -1), (0, 0)])
def test_budgets_spark_honours(value, ok):
    assert check_budget(value, "reasoning_budget_tokens") == ok


@pytest.mark.parametrize("value", [1, 512, -2, "0", True])
def test_budgets_spark_refuses(value):
    with pytest.raises(ReasoningError, match="reasoning_budget_tokens"):
        check_budget(value, "reasoning_budget_tokens")


def test_a_bad_reasoning_field_is_a_400_in_openais_shape():
    pytest.importorskip("httpx")
    from _serve_client import fake_client
    from test_serve_hostile import _Engine

    chat = {"messages": ASK, "max_tokens": 1}
    with fake_client(lambda: _Engine(n_ctx=256)) as tc:
        r = tc.post("/v1/chat/completions", json={**chat, "chat_template_kwargs": {"enable_thinking": "no"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.enable_thinking", r.text
        r = tc.post("/v1/chat/completions", json={**chat, "reasoning_budget_tokens": 100})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_budget_tokens", r.text
        assert tc.post("/v1/chat/completions", json={**chat, "thinking_budget_tokens": 0}).status_code == 200


def test_apply_template_renders_off_and_honours_add_generation_prompt():
    """Through the server: --reasoning off reaches the template, a request turns it back on, and
    add_generation_prompt: false opens no assistant turn."""
    pytest.importorskip("httpx")
    from _serve_client import fake_client
    from test_serve_hostile import _Engine

    from spark_cli.serve.chat import ChatConfig

    class R1Engine(_Engine):
        def chat_prompt(self, messages, add_generation_prompt=True, tools=None, extras=None):
            return ChatTemplate(R1).render(messages, add_generation_prompt=add_generation_prompt, extras=extras)

    config = ChatConfig(thinking=ReasoningDefault("off"), template_source=R1)
    with fake_client(lambda: R1Engine(n_ctx=256), chat=config) as tc:
        prompt = lambda **kw: tc.post("/apply-template", json={"messages": ASK, **kw}).json()["prompt"]  # noqa: E731
        assert prompt().endswith("<think>\n</think>")
        assert prompt(chat_template_kwargs={"enable_thinking": True}).endswith("<think>\n")
        assert prompt(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}).endswith("</think>")
        assert prompt(add_generation_prompt=False) == "<｜User｜>What is today?"


@pytest.mark.parametrize("args,want", [
    (["--reasoning", "maybe"], "--reasoning maybe: expected one of on, off, auto"),
    (["--reasoning-budget", "256"], "--reasoning-budget 256: spark serve cannot end thinking"),
])
def test_serve_refuses_what_it_cannot_honour_in_one_line(args, want, monkeypatch, capsys, tmp_path):
    """Refused before any model is opened (the model named does not exist)."""
    from conftest import cli_runner

    from spark_cli.commands import serve as serve_cmd

    rc, out, err = cli_runner(monkeypatch, capsys, "serve", serve_cmd.register)(tmp_path / "none.gguf", *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and out == "" and len(lines) == 1 and want in lines[0], err


def test_continue_final_message_and_add_generation_prompt_exclude_each_other():
    pytest.importorskip("httpx")
    from _serve_client import fake_client
    from test_serve_hostile import _Engine

    msgs = [*ASK, {"role": "assistant", "content": "Hello"}]
    with fake_client(lambda: _Engine(n_ctx=256)) as tc:
        r = tc.post("/v1/chat/completions", json={"messages": msgs, "continue_final_message": True, "max_tokens": 1})
        assert r.status_code == 400 and "Cannot set both add_generation_prompt" in r.json()["error"]["message"]
        r = tc.post("/v1/chat/completions", json={"messages": msgs, "continue_final_message": True,
                                                  "add_generation_prompt": False, "max_tokens": 1})
        assert r.status_code == 200, r.text


def test_chat_template_flag_is_a_builtin_name_or_jinja():
    from spark_cli.core.chat_template import DEFAULT_NAME, from_flag
    from spark_cli.errors import UsageError

    assert from_flag("command-r").builtin == "command-r" and not from_flag("command-r").templates
    assert from_flag("{{ messages[0].content }}").templates == {DEFAULT_NAME: "{{ messages[0].content }}"}
    with pytest.raises(UsageError, match="--chat-template: "):
        from_flag("{% if %}")
