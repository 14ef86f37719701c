"""vram: KV cache bytes per type, compute buffer estimate, --vram sizes."""

from __future__ import annotations

import pytest
from _geometry import make_geometry

from spark_cli.errors import PlanError, UsageError
from spark_cli.core.units import GiB, MiB, parse_size
from spark_cli.core.vram import COMPUTE_FLOOR_BYTES, DEVICE_OVERHEAD_BYTES, compute_buffer_bytes, kv_cache_bytes, row_bytes


@pytest.mark.parametrize("t,n,expected", [
    ("f32", 64, 256), ("f16", 64, 128), ("bf16", 64, 128), ("q8_0", 64, 68), ("q4_0", 64, 36),
    ("q4_1", 64, 40), ("q5_0", 64, 44), ("q5_1", 64, 48), ("Q8_0", 32, 34), ("q8_0", 40, 68),
])
def test_row_bytes(t: str, n: int, expected: int) -> None:
    assert row_bytes(t, n) == expected


def test_unknown_type() -> None:
    with pytest.raises(UsageError, match="unknown KV cache type 'q3_k'"):
        row_bytes("q3_k", 64)


def test_kv_type_table_matches_ggml() -> None:
    """The one KV type table: ids and block layouts as ggml's (checked against the gguf package)."""
    import gguf

    from spark_cli.core.vram import KV_TYPES

    for name, t in KV_TYPES.items():
        q = gguf.GGMLQuantizationType[name.upper()]
        assert t.ggml_id == int(q), name
        assert (t.block, t.block_bytes) == gguf.GGML_QUANT_SIZES[q], name


def test_kv_f16_by_hand() -> None:
    g = make_geometry(n_layer=4, n_head_kv=2, head_dim=64)
    # 4 layers x 1024 cells (1000 padded to 256) x (K + V) x 2 heads x 64 dims x 2 bytes
    assert kv_cache_bytes(g, 1000) == 4 * 1024 * 2 * 2 * 64 * 2
    assert kv_cache_bytes(g, 1024) == kv_cache_bytes(g, 1000)


@pytest.mark.parametrize("t,ratio", [("q8_0", 34 / 64), ("q4_0", 18 / 64), ("q5_1", 24 / 64), ("f32", 2.0)])
def test_kv_types_scale(t: str, ratio: float) -> None:
    g = make_geometry()
    f16 = kv_cache_bytes(g, 4096)
    assert kv_cache_bytes(g, 4096, t, t) == pytest.approx(f16 * ratio)
    assert kv_cache_bytes(g, 4096, "f16", t) == pytest.approx(f16 * (1 + ratio) / 2)


def test_kv_skips_layers_without_cache_and_adds_state() -> None:
    g = make_geometry(n_layer=4, kv_heads=(0, 0, 0, 2), recurrent_state=12345)
    assert kv_cache_bytes(g, 256) == 256 * 2 * 2 * 64 * 2 + 12345
    nextn = make_geometry(n_layer=4, nextn=1)
    assert kv_cache_bytes(nextn, 256) == 3 * 256 * 2 * 2 * 64 * 2


def test_kv_mla_has_no_v() -> None:
    g = make_geometry(n_layer=2, n_head_kv=1, head_dim=576, is_mla=True)
    assert kv_cache_bytes(g, 512) == 2 * 512 * 576 * 2


def test_kv_sliding_window() -> None:
    full = make_geometry(n_layer=2)
    swa = make_geometry(n_layer=2, swa=(True, False), sliding_window=128)
    per_cell = 2 * 2 * 64 * 2
    # the SWA layer keeps window + ubatch cells (640 padded to 768), the other all 32768
    assert kv_cache_bytes(swa, 32768) == (768 + 32768) * per_cell
    assert kv_cache_bytes(full, 32768) == 2 * 32768 * per_cell
    assert kv_cache_bytes(swa, 256) == kv_cache_bytes(full, 256)


@pytest.mark.parametrize("n_ctx,n_seq,unified,cells,streams", [
    (4096, 1, False, 4096, 1),
    (4096, 3, False, 1536, 3),  # pad256(4096 / 3): llama.cpp rounds n_ctx to 3 x 1536
    (4096, 4, False, 1024, 4),
    (4096, 3, True, 4096, 1),  # one stream of all of -c
    (1000, 2, False, 512, 2),  # n_ctx padded first (1024), then split
    (256, 256, False, 256, 256),  # llama.cpp's LLAMA_MAX_SEQ sequences of one 256-cell stream each
])
def test_kv_sequences_split_the_context(n_ctx, n_seq, unified, cells, streams) -> None:
    """-np/--kv-unified as llama.cpp's llama_context and llama_kv_cache: n_ctx_seq cells per stream,
    one stream per sequence unless unified; recurrent state once per sequence either way."""
    from spark_cli.core.vram import kv_ctx_seq, kv_streams

    assert (kv_ctx_seq(n_ctx, n_seq, unified), kv_streams(n_seq, unified)) == (cells, streams)
    g = make_geometry(n_layer=4, kv_heads=(0, 0, 0, 2), recurrent_state=12345)
    assert kv_cache_bytes(g, n_ctx, n_seq=n_seq, unified=unified) == cells * streams * 2 * 2 * 64 * 2 + n_seq * 12345


def test_kv_sliding_window_with_sequences() -> None:
    """The window's ring per stream: pad256(min(n_ctx_seq, window * (n_seq if unified else 1) + ubatch))."""
    from spark_cli.core.vram import kv_cells

    swa = make_geometry(n_layer=2, swa=(True, False), sliding_window=128)
    per_cell = 2 * 2 * 64 * 2
    assert kv_cells(swa, 4096, 0, 512, n_seq=3) == 768  # 128 + 512 in each of 3 streams of 1536
    assert kv_cells(swa, 4096, 0, 512, n_seq=3, unified=True) == 1024  # 3 x 128 + 512, one stream
    assert kv_cells(swa, 4096, 0, 512, n_seq=16) == 256  # capped at a stream's 256 cells
    assert kv_cache_bytes(swa, 4096, n_seq=3) == 3 * (768 + 1536) * per_cell
    assert kv_cache_bytes(swa, 4096, n_seq=3, unified=True) == (1024 + 4096) * per_cell


def test_compute_buffer() -> None:
    tiny = make_geometry(n_vocab=10)
    assert compute_buffer_bytes(tiny, 512) == COMPUTE_FLOOR_BYTES
    big = make_geometry(n_vocab=151936, n_embd=2048, n_head=32, head_dim=128)
    cb = compute_buffer_bytes(big, 4096)
    assert cb >= 512 * 151936 * 4  # logits of a full ubatch dominate
    assert compute_buffer_bytes(big, 4096, n_ubatch=1024) > cb
    assert compute_buffer_bytes(big, 32768) > cb
    assert DEVICE_OVERHEAD_BYTES == 300 * MiB


@pytest.mark.parametrize("text,expected", [
    ("16GiB", 16 * GiB), ("16G", 16 * GiB), ("16GB", 16 * GiB), ("16 gib", 16 * GiB), ("1.5GiB", 3 * GiB // 2),
    ("900MiB", 900 * MiB), ("900M", 900 * MiB), ("512k", 512 << 10), ("16000000000", 16_000_000_000),
    ("1T", 1 << 40), ("123b", 123), (" 8GiB ", 8 * GiB), (4096, 4096), (".5G", GiB // 2),
])
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1G", "1.5", "16GiX", "0", "0G", "16 ib", "G", "1e9"])
def test_parse_size_errors(text: str) -> None:
    with pytest.raises(UsageError, match="^--vram: ") as e:
        parse_size(text)
    assert "\n" not in e.value.one_line()


def test_parse_size_names_other_flags() -> None:
    with pytest.raises(UsageError, match="^--host-ram: "):
        parse_size("lots", flag="--host-ram")
