"""The demo model's routers: `random` (seeded directions, uneven norms) or `fit` (content-fit).

`fit` runs dense SmolLM2 over the bundled router training text (`data/router/train`, never a
held-out corpus), captures each layer's FFN input (`ffn_norm-<il>`, what the MoE router reads)
and sets each layer's router from a spherical k-means of those states (core/router_fit.py).
The capture uses a fixed thread count and one ubatch per document, so a build is
bit-identical on one machine and llama.cpp build.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from ..core.capture import records_to_trace
from ..core.gguf_info import load_geometry
from ..core.router_fit import fit_router
from ..core.trace import RoutingTrace
from ..errors import ModelFileError
from ..files.corpus import make_chunks, read_corpus

ROUTERS = ("fit", "random")
DEFAULT_ROUTER = "fit"
CAPTURE_THREADS = 1  # fixed: the states (router bytes) do not depend on the cores; one thread also
# never waits on a busy sibling (2 threads on 2 shared cores ran 2.5x slower)
CAPTURE_CTX = 512  # tokens per document piece: one ubatch each


def router_train_corpus() -> Path:
    """Text the fit router learns from (prose, code, chat); tests hold out other text."""
    return Path(__file__).resolve().parents[1] / "data" / "router" / "train"


def router_eval_corpus() -> Path:
    """Held-out text to measure routing on: prose_a (profile), prose_b (held out), code (domain shift)."""
    return Path(__file__).resolve().parents[1] / "data" / "router" / "eval"


def random_router(rng: np.random.Generator, n_expert: int, norm_w: np.ndarray) -> np.ndarray:
    """Router [n_embd, n_expert] (numpy [n_expert, n_embd]): random directions, uneven norms.

    Top-k picks the largest logits, so an expert whose row is longer has a wider logit
    spread and wins more often: popularity is skewed, while the choice still follows the
    direction of each hidden state.
    """
    n_embd = norm_w.shape[0]
    dirs = rng.standard_normal((n_expert, n_embd))
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    gains = np.exp(0.6 * rng.standard_normal(n_expert))
    # ffn_norm output has rms ~ rms(norm_w); aim for a logit spread of ~2 on average
    target = 2.0 / max(float(np.sqrt(np.mean(norm_w.astype(np.float64) ** 2))), 1e-6)
    return (dirs * (gains * target)[:, None]).astype(np.float32)


def fit_routers(src: Path, n_layer: int, n_expert: int, k: int, rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Router rows [E, n_embd] per layer, fit to SmolLM2's FFN inputs on the training text."""
    states = ffn_inputs(src, n_layer)
    return {il: fit_router(states[il], n_expert, k, rng).rows for il in range(n_layer)}


def _chunks(eng, docs) -> list:
    """Documents -> token pieces of one ubatch each (chats through the model's template)."""
    return list(make_chunks(docs, CAPTURE_CTX,
                            tokenize=lambda text, special: eng.vocab.tokenize(text, add_special=False, parse_special=special),
                            render_chat=lambda msgs: eng.vocab.chat_prompt(msgs, add_generation_prompt=False),
                            prefix=eng.vocab.tokenize("", add_special=True)))


def _capture_options(model: Path, **capture) -> "EngineOptions":
    from ..native.engine import EngineOptions

    return EngineOptions(model, n_ctx=CAPTURE_CTX, n_batch=CAPTURE_CTX, n_ubatch=CAPTURE_CTX, device="none",
                         n_threads=CAPTURE_THREADS, n_threads_batch=CAPTURE_THREADS, repack=False, **capture)


def eval_traces(model: Path, corpus: Path | None = None) -> dict[str, RoutingTrace]:
    """The routing trace (prefill rows, every token an output) of each file of the held-out eval text."""
    from ..native.engine import Engine

    geo = load_geometry(model, require_moe=True)
    out = {}
    with Engine(_capture_options(model, capture_topk=True)) as eng:
        for f in sorted((corpus or router_eval_corpus()).iterdir()):
            eng.records.clear()
            for c in _chunks(eng, read_corpus(f).documents):
                eng.reset()
                eng.eval(c.tokens, logits="outputs")
            out[f.stem] = records_to_trace(eng.records, geo.n_layer, geo.n_expert, geo.fingerprint)
    return out


@functools.lru_cache(maxsize=1)
def ffn_inputs(src: Path, n_layer: int) -> tuple[np.ndarray, ...]:
    """Each layer's FFN input [N, n_embd] (float32) on the router training text; once per process."""
    from ..native.engine import Engine

    docs = read_corpus(router_train_corpus()).documents
    per_layer: list[list[np.ndarray]] = [[] for _ in range(n_layer)]
    with Engine(_capture_options(src, capture_hidden="ffn_norm")) as eng:
        for c in _chunks(eng, docs):
            eng.reset()
            eng.hidden.clear()
            eng.eval(c.tokens, logits="outputs")  # every token an output: the last layer sees all of them
            for il, rows in eng.hidden:
                per_layer[il].append(rows)
    if any(not rows for rows in per_layer):
        raise ModelFileError(f"{src}: no ffn_norm activations captured for some layers")
    return tuple(np.concatenate(rows) for rows in per_layer)
