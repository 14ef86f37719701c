"""`spark chat`: a real terminal session, one-shot answers with and without the cache,
self-tuning counts, context trimming, a crashed answer, and one-line refusals."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import cli_runner

from spark_cli.core import plan_file, planner
from spark_cli.runs.chat_session import ChatSession, Sampling
from spark_cli.commands import chat as chat_cmd
from spark_cli.errors import DeviceError, ModelFileError, PlanError, SparkError
from spark_cli.core.gguf_info import load_geometry
from spark_cli.core.profile import RoutingProfile, profile_path_for

SPARK = str(Path(sys.executable).parent / "spark")
QUESTION = "What is the capital of Japan?"  # NOTE: far from a greedy tie under the Jinja template


def _model_copy(src: Path, tmp_path: Path) -> Path:
    """A symlink in tmp_path: the profile is written beside it, not in the shared cache."""
    dst = tmp_path / src.name
    dst.symlink_to(src)
    return dst


def _min_budget(g, n_ctx: int) -> int:
    """The smallest budget at which the plan caches every MoE layer (the slot floor; below it
    layers go to the host)."""
    lo, hi = 1 << 20, 64 << 30
    while hi - lo > (1 << 20):
        mid = (lo + hi) // 2
        try:
            ok = all(l.mode != "host" for l in planner.plan_for(g, planner.PlanRequest(mid, n_ctx)).plan.layers)
        except PlanError:
            ok = False
        if ok:
            hi = mid
        else:
            lo = mid
    return hi


def _env() -> dict:
    return {**os.environ, "COLUMNS": "160", "SPARK_DEBUG": ""}


def _run(*args, check_rc: int | None = 0):
    import subprocess

    r = subprocess.run([SPARK, "chat", *map(str, args)], capture_output=True, text=True, env=_env(), timeout=300)
    if check_rc is not None:
        assert r.returncode == check_rc, r.stdout + r.stderr
    return r


# ---------------------------------------------------------------- through a real terminal


@pytest.mark.model
def test_terminal_session(small_model, rpc_server, tmp_path):
    pexpect = pytest.importorskip("pexpect")
    model = _model_copy(small_model, tmp_path)
    g = load_geometry(model)
    budget = _min_budget(g, 512)
    child = pexpect.spawn(SPARK, ["chat", str(model), "--rpc", rpc_server.endpoint, "--vram", str(budget),
                                  "--temp", "0", "-c", "512"],
                          env=_env(), encoding="utf-8", timeout=120, dimensions=(60, 160))
    try:
        child.expect("no profile yet")
        child.expect(r"\n> ")
        child.sendline(QUESTION)
        child.expect("Tokyo")  # streamed before the figures line
        child.expect(r"tok/s.*cache hit [\d.]+%.*uploads.*VRAM")
        child.expect(r"\n> ")
        child.sendline("/stats")
        child.expect(r"hits.*misses.*uploads")
        child.expect(r"session: \d+ prompt \+ \d+ generated tokens")
        child.expect(r"\n> ")
        child.sendline("Write a very long story about a dragon who learns to fly.")
        child.expect(r"fly\.\r\n")  # the echo of the line
        child.expect(r"\w+\W+\w+\W+\w+")  # the answer is streaming
        child.sendintr()
        child.expect("stopped")
        child.expect(r"\n> ")
        child.sendline("/save " + str(tmp_path / "chat.json"))
        child.expect("saved")
        child.expect(r"\n> ")
        child.sendline("/exit")
        child.expect("learned: \\d+ decode tokens")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    saved = json.loads((tmp_path / "chat.json").read_text())
    roles = [m["role"] for m in saved["messages"]]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert "Tokyo" in saved["messages"][1]["content"]
    assert saved["messages"][3]["stop"] == "interrupted"
    prof = RoutingProfile.load(profile_path_for(model))
    assert prof.tokens_decode > 0 and prof.sources == ["spark chat"]


# ---------------------------------------------------------------- one-shot


@pytest.mark.model
def test_one_shot_cache_matches_resident_and_learns(small_model, rpc_server, tmp_path):
    model = _model_copy(small_model, tmp_path)
    g = load_geometry(model)
    n_ctx = 512
    plan = planner.plan_for(g, planner.PlanRequest(_min_budget(g, n_ctx), n_ctx)).plan
    cached = [l for l in plan.layers if l.mode == "cached"]
    assert len(cached) == len(g.moe_layers) and all(l.slots <= g.n_expert // 2 for l in cached)
    plan_file.save(plan, tmp_path / "plan.json")

    r = _run(model, "--rpc", rpc_server.endpoint, "--plan", tmp_path / "plan.json", "--temp", "0", "-n", "12",
             "--prompt", QUESTION, "--json")
    got = json.loads(r.stdout)
    fig = got["figures"]
    assert "Tokyo" in got["answer"]
    assert fig["cached_layers"] == len(g.moe_layers) and fig["misses"] > 0 and fig["uploads"] > 0
    n_gen = fig["generated_tokens"]
    assert 0 < n_gen <= 12
    prof_path = profile_path_for(model)
    prof = RoutingProfile.load(prof_path)
    # every generated token was evaluated alone: k experts in each MoE layer
    assert prof.decode.sum() == n_gen * g.n_expert_used * len(g.moe_layers)
    assert prof.tokens_decode == n_gen
    before = prof_path.read_bytes()

    r2 = _run(model, "--rpc", rpc_server.endpoint, "--vram", "4GiB", "--temp", "0", "-n", "12",
              "--prompt", QUESTION, "--json", "--no-learn")
    ref = json.loads(r2.stdout)
    assert ref["figures"]["cached_layers"] == 0
    assert ref["answer"] == got["answer"]
    assert prof_path.read_bytes() == before  # --no-learn


# ---------------------------------------------------------------- the session logic


class _FakeEngine:
    """Word tokens, a fixed three-word reply per sampler; records evals and truncations; a
    sequence per slot (n_seq), as the engine's decode and truncate keep them."""

    EOG = 0

    def __init__(self, n_ctx: int, n_seq: int = 1):
        self.n_ctx, self.ctx, self.n_seq, self.n_batch = n_ctx, None, n_seq, 512
        self.vocab = self.cache = self  # one fake for the engine, its vocabulary and its cache
        self.pos = [0] * n_seq
        self.words: dict[str, int] = {}
        self.evals: list[int] = []
        self.truncations: list[int] = []
        self.bos_token = -1
        self.enabled = False

    @property
    def n_past(self) -> int:
        return self.pos[0]

    def seq_pos(self, seq: int) -> int:
        return self.pos[seq]

    def _id(self, w: str) -> int:
        return self.words.setdefault(w, len(self.words) + 1)

    def tokenize(self, text, add_special=True, parse_special=True):
        return [self._id(w) for w in text.split()]

    def chat_prompt(self, messages, add_generation_prompt=True, tools=None, extras=None):
        return "".join(f"<{m['role']}> {m['content']} " for m in messages) + "<assistant>"

    def make_sampler(self, *a, **kw):
        reply: list[int] = []

        def sample(engine, logits, row=-1):
            if not reply:
                reply.extend([self._id(w) for w in ("yes", "of", "course")] + [self.EOG])
            return reply.pop(0)

        return SimpleNamespace(sample=sample, prime=lambda prompt: None, close=lambda: None)

    def is_eog(self, t):
        return t == self.EOG

    def decode(self, entries):
        for _, seq, _ in entries:
            assert self.pos[seq] < self.n_ctx
            self.pos[seq] += 1
        self.evals.append(len(entries))

    def eval(self, tokens, logits="last"):
        assert self.n_past + len(tokens) <= self.n_ctx
        self.decode([(t, 0, False) for t in tokens])

    def logits_row(self, i):
        return None

    def piece(self, t):
        return (next(w for w, i in self.words.items() if i == t) + " ").encode()

    def server_text(self, tokens):
        """The prompt as llama-server shows it: the pieces joined (this vocabulary adds no BOS)."""
        return b"".join(self.piece(t) for t in tokens).decode()

    def truncate(self, n, seq=0):
        self.truncations.append(n)
        self.pos[seq] = min(self.pos[seq], n)
        return self.pos[seq]

    def reset(self):
        self.pos = [0] * self.n_seq

    def seq_clear(self, seq):
        self.pos[seq] = 0

    def stats(self):
        return {}


def test_history_kv_reuse_trimming_and_save(tmp_path):
    eng = _FakeEngine(n_ctx=64)
    chat = ChatSession(eng, Sampling(temp=0, n_predict=4), system="be brief")
    words = " ".join(f"w{i}" for i in range(18))
    notices: list[str] = []
    a1 = chat.answer("first " + words, on_notice=notices.append)
    assert a1.text.split() == ["yes", "of", "course"] and a1.figures.stop == "eog"
    kv1 = eng.n_past  # prompt + the reply tokens (the end-of-generation token is never evaluated)
    a2 = chat.answer("second " + words, on_notice=notices.append)
    assert a2.figures.reused_tokens == kv1 and eng.truncations[-1] == kv1  # the KV prefix is kept
    assert not notices and a2.figures.dropped_turns == 0
    a3 = chat.answer("third " + words, on_notice=notices.append)
    assert a3.figures.dropped_turns == 1 and notices == ["context full: dropped the oldest turn"]
    contents = [m["content"] for m in chat.messages()]
    assert contents[0] == "be brief" and not any(c.startswith("first") for c in contents)
    assert a3.figures.reused_tokens < kv1  # the history changed near its start
    with pytest.raises(SparkError, match="context holds 64"):
        chat.answer("x " * 80)
    path = chat.save(tmp_path / "s.json", model="fake.gguf")
    d = json.loads(path.read_text())
    assert [m["role"] for m in d["messages"]] == ["user", "assistant"] * 3  # dropped turns stay in the transcript
    assert d["messages"][1]["figures"]["generated_tokens"] == 3 and d["system"] == "be brief"
    chat.reset()
    assert chat.messages() == [{"role": "system", "content": "be brief"}] and eng.n_past == 0


@pytest.mark.model
def test_penalised_sampling_answers(small_model):
    """--repeat-penalty (and the frequency and presence penalties) build llama.cpp's penalties
    sampler, whose first argument in this build is n_vocab (it raised TypeError before)."""
    from spark_cli.native.engine import Engine, EngineOptions

    with Engine(EngineOptions(small_model, n_ctx=256, device="none", repack=False)) as eng:
        for sampling in (Sampling(temp=0, n_predict=4, repeat_penalty=1.3),
                         Sampling(temp=0.7, n_predict=4, frequency_penalty=0.5, presence_penalty=0.5, typical_p=0.9)):
            chat = ChatSession(eng, sampling)
            a = chat.answer(QUESTION)
            chat.close()
            assert a.error is None and a.figures.generated_tokens > 0, a.error


@pytest.mark.model
def test_crashed_answer_keeps_learned_counts(small_model, tmp_path):
    from spark_cli.runs import session
    from spark_cli.native.engine import Engine, EngineOptions

    g = load_geometry(small_model)
    per_token = g.n_expert_used * len(g.moe_layers)
    with Engine(EngineOptions(small_model, n_ctx=256, device="none", count_experts=True, repack=False)) as eng:
        chat = ChatSession(eng, Sampling(temp=0, n_predict=3))
        a = chat.answer(QUESTION)
        assert a.error is None and a.figures.generated_tokens == 3
        assert chat.learned.counts.sum() == 3 * per_token

        real_decode, calls = eng.decode, []

        def failing_decode(entries):
            calls.append(len(entries))
            if len(entries) == 1 and calls.count(1) == 2:
                raise RuntimeError("injected failure")
            return real_decode(entries)

        eng.decode = failing_decode
        b = chat.answer("And of Italy?")
        assert b.error and "injected failure" in b.error and b.figures.stop == "error"
        assert chat.learned.counts.sum() == 4 * per_token  # the one token decoded before the failure
        eng.decode = real_decode
        c = chat.answer("And of Spain?")
        assert c.error is None and c.figures.reused_tokens == 0  # the KV cache was dropped
        n = 4 + c.figures.generated_tokens
        assert chat.learned.counts.sum() == n * per_token and chat.learned.tokens == n
        chat.close()
    prof = session.fold_into_profile(small_model, g, chat.learned.counts, "test", path=tmp_path / "p.json")
    assert prof.decode.sum() == n * per_token and prof.tokens_decode == n


# ---------------------------------------------------------------- refusals


@pytest.fixture
def spark(monkeypatch, capsys):
    return cli_runner(monkeypatch, capsys, "chat", chat_cmd.register)


def _other_model_plan(tmp_path: Path) -> Path:
    from spark_cli.models.tiny_models import build_tiny_model

    tiny = load_geometry(build_tiny_model("qwen3moe"))
    p = tmp_path / "tiny-plan.json"
    plan_file.save(planner.plan_for(tiny, planner.PlanRequest(4 << 30, 512)).plan, p)
    return p


@pytest.mark.model
@pytest.mark.parametrize("case,code", [("missing", ModelFileError.exit_code), ("other-plan", PlanError.exit_code),
                                       ("budget", PlanError.exit_code), ("context", SparkError.exit_code),
                                       ("json-alone", 2), ("device", DeviceError.exit_code),
                                       ("rpc-and-none", DeviceError.exit_code), ("kv-type", 2),
                                       ("expert-ot", 2)])
def test_bad_input_is_one_line(case, code, spark, small_model, rpc_server, tmp_path):
    args = {
        "missing": [tmp_path / "nope.gguf", "--prompt", "hi"],
        "other-plan": [small_model, "--plan", "PLAN", "-dev", "none", "--prompt", "hi"],
        "budget": [small_model, "--rpc", rpc_server.endpoint, "--vram", "100MiB", "--prompt", "hi"],
        "context": [small_model, "-dev", "none", "-c", "16", "--no-learn", "--prompt", "word " * 400],
        "json-alone": [small_model, "--json"],
        "device": [small_model, "-dev", "CUDA7", "--prompt", "hi"],
        "rpc-and-none": [small_model, "-dev", "none", "--rpc", rpc_server.endpoint, "--prompt", "hi"],
        "kv-type": [small_model, "-ctv", "q3_k", "--prompt", "hi"],
        "expert-ot": [small_model, "-dev", "none", "-ot", r"blk\.3\.ffn_up_exps=CPU", "--prompt", "hi"],
    }[case]
    if case == "other-plan":
        args[2] = _other_model_plan(tmp_path)
    rc, out, err = spark(*args)
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == code and out == ""
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    want = {"missing": "no such file", "other-plan": "another model", "budget": "--vram",
            "context": "context holds", "json-alone": "--json needs --prompt", "device": "no device named CUDA7",
            "rpc-and-none": "contradict", "kv-type": "--cache-type-v: unknown KV cache type",
            "expert-ot": "matches the expert tensor blk.3.ffn_up_exps.weight"}[case]
    assert want in lines[0]


@pytest.mark.model
def test_prompt_between_ctx_and_the_rounded_context_is_answered(small_model, tmp_path):
    # llama.cpp rounds -c 64 up to 256 but caps n_batch at 64: a 100-word prompt fits the
    # context and must be fed in chunks of 64 (it aborted on GGML_ASSERT(n_tokens_all <= n_batch))
    prompt = " ".join(["word"] * 100)
    r = _run(_model_copy(small_model, tmp_path), "-dev", "none", "-c", "64", "--no-learn", "--temp", "0",
             "-n", "3", "--prompt", prompt, "--json", check_rc=None)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["figures"]["prompt_tokens"] > 64, r.stdout
