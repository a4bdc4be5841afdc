"""The registry module: importable without torch or transformers, and its URI forms."""

import subprocess
import sys
from pathlib import Path

import pytest

from tasks.registry import parse_model_uri

REPO = Path(__file__).resolve().parents[3]


def test_registry_imports_neither_torch_nor_transformers() -> None:
    """``grpoflow rollback`` and the registry commands load only the registry: checked in a fresh interpreter."""
    probe = (
        "import sys, tasks.registry.versions, flows.rollback; "
        "print(sorted(m for m in ('torch', 'transformers', 'peft', 'trl') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_model_uri_forms() -> None:
    assert parse_model_uri("models:/m@champion") == ("m", "champion", None)
    with pytest.raises(ValueError):
        parse_model_uri("runs:/abc/adapter")
