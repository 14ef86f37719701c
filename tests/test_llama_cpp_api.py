"""llama-cpp-python's high-level API in Spark's venv (docs/llama-cpp-python.md): the page's
workaround, run as written, keeps the weights out of repacked (AMX) buffers and answers; on CPUs
without AMX, `Llama()` answers without it too. Each in a subprocess: a crash is a failed test."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from spark_cli.native.engine import repack_is_safe
from spark_cli.models.smollm2 import SMOLLM2_GGUF, fetch_smollm2

pytestmark = pytest.mark.model

PAGE = Path(__file__).resolve().parents[1] / "docs" / "llama-cpp-python.md"
PLAIN = """from llama_cpp import Llama

llm = Llama("SmolLM2-135M-Instruct.Q4_1.gguf")
print(llm.create_completion("The capital of France is", max_tokens=8, temperature=0)["choices"][0]["text"])
"""


def _workaround() -> str:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)
    assert len(blocks) == 1, "docs/llama-cpp-python.md: expected one python block"
    return blocks[0]


def _run(code: str) -> subprocess.CompletedProcess:
    model = fetch_smollm2()
    assert f'"{SMOLLM2_GGUF}"' in code
    return subprocess.run([sys.executable, "-c", code.replace(f'"{SMOLLM2_GGUF}"', repr(str(model)))],
                          capture_output=True, text=True, timeout=300)


def test_the_documented_workaround_answers_with_plain_weights() -> None:
    r = _run(_workaround())
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Paris" in r.stdout
    # llama.cpp's load log names each weight buffer, and the extra (repacking) type it would prefer
    buffers = re.findall(r"(\S+) model buffer size", r.stderr)
    assert buffers and not [b for b in buffers if "REPACK" in b or "AMX" in b], buffers
    assert "preferred buffer type" not in r.stderr


def test_llama_without_the_workaround_where_the_cpu_has_no_amx() -> None:
    if not repack_is_safe():
        pytest.skip("this CPU advertises AMX: Llama() can crash there (ggml-org/llama.cpp#20824); "
                    "the workaround is tested above")
    r = _run(PLAIN)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-3000:]}"
    assert "Paris" in r.stdout
