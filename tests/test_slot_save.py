"""Slot save and restore with --slot-save-path (issue 49): names confined to the folder (no
separators, no `..`, no symlink out), the file round trip, another model's file refused, and the
route's answers and errors (llama-server's); the model tier saves a real slot and restores it into
another, which then reuses the prompt."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spark_cli.files.slot_file import SlotFileError, decode, encode, load, save, slot_path


@pytest.mark.parametrize("name", ["", ".", "..", "../x.bin", "a/b.bin", "/etc/passwd", "a\\b", "x\x00y", "x\ny",
                                  " lead.bin", "x" * 256])
def test_names_outside_one_plain_file_are_refused(tmp_path, name):
    with pytest.raises(SlotFileError, match="Invalid filename"):
        slot_path(tmp_path, name)


def test_a_symlink_out_of_the_folder_is_refused(tmp_path):
    folder, outside = tmp_path / "slots", tmp_path / "secret"
    folder.mkdir()
    outside.write_bytes(b"x")
    (folder / "link.bin").symlink_to(outside)
    with pytest.raises(SlotFileError, match="leads out of the slot folder"):
        slot_path(folder, "link.bin")
    with pytest.raises(SlotFileError):
        save(folder, "link.bin", "m", [1], b"state")
    assert outside.read_bytes() == b"x"  # not written through the link
    (folder / "inside.bin").write_bytes(b"")
    (folder / "alias.bin").symlink_to(folder / "inside.bin")
    assert slot_path(folder, "alias.bin") == folder / "alias.bin"  # a link within the folder is fine


def test_round_trip_and_another_models_file(tmp_path):
    n = save(tmp_path, "s.bin", "model-a", [5, 6, 7], b"\x01\x02state")
    assert n == os.path.getsize(tmp_path / "s.bin")
    assert load(tmp_path, "s.bin", "model-a") == ([5, 6, 7], b"\x01\x02state", n)
    with pytest.raises(SlotFileError, match="saved from another model"):
        load(tmp_path, "s.bin", "model-b")
    assert [p.name for p in tmp_path.iterdir()] == ["s.bin"]  # no temp file left


@pytest.mark.parametrize("data,why", [
    (b"GGSQ\x00\x00", "not a Spark slot file"),
    (encode("m", [1, 2, 3], b"")[:-6], "cut short"),
])
def test_foreign_or_cut_files_are_refused(data, why):
    with pytest.raises(SlotFileError, match=why):
        decode(data, "m")


def test_missing_file(tmp_path):
    with pytest.raises(SlotFileError, match="no such slot file"):
        load(tmp_path, "none.bin", "m")


class _SlotEngine:
    """A fake engine's sequence states: bytes of the tokens it held."""

    def seq_state(self, seq):
        return bytes(self.pos[seq] for _ in range(1)) + b"|kv"

    def seq_restore(self, seq, state, n_tokens):
        if not state.endswith(b"|kv"):
            return False
        self.pos[seq] = n_tokens
        return True


def _client(folder: Path | None):
    pytest.importorskip("httpx")
    from _serve_client import fake_client
    from test_serve_hostile import _Engine

    class Engine(_SlotEngine, _Engine):
        pass

    return fake_client(lambda: Engine(n_ctx=256, n_seq=2), slot_save_path=folder, model_id="fake-model")


def test_save_restore_erase_through_the_server(tmp_path):
    with _client(tmp_path) as tc:
        r = tc.post("/completion", json={"prompt": "a b c d", "id_slot": 1, "n_predict": 2})
        assert r.status_code == 200, r.text
        r = tc.post("/slots/1?action=save", json={"filename": "one.bin"})
        body = r.json()
        assert r.status_code == 200 and body["id_slot"] == 1 and body["filename"] == "one.bin", r.text
        assert body["n_saved"] > 0 and body["n_written"] == os.path.getsize(tmp_path / "one.bin")
        r = tc.post("/slots/0?action=restore", json={"filename": "one.bin"})
        assert r.status_code == 200 and r.json()["n_restored"] == body["n_saved"], r.text
        slots = {s["id"]: s for s in tc.get("/slots").json()}
        assert slots[0]["n_cached_tokens"] == body["n_saved"]
        r = tc.post("/slots/0?action=erase")
        assert r.json() == {"id_slot": 0, "n_erased": body["n_saved"]}


@pytest.mark.parametrize("url,body,status,words", [
    ("/slots/x?action=save", {"filename": "a.bin"}, 400, "Invalid slot ID"),
    ("/slots/0?action=fly", {"filename": "a.bin"}, 400, "Invalid action"),
    ("/slots/0?action=save", {"filename": "../a.bin"}, 400, "Invalid filename"),
    ("/slots/0?action=save", {}, 400, '"filename"'),
    ("/slots/0?action=restore", {"filename": "none.bin"}, 400, "no such slot file"),
    ("/slots/9?action=erase", None, 400, "id_slot: 9 is not a slot"),
])
def test_bad_slot_actions_are_400s_and_the_server_goes_on(tmp_path, url, body, status, words):
    with _client(tmp_path) as tc:
        r = tc.post(url, json=body)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
        assert tc.post("/slots/0?action=erase").status_code == 200


def test_another_models_file_is_a_400(tmp_path):
    save(tmp_path, "other.bin", "another-model", [1, 2], b"|kv")
    with _client(tmp_path) as tc:
        r = tc.post("/slots/0?action=restore", json={"filename": "other.bin"})
        assert r.status_code == 400 and "saved from another model" in r.json()["error"]["message"], r.text


def test_without_slot_save_path_slot_actions_are_not_supported():
    with _client(None) as tc:
        r = tc.post("/slots/0?action=save", json={"filename": "a.bin"})
        assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"], r.text


@pytest.mark.model
def test_a_saved_slot_restores_into_another_and_is_reused(tmp_path):
    """The real engine: the state saved from sequence 1 restored into sequence 0 gives the same
    logits for the next token as sequence 1 (the KV cache came across)."""
    import numpy as np

    from spark_cli.models.tiny_models import build_tiny_model
    from spark_cli.native.engine import Engine, EngineOptions

    with Engine(EngineOptions(build_tiny_model("llama"), n_ctx=512, n_seq=2, device="none", repack=False,
                              n_threads=1)) as eng:
        toks = eng.vocab.tokenize("What is the capital of France?")
        eng.decode([(t, 1, False) for t in toks])
        save(tmp_path, "s.bin", "m", toks, eng.seq_state(1))
        got, state, _ = load(tmp_path, "s.bin", "m")
        assert eng.seq_restore(0, state, len(got)) and eng.seq_pos(0) == len(toks)
        eng.decode([(42, 0, True), (42, 1, True)])
        assert np.allclose(eng.logits_row(0), eng.logits_row(1), atol=1e-4)
        assert not eng.seq_restore(0, b"garbage", 3) and eng.seq_pos(0) == 0
