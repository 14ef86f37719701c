"""llama-server's flags on spark serve (issue 49): --alias with several names and --tags reach
/v1/models as llama-server lists them."""

from __future__ import annotations

import pytest

from spark_cli.serve.wiring import names


def test_names_are_sorted_once_each():
    assert names("tinyllama-2, fim,code,fim") == ("code", "fim", "tinyllama-2")
    assert names(None) == names(" , ") == ()


def test_models_lists_aliases_and_tags():
    pytest.importorskip("httpx")
    from _serve_client import fake_client
    from test_serve_hostile import _Engine

    with fake_client(lambda: _Engine(n_ctx=256), aliases=("fake.gguf", "fim"), tags=("chat",)) as tc:
        card = tc.get("/models").json()["data"][0]
    assert (card["id"], card["aliases"], card["tags"]) == ("fake.gguf", ["fake.gguf", "fim"], ["chat"])
    with fake_client(lambda: _Engine(n_ctx=256)) as tc:
        card = tc.get("/models").json()["data"][0]
    assert (card["aliases"], card["tags"]) == (["fake.gguf"], [])
