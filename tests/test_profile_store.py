"""Folds never lose counts: a held lock, a failed write or a broken profile sends them to a
pending side file that the next fold merges; --reset moves a broken profile aside."""

from __future__ import annotations

import json

import numpy as np
import pytest

from spark_cli.core import profile_store
from spark_cli.files.atomic import file_lock
from spark_cli.errors import ProfileError, SaveError
from spark_cli.core.profile import RoutingProfile

MODEL = {"arch": "qwen3moe", "n_layer": 3, "n_expert": 4, "n_expert_used": 2, "fingerprint": "f" * 64,
         "tensor_layout_hash": "0" * 64}


def _delta(tokens: float, scale: float = 1.0) -> RoutingProfile:
    dec = np.arange(12, dtype=np.float64).reshape(3, 4) * scale
    return profile_store.delta(MODEL, None, dec, 0.0, tokens, "chat")


def _totals(path) -> tuple[float, float]:
    p = RoutingProfile.load(path)
    return p.tokens_decode, float(p.decode.sum())


def test_fold_creates_then_adds(tmp_path):
    path = tmp_path / "m.gguf.spark-profile.json"
    r = profile_store.fold(path, MODEL, _delta(10))
    assert r.created and _totals(path) == (10.0, 66.0)
    profile_store.fold(path, MODEL, _delta(5))
    assert _totals(path)[0] == pytest.approx(15.0, rel=1e-4)


def test_held_lock_keeps_counts_in_a_side_file_that_the_next_fold_merges(tmp_path):
    path = tmp_path / "m.gguf.spark-profile.json"
    profile_store.fold(path, MODEL, _delta(10))
    before = path.read_bytes()
    said = []
    with file_lock(path):  # another process's fold
        with pytest.raises(SaveError) as e:
            profile_store.fold(path, MODEL, _delta(7), timeout=0.2, on_wait=said.append)
    line = e.value.one_line()
    (pending,) = profile_store.pending_files(path)
    assert str(pending) in line and "still held" in line and e.value.exit_code == 1
    assert said and "waiting for" in said[0]
    assert path.read_bytes() == before  # untouched, nothing lost
    profile_store.fold(path, MODEL, _delta(1))
    assert not pending.exists()
    assert _totals(path)[0] == pytest.approx(18.0, rel=1e-4)  # 10 + 7 + 1 (ageing is tiny)


def test_failed_write_beside_the_model_goes_under_spark_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "home"))
    models = tmp_path / "models"
    models.mkdir()
    path = models / "m.gguf.spark-profile.json"
    real = profile_store.atomic_write_text

    def read_only_models(p, *a, **k):
        if str(p).startswith(str(models)):
            raise SaveError(f"{p}: cannot write (Read-only file system)")
        return real(p, *a, **k)

    monkeypatch.setattr(profile_store, "atomic_write_text", read_only_models)
    with pytest.raises(SaveError) as e:
        profile_store.fold(path, MODEL, _delta(4))
    (pending,) = profile_store.pending_files(path)
    assert pending.parent == tmp_path / "home" / "pending" and str(pending) in e.value.one_line()
    monkeypatch.setattr(profile_store, "atomic_write_text", real)
    profile_store.fold(path, MODEL, _delta(2))
    assert _totals(path)[0] == pytest.approx(6.0, rel=1e-4) and not pending.exists()


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "spark-routing-profile", "version": 99})])
def test_broken_profile_is_kept_and_reset_moves_it_aside(tmp_path, content):
    path = tmp_path / "m.gguf.spark-profile.json"
    path.write_text(content)
    with pytest.raises(SaveError) as e:
        profile_store.fold(path, MODEL, _delta(3))
    assert "--reset" in e.value.one_line() and path.read_text() == content
    aside = profile_store.reset(path)
    assert aside is not None and aside.read_text() == content and not path.exists()
    assert aside.name.startswith("m.gguf.spark-profile.json.old-")
    profile_store.fold(path, MODEL, _delta(2))  # fresh, with the pending counts of the broken time
    assert _totals(path)[0] == pytest.approx(5.0, rel=1e-4)
    assert profile_store.pending_files(path) == []


def test_pending_files_of_another_model_are_left_alone(tmp_path):
    path = tmp_path / "m.gguf.spark-profile.json"
    other = dict(MODEL, fingerprint="e" * 64)
    stray = tmp_path / "m.gguf.spark-profile.json.pending-20200101T000000000000Z-1.json"
    stray.write_text(json.dumps(profile_store.delta(other, None, np.ones((3, 4)), 0, 9, "x").to_json()))
    profile_store.fold(path, MODEL, _delta(1))
    assert stray.exists() and _totals(path)[0] == 1.0


def test_a_broken_profile_beside_the_model_never_blocks_a_run(tmp_path):
    from spark_cli.runs import session

    model = tmp_path / "m.gguf"
    path = tmp_path / "m.gguf.spark-profile.json"
    path.write_text("{broken")

    class G:
        def identity(self):
            return MODEL

    info = session.load_profile(model, G())
    assert info.profile is None and "corrupt" in info.problem
    assert "--reset" in info.warning() and "unusable" in info.summary()
    with pytest.raises(ProfileError):  # one asked for by name is still an error
        session.load_profile(model, G(), path)
