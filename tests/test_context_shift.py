"""llama-server's context shift (`spark serve --context-shift`, issue 49): the span a shift drops
(server-context.cpp's arithmetic), the KV cache after a shift equal to the kept tokens evaluated
afresh, and the server going on past a full context (truncated) where it stopped before."""

from __future__ import annotations

import numpy as np
import pytest

from spark_cli.core.context_shift import ContextShift, after_shifts


@pytest.mark.parametrize("shift,n_past,n_ctx,want", [
    (ContextShift(), 255, 256, (0, 127)),  # no BOS: half of all
    (ContextShift(add_bos=True), 255, 256, (1, 127)),  # the BOS is kept
    (ContextShift(n_keep=-1, n_prompt=20, add_bos=True), 255, 256, (21, 117)),  # the whole prompt (+1, as llama-server's)
    (ContextShift(n_keep=10, n_discard=5), 255, 256, (10, 5)),
    (ContextShift(n_keep=10, n_discard=500), 255, 256, (10, 244)),  # at least one token after n_keep stays
    (ContextShift(n_keep=10, n_discard=-3), 255, 256, (10, 0)),  # clamped, as llama-server's
    (ContextShift(n_keep=1000), 63, 64, (60, 1)),  # n_keep at most n_ctx - 4
])
def test_the_span_a_shift_drops_is_llama_servers(shift, n_past, n_ctx, want):
    assert shift.span(n_past, n_ctx) == want


def test_a_slots_tokens_after_its_shifts():
    assert after_shifts(list(range(10)), [(1, 3), (2, 2)]) == [0, 4, 7, 8, 9]
    assert after_shifts([1, 2], []) == [1, 2]


@pytest.mark.model
def test_a_shift_drops_its_span_and_moves_the_rest_down():
    """Shift the tiny llama's sequence: positions [2, 7) dropped and the rest moved down 5 (llama.cpp's
    K-shift rotates their cached RoPE keys), the next token at position n - 5. RoPE attends by
    relative position, so its logits equal those of the same entries dropped with the kept prefix
    moved up 5 instead and the next token at n: the same distances between every pair (to the f16
    KV cache's rounding). An off-by-one span or a wrong next position breaks that."""
    from spark_cli.models.tiny_models import build_tiny_model
    from spark_cli.native.engine import Engine, EngineOptions

    path = build_tiny_model("llama")
    with Engine(EngineOptions(path, n_ctx=128, n_batch=64, n_ubatch=64, device="none", repack=False,
                              n_threads=1)) as eng:
        toks = eng.vocab.tokenize("The quick brown fox jumps over the lazy dog, and then it runs away fast.")
        n = len(toks)
        assert eng.can_shift
        eng.eval(toks)
        eng.shift(0, 2, 5)
        assert eng.seq_pos(0) == n - 5
        lc, mem = eng.lib.lc, eng.lib.lc.llama_get_memory(eng.ctx)
        assert (lc.llama_memory_seq_pos_min(mem, 0), lc.llama_memory_seq_pos_max(mem, 0)) == (0, n - 6)
        shifted = eng.eval(toks[:1])
        eng.reset()
        eng.eval(toks)
        assert lc.llama_memory_seq_rm(mem, 0, 2, 7)
        lc.llama_memory_seq_add(mem, 0, 0, 2, 5)  # the prefix up instead of the rest down
        other_way = eng.eval(toks[:1])
        assert int(np.argmax(shifted)) == int(np.argmax(other_way))
        np.testing.assert_allclose(shifted, other_way, rtol=0, atol=2e-2 * float(np.abs(other_way).max()))
        eng.reset()
        eng.eval(toks)
        assert not np.allclose(eng.eval(toks[:1]), shifted, atol=0.1)  # the shift changed what comes next


@pytest.mark.model
def test_spark_serve_shifts_a_full_context_and_goes_on(tmp_path):
    """-c 256, one slot: without --context-shift an answer stops at the context's end (truncated);
    with it the answer gets every token asked for (truncated: a shift happened), the server's
    slot holds the shifted tokens (a prompt cache of the n_keep kept), and a model whose cache cannot shift says so at start."""
    import httpx
    from test_serve_hostile import _serve

    from spark_cli.models.tiny_models import build_tiny_model

    def complete(*flags: str) -> tuple[dict, dict]:
        """The answer, then the same request's again (what the slot kept of the first)."""
        proc, port, log = _serve(build_tiny_model("llama"), tmp_path, "-c", "256", "-np", "1", "--temp", "0", *flags)
        try:
            ask = {"prompt": "Once upon a time", "n_predict": 400, "n_keep": 2, "ignore_eos": True}
            got = [httpx.post(f"http://127.0.0.1:{port}/completion", json=ask, timeout=120) for _ in range(2)]
            assert all(r.status_code == 200 for r in got), [r.text for r in got]
            return got[0].json(), got[1].json()
        finally:
            proc.kill()
            proc.wait(timeout=30)

    stopped, again = complete()
    n_prompt = stopped["timings"]["prompt_n"]
    assert stopped["truncated"] and stopped["tokens_predicted"] == 256 - n_prompt
    assert again["timings"]["cache_n"] == n_prompt - 1  # the whole prompt was still there (its last re-evaluated)
    shifted, again = complete("--context-shift")
    assert shifted["truncated"] and shifted["tokens_predicted"] == 400 and shifted["stop_type"] == "limit"
    assert shifted["generation_settings"]["n_keep"] == 2 and n_prompt > 2
    # greedy: the same tokens until the context filled
    assert shifted["content"].startswith(stopped["content"])
    # the slot holds the shifted tokens: of the prompt, the n_keep kept (no BOS with this vocabulary)
    assert again["timings"]["cache_n"] == 2 and again["content"] == shifted["content"]
    proc, port, log = _serve(build_tiny_model("qwen35moe"), tmp_path, "-c", "256", "--context-shift")
    try:
        assert "--context-shift: the KV cache of" in log.read_text()
    finally:
        proc.kill()
        proc.wait(timeout=30)
