"""Model geometry from a GGUF header: experts, bytes per layer, fingerprint.

Only the header is parsed (through an mmap, by a small reader of the GGUF spec:
`gguf.GGUFReader` parses every vocabulary string into numpy views, which takes
seconds to tens of seconds for a 150k-token vocabulary) and, for the fingerprint,
4 KiB from the start of a few tensors' data. `gguf` supplies the type tables.
Split models (`-00001-of-00003.gguf`) are read shard by shard.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import ModelFileError
from .registry import GENERIC_EXPERT_PATTERN, GENERIC_SHARED_PATTERN, Family, family_for

EXPERT_KINDS = ("gate", "up", "down", "gate_up")
_KIND_RE = re.compile(r"\.ffn_(gate_up|gate|up|down)_(?:ch)?exps\.")
_EXPERT_BIAS_RE = re.compile(r"\.ffn_(gate_up|gate|up|down)_(?:ch)?exps\.bias$")
_BLK_RE = re.compile(r"^blk\.(\d+)\.")
_SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
FINGERPRINT_SAMPLE = 4096


@dataclass(frozen=True)
class ExpertTensor:
    name: str
    kind: str  # gate | up | down | gate_up
    ggml_type: str  # e.g. "Q4_K"
    n_bytes: int
    bytes_per_expert: int
    n_expert: int
    params_per_expert: int = 0  # weights (elements) of one expert's slice


@dataclass(frozen=True)
class LayerGeometry:
    index: int
    is_moe: bool
    experts: tuple[ExpertTensor, ...]
    expert_bytes_per_expert: int  # sum over the layer's expert tensors
    shared_bytes: int  # shared experts ffn_*_shexp*
    other_bytes: int  # attention, norms, router, expert biases, ...
    expert_bias_bytes: int = 0  # part of other_bytes; --n-cpu-moe moves them to the CPU too
    is_nextn: bool = False  # MTP block: in the file, not loaded by llama.cpp by default
    matrix_params: int = 0  # weights (elements) of its non-expert matrices: attention, shared experts, router

    @property
    def expert_params_per_expert(self) -> int:
        return sum(t.params_per_expert for t in self.experts)

    @property
    def n_expert(self) -> int:
        return self.experts[0].n_expert if self.experts else 0

    @property
    def expert_bytes(self) -> int:
        return sum(t.n_bytes for t in self.experts)

    @property
    def nonexpert_bytes(self) -> int:
        return self.shared_bytes + self.other_bytes


@dataclass(frozen=True)
class ModelGeometry:
    path: str
    arch: str
    n_layer: int  # block_count, MTP blocks included
    n_expert: int
    n_expert_used: int
    n_embd: int
    n_head: int
    n_head_kv: int
    key_length: int
    value_length: int
    context_length: int
    layers: tuple[LayerGeometry, ...]
    global_bytes: int  # tok_embd, output, output_norm, ...
    file_size: int
    fingerprint: str
    tensor_layout_hash: str
    chat_template: str | None
    known_family: bool = True
    n_vocab: int = 0
    n_ff_exp: int = 0
    token_embd_bytes: int = 0  # llama.cpp keeps the input embeddings on the CPU
    output_tied: bool = False  # no output.weight: tok_embd doubles as the output matrix
    kv_heads: tuple[int, ...] = ()  # per layer; 0 = no KV cache (recurrent or MTP)
    swa_layers: tuple[bool, ...] = ()
    sliding_window: int = 0
    is_mla: bool = False  # K cache holds the compressed latent, no V cache
    recurrent_state_bytes: int = 0  # f32 recurrent state of all recurrent layers, one sequence
    recurrent_layers: tuple[bool, ...] = ()  # per layer: holds a recurrent state (MTP blocks excluded)
    n_layer_nextn: int = 0
    chat_templates: tuple[tuple[str, str], ...] = ()  # every tokenizer.chat_template[.NAME] key and its text
    pooling_type: int = -1  # <arch>.pooling_type (llama_pooling_type; -1: not given)
    has_classifier: bool = False  # cls.* tensors: a reranker's head (pooling rank)
    causal: bool = True  # <arch>.attention.causal (False: an encoder, BERT's kind: it embeds, never generates)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(l.index for l in self.layers if l.is_moe and not l.is_nextn)

    @property
    def total_expert_bytes(self) -> int:
        return sum(l.expert_bytes for l in self.layers if not l.is_nextn)

    @property
    def device_global_bytes(self) -> int:
        """Global tensors that llama.cpp puts on the device: all but the input embeddings,
        unless they are tied to the output."""
        return self.global_bytes - (0 if self.output_tied else self.token_embd_bytes)

    def identity(self) -> dict[str, Any]:
        return {
            "arch": self.arch,
            "n_layer": self.n_layer,
            "n_expert": self.n_expert,
            "n_expert_used": self.n_expert_used,
            "fingerprint": self.fingerprint,
            "tensor_layout_hash": self.tensor_layout_hash,
        }


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_KEEP_ARRAY = 4096  # longer arrays (vocab, merges, scores) are skipped; only their length is kept


class _Truncated(Exception):
    pass


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: ne0, ne1, ...
    ggml_type: str
    n_bytes: int
    data_offset: int  # absolute, within its shard


@dataclass
class _Shard:
    path: Path
    size: int
    kv: dict[str, Any] = field(default_factory=dict)
    array_len: dict[str, int] = field(default_factory=dict)
    tensors: list[_TensorInfo] = field(default_factory=list)


class _Cursor:
    """Reads little-endian GGUF header values; running past the end raises _Truncated."""

    def __init__(self, buf: mmap.mmap, shard: _Shard):
        self.buf, self.pos, self.shard = buf, 0, shard

    def skip(self, n: int) -> None:
        self.pos += n
        if self.pos > len(self.buf):
            raise _Truncated()

    def unpack(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        if self.pos + n > len(self.buf):
            raise _Truncated()
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        start = self.pos
        self.skip(n)
        return bytes(self.buf[start: self.pos]).decode("utf-8", "replace")

    def value(self, vtype: int, key: str) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype != _ARRAY:
            raise ValueError(f"unknown value type {vtype} for key {key}")
        itype, count = self.unpack("<I"), self.unpack("<Q")
        self.shard.array_len[key] = count
        if count <= _KEEP_ARRAY:
            return [self.value(itype, key) for _ in range(count)]
        if itype in _SCALARS:
            self.skip(count * struct.calcsize(_SCALARS[itype]))
        elif itype == _STRING:
            for _ in range(count):  # lengths only: ~0.1 s for a 256k-token vocabulary
                self.skip(self.unpack("<Q"))
        else:
            raise ValueError(f"unsupported array of type {itype} for key {key}")
        return None


def _parse(path: Path, size: int) -> _Shard:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    shard = _Shard(path, size)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(buf, shard)
        c.skip(4)
        version = c.unpack("<I")
        if version & 0xFFFF == 0:
            raise ValueError("big-endian GGUF is not supported")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")
        n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
        for _ in range(n_kv):
            key = c.string()
            shard.kv[key] = c.value(c.unpack("<I"), key)
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            n_dims = c.unpack("<I")
            if n_dims > 8:
                raise ValueError(f"tensor {name} has {n_dims} dims")
            shape = tuple(c.unpack("<Q") for _ in range(n_dims))
            infos.append((name, shape, c.unpack("<I"), c.unpack("<Q")))
        header_end = c.pos
    align = shard.kv.get("general.alignment", 32)
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"bad general.alignment {align!r}")
    data_start = -(-header_end // align) * align
    for name, shape, tid, off in infos:
        try:
            qtype = GGMLQuantizationType(tid)
            block, tsize = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name} has unknown ggml type {tid}") from None
        n_elem = 1
        for d in shape:
            n_elem *= d
        shard.tensors.append(_TensorInfo(name, shape, qtype.name, n_elem * tsize // block, data_start + off))
    return shard


def _open(path: Path) -> _Shard:
    if not path.exists():
        raise ModelFileError(f"{path}: no such file", hint="check the path; omit MODEL to use the demo model")
    if not path.is_file():
        raise ModelFileError(f"{path}: not a regular file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFileError(f"{path}: not a GGUF file (bad magic)", hint="expected a .gguf model")
    try:
        shard = _parse(path, size)
    except _Truncated:
        raise ModelFileError(f"{path}: truncated GGUF (the header runs past the end of the {size}-byte file)",
                             hint="download the file again") from None
    except ValueError as e:
        raise ModelFileError(f"{path}: corrupt GGUF ({' '.join(str(e).split())[:160]})",
                             hint="download the file again") from None
    end = max((t.data_offset + t.n_bytes for t in shard.tensors), default=0)
    if end > size:
        raise ModelFileError(f"{path}: truncated GGUF (tensor data ends at byte {end}, the file has {size})",
                             hint="download the file again")
    return shard


def _shards(path: Path) -> list[_Shard]:
    first = _open(path)
    n_split = first.kv.get("split.count") or 1
    if n_split <= 1:
        return [first]
    m = _SPLIT_RE.search(path.name)
    if not m:
        raise ModelFileError(f"{path}: split GGUF ({n_split} parts) without a -0000i-of-0000n name")
    shards = []
    for i in range(1, int(n_split) + 1):
        p = path.with_name(_SPLIT_RE.sub(f"-{i:05d}-of-{int(n_split):05d}.gguf", path.name))
        shards.append(first if p == path else _open(p))
    return shards


def _per_layer(v: Any, n: int, default: int) -> tuple[int, ...]:
    if v is None:
        return (default,) * n
    if isinstance(v, list):
        vals = [int(x) for x in v] + [int(v[-1]) if v else default] * max(0, n - len(v))
        return tuple(vals[:n])
    return (int(v),) * n


def _kind(name: str) -> str:
    m = _KIND_RE.search(name)
    return m.group(1) if m else ""


def tensor_offsets(path: str | os.PathLike[str]) -> dict[str, int]:
    """Each tensor's first byte in a one-file GGUF (a split model's: in its first part only)."""
    return {t.name: t.data_offset for t in _open(Path(path)).tensors}


def load_geometry(path: str | os.PathLike[str], require_moe: bool = True) -> ModelGeometry:
    """Read a GGUF's geometry without loading weights; ModelFileError names the path."""
    path = Path(path)
    shards = _shards(path)
    try:
        return _geometry(path, shards, require_moe)
    except (TypeError, ValueError, IndexError) as e:  # metadata of the wrong type or shape
        raise ModelFileError(f"{path}: unexpected GGUF metadata ({' '.join(str(e).split())[:160]})") from None


def _geometry(path: Path, shards: list[_Shard], require_moe: bool) -> ModelGeometry:
    kv = shards[0].kv
    arch = kv.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFileError(f"{path}: GGUF without general.architecture")
    fam: Family | None = family_for(arch)

    def key(k: str) -> Any:
        return kv.get(f"{arch}.{k}")

    n_layer = int(key("block_count") or 0)
    tensors = [(s, t) for s in shards for t in s.tensors]
    if n_layer <= 0:
        n_layer = 1 + max((int(m.group(1)) for _, t in tensors if (m := _BLK_RE.match(t.name))), default=-1)
    n_nextn = int(key("nextn_predict_layers") or 0)
    scan = _scan_tensors(path, arch, fam, tensors, n_layer)
    layers = tuple(
        LayerGeometry(
            index=i, is_moe=bool(scan.experts[i]), experts=tuple(scan.experts[i]),
            expert_bytes_per_expert=sum(e.bytes_per_expert for e in scan.experts[i]),
            shared_bytes=scan.shared[i], other_bytes=scan.other[i], expert_bias_bytes=scan.bias[i],
            is_nextn=i >= n_layer - n_nextn, matrix_params=scan.matrix[i],
        )
        for i in range(n_layer)
    )
    n_expert, n_used = _expert_counts(path, arch, key, layers, require_moe)

    n_embd = int(key("embedding_length") or 0)
    heads = _per_layer(key("attention.head_count"), n_layer, 0)
    heads_kv = _per_layer(key("attention.head_count_kv"), n_layer, 0)
    heads_kv = tuple(kv or h for kv, h in zip(heads_kv, heads))
    n_head = max(heads, default=0)
    head_dim = n_embd // n_head if n_head else 0
    recurrent = _recurrent_layers(key, fam, n_layer)
    kv_heads = tuple(0 if (recurrent[i] or layers[i].is_nextn) else heads_kv[i] for i in range(n_layer))
    conv, inner, state, groups = (int(key(f"ssm.{k}") or 0)
                                  for k in ("conv_kernel", "inner_size", "state_size", "group_count"))
    per_rec = (max(conv - 1, 0) * (inner + 2 * groups * state) + state * inner) * 4
    recurrent_state = per_rec * sum(1 for i in range(n_layer) if recurrent[i] and not layers[i].is_nextn)
    n_swa = int(key("attention.sliding_window") or 0)
    vocab = key("vocab_size") or shards[0].array_len.get("tokenizer.ggml.tokens") or scan.vocab_from_embd
    tmpl = kv.get("tokenizer.chat_template")
    return ModelGeometry(
        path=str(path), arch=arch, n_layer=n_layer, n_expert=n_expert,
        n_expert_used=n_used, n_embd=n_embd, n_head=n_head,
        n_head_kv=max(heads_kv, default=0), key_length=int(key("attention.key_length") or head_dim),
        value_length=int(key("attention.value_length") or head_dim),
        context_length=int(key("context_length") or 0), layers=layers, global_bytes=scan.global_bytes,
        file_size=sum(s.size for s in shards), fingerprint=_fingerprint(scan.layout, tensors),
        tensor_layout_hash=scan.layout.hexdigest(), chat_template=tmpl if isinstance(tmpl, str) else None,
        known_family=fam is not None, n_vocab=int(vocab or 0), n_ff_exp=scan.n_ff_exp,
        token_embd_bytes=scan.token_embd, output_tied=not scan.has_output, kv_heads=kv_heads,
        swa_layers=_swa_layers(key, fam, n_layer, n_swa), sliding_window=n_swa,
        is_mla=bool(key("attention.key_length_mla")), recurrent_state_bytes=recurrent_state, n_layer_nextn=n_nextn,
        recurrent_layers=tuple(bool(recurrent[i] and not layers[i].is_nextn) for i in range(n_layer)),
        chat_templates=tuple((k, v) for k, v in kv.items()
                             if k.startswith("tokenizer.chat_template") and isinstance(v, str)),
        pooling_type=int(key("pooling_type")) if isinstance(key("pooling_type"), int) else -1,
        has_classifier=any(t.name.startswith("cls.") for _, t in tensors),
        causal=key("attention.causal") is not False,
    )


@dataclass
class _Scan:
    """What the tensor list says: bytes per layer by kind, the expert tensors, the layout hash."""

    layout: Any
    experts: list[list[ExpertTensor]]
    shared: list[int]
    other: list[int]
    bias: list[int]
    matrix: list[int]
    global_bytes: int = 0
    token_embd: int = 0
    has_output: bool = False
    n_ff_exp: int = 0
    vocab_from_embd: int = 0


def _scan_tensors(path: Path, arch: str, fam: Family | None, tensors: list, n_layer: int) -> _Scan:
    s = _Scan(hashlib.sha256(arch.encode()), [[] for _ in range(n_layer)], *([0] * n_layer for _ in range(4)))
    for _, t in tensors:
        name, ttype, nbytes, shape = t.name, t.ggml_type, t.n_bytes, list(t.shape)
        s.layout.update(f"\n{name}:{shape}:{ttype}".encode())
        m = _BLK_RE.match(name)
        if not m:
            s.global_bytes += nbytes
            if name == "token_embd.weight":
                s.token_embd = nbytes
                s.vocab_from_embd = shape[-1]
            s.has_output |= name == "output.weight"
            continue
        il = int(m.group(1))
        if il >= n_layer:
            raise ModelFileError(f"{path}: tensor {name} beyond block_count {n_layer}")
        is_exp = GENERIC_EXPERT_PATTERN.search(name) or (fam is not None and fam.is_expert(name))
        if is_exp and name.endswith(".weight"):
            kind = _kind(name)
            if len(shape) != 3 or kind not in EXPERT_KINDS:
                raise ModelFileError(f"{path}: expert tensor {name} has shape {shape}, expected 3 dims")
            n_exp = shape[2]
            if n_exp <= 0 or nbytes % n_exp:
                raise ModelFileError(f"{path}: expert tensor {name}: {nbytes} bytes not divisible by {n_exp} experts")
            s.experts[il].append(ExpertTensor(name, kind, ttype, nbytes, nbytes // n_exp, n_exp, shape[0] * shape[1]))
            ff = shape[0] if kind == "down" else shape[1] // (2 if kind == "gate_up" else 1)
            s.n_ff_exp = max(s.n_ff_exp, ff)
        elif _EXPERT_BIAS_RE.search(name):
            s.other[il] += nbytes
            s.bias[il] += nbytes
        else:
            if GENERIC_SHARED_PATTERN.search(name) or (fam is not None and fam.is_shared(name)):
                s.shared[il] += nbytes
            else:
                s.other[il] += nbytes
            if len(shape) >= 2 and shape[1] > 1 and name.endswith(".weight"):  # a matrix, not a norm or bias
                s.matrix[il] += math.prod(shape)
    return s


def _expert_counts(path: Path, arch: str, key: Callable[[str], Any], layers: tuple, require_moe: bool
                   ) -> tuple[int, int]:
    """(n_expert, n_expert_used), checked against the expert tensors."""
    counts = {e.n_expert for l in layers for e in l.experts}
    if len(counts) > 1:
        raise ModelFileError(f"{path}: expert tensors disagree on the expert count {sorted(counts)}")
    n_expert = int(key("expert_count") or (counts.pop() if counts else 0))
    if counts and n_expert not in counts:
        raise ModelFileError(f"{path}: {arch}.expert_count = {n_expert} but expert tensors hold {counts.pop()}")
    if require_moe and not any(l.is_moe for l in layers):
        raise ModelFileError(f"{path}: no expert tensors (ffn_*_exps) in this {arch} model",
                             hint="Spark runs Mixture-of-Experts models; use llama.cpp for dense ones")
    n_used = int(key("expert_used_count") or 0)
    if any(l.is_moe for l in layers) and not 0 < n_used <= n_expert:
        raise ModelFileError(f"{path}: {arch}.expert_used_count = {n_used} with {n_expert} experts")
    return n_expert, n_used


def _recurrent_layers(key: Callable[[str], Any], fam: Family | None, n_layer: int) -> list[bool]:
    """Layers without a KV cache in hybrid models (a recurrent state instead)."""
    rec_arr = key("attention.recurrent_layers")
    interval = int(key("full_attention_interval") or (fam.full_attention_interval if fam else 0))
    if isinstance(rec_arr, list):
        return [bool(x) for x in rec_arr][:n_layer] + [False] * max(0, n_layer - len(rec_arr))
    if interval > 0:
        return [(i + 1) % interval != 0 for i in range(n_layer)]
    return [False] * n_layer


def _swa_layers(key: Callable[[str], Any], fam: Family | None, n_layer: int, n_swa: int) -> tuple[bool, ...]:
    """Sliding-window layers, as llama.cpp derives them (pattern key, else the family's period)."""
    if n_swa <= 0:
        return (False,) * n_layer
    pat = key("attention.sliding_window_pattern")
    if isinstance(pat, list):
        return tuple([bool(x) for x in pat][:n_layer] + [False] * max(0, n_layer - len(pat)))
    period = int(pat) if isinstance(pat, int) and pat > 0 else (fam.swa_period if fam else 0)
    dense_first = fam.swa_dense_first if fam else False
    if period > 0:
        return tuple((i % period != 0) if dense_first else (i % period < period - 1) for i in range(n_layer))
    return (True,) * n_layer  # llama.cpp's set_swa_pattern(0): every layer sliding


def _fingerprint(layout: Any, tensors: list) -> str:
    """The layout hash plus a sample of the data of four tensors: a model's identity."""
    fp = hashlib.sha256(layout.digest())
    picks = sorted({0, len(tensors) // 3, 2 * len(tensors) // 3, len(tensors) - 1}) if tensors else []
    for i in picks:
        shard, t = tensors[i]
        with open(shard.path, "rb") as f:
            f.seek(t.data_offset)
            fp.update(f.read(min(FINGERPRINT_SAMPLE, t.n_bytes)))
    return fp.hexdigest()
