"""registry: models.toml loads from the package and validates with `models.toml: field: problem`."""

from __future__ import annotations

from pathlib import Path

import pytest

from spark_cli.errors import SparkError
from spark_cli.core.registry import load_registry, parse_registry, registry_path

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = {"qwen3moe", "qwen35moe", "qwen3next", "qwen2moe", "deepseek2", "glm4moe", "gpt-oss", "llama",
            "olmoe", "granitemoe", "laguna"}


def test_families() -> None:
    reg = load_registry()
    assert registry_path() == ROOT / "spark_cli" / "data" / "models.toml"
    assert set(reg.archs) == FAMILIES
    q = reg.get("qwen35moe")
    assert q is not None and q.full_attention_interval == 4
    assert q.is_expert("blk.3.ffn_gate_up_exps.weight") and not q.is_expert("blk.3.ffn_gate_inp.weight")
    assert q.is_shared("blk.3.ffn_down_shexp.weight")
    oss = reg.get("gpt-oss")
    assert oss is not None and (oss.swa_period, oss.swa_dense_first) == (2, False)
    assert not oss.is_expert("blk.0.ffn_up_exps.bias")
    assert reg.get("mamba") is None


GOOD = 'schema = 1\n[[family]]\narch = "x"\nname = "X"\nexpert_patterns = ["exps"]\n'


@pytest.mark.parametrize("text,message", [
    ("schema = 2\n", "models.toml: schema: expected 1, got 2"),
    ("schema = 1\n", "models.toml: family: expected at least one"),
    ("schema = [\n", "models.toml: (file): not valid TOML"),
    (GOOD.replace('expert_patterns = ["exps"]', 'expert_patterns = []'),
     "models.toml: family[0] (x).expert_patterns: must list at least one pattern"),
    (GOOD.replace('"exps"', '"(unclosed"'), "models.toml: family[0] (x).expert_patterns[0]: invalid regex"),
    (GOOD + "swa_period = -1\n", "models.toml: family[0] (x).swa_period: expected an integer >= 0"),
    (GOOD + "colour = 1\n", "models.toml: family[0].colour: unknown field"),
    (GOOD + GOOD.replace("schema = 1\n", ""), "models.toml: family[1] (x).arch: listed twice"),
    (GOOD.replace('name = "X"\n', ""), "models.toml: family[0] (x).name: expected a non-empty string"),
])
def test_validation_messages(text: str, message: str) -> None:
    with pytest.raises(SparkError) as e:
        parse_registry(text)
    assert e.value.one_line().startswith(message)
