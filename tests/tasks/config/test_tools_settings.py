"""The tools section at load: each mistake is one error naming its key."""

from __future__ import annotations

import pytest

from tasks.config import ConfigError, load_config


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"tools.use": [{"name": "pyhton"}]}, r"tools\.use\.0\.name.*unknown tool 'pyhton'"),
        ({"tools.use": [{"name": "python", "args": {"timeout": 3}}]}, r"unknown args \['timeout'\]"),
        ({"tools.use": [{"name": "python", "args": {"memory_mb": -1}}]}, r"args\.memory_mb must be a positive int"),
        ({"tools.use": [{"name": "python"}, {"name": "python"}]}, r"names 'python' twice"),
        ({"tools.use": [{"name": "python"}], "tools.max_calls": 0}, r"tools\.max_calls"),
        (
            {"tools.use": [{"name": "python"}], "grpo.max_completion_length": 32},
            r"grpo\.max_completion_length \(32\) is too short for tool use",
        ),
        (
            {"tools.use": [{"name": "python"}], "evaluation.max_new_tokens": 16},
            r"evaluation\.max_new_tokens \(16\) is too short for tool use",
        ),
        ({"tools.use": [{"name": "python"}], "tools.chat_template": "jinja"}, r"tools\.chat_template"),
    ],
)
def test_a_tools_mistake_names_its_key(overrides: dict, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(overrides=overrides)


def test_no_tools_is_the_default_and_the_tiny_tools_config_loads() -> None:
    from pathlib import Path

    assert not load_config().tools.enabled
    config = load_config(Path(__file__).resolve().parents[3] / "configs" / "tiny-tools.yaml")
    assert config.tools.enabled and [spec.label for spec in config.tools.use] == ["python"]
