"""A version registered before the package move still loads and answers: its stored loader (the
``pyfunc_adapter.py`` of that day, in ``tests/fixtures/pre_move_version``) imports ``tasks.models``,
``tasks.sources``, ``tasks.packaging``, ``tasks.data`` and ``tasks.generation``, which the move keeps working."""

import json
import shutil
from pathlib import Path

import pytest

from tasks.config import load_config
from tasks.registry import client_for, register_adapter, save_version_model

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
REPO = Path(__file__).resolve().parents[3]


def test_a_version_registered_before_the_move_loads_and_answers_like_todays(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow

    stored_loader = (FIXTURES / "pre_move_version" / "pyfunc_adapter.py").read_text()
    for old_path in ("tasks.models", "tasks.sources", "tasks.packaging", "tasks.data", "tasks.generation"):
        assert f"from {old_path} import" in stored_loader  # what the old version really imports
    recorded = json.loads((FIXTURES / "pre_move_version.json").read_text())
    prompts, params = recorded["prompts"], {"max_new_tokens": recorded["max_new_tokens"]}

    # Registered in a store as the pipeline registers a version, and loaded by its models:/ URI.
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = client_for(uri)
    run = client.create_run(client.create_experiment("pre-move"))
    client.log_artifacts(run.info.run_id, str(FIXTURES / "pre_move_version"), "model")
    version = register_adapter(client, "pre-move", run.info.run_id, "model", {"base_model": "tiny-random"})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    old = mlflow.pyfunc.load_model(f"models:/pre-move/{version}").predict(prompts, params=params)

    # The same adapter saved by today's code: the old loader must answer exactly as the new one does.
    config = load_config(REPO / "configs" / "tiny.yaml", {"model": {"precision": "fp32"}})
    adapter = shutil.copytree(FIXTURES / "pre_move_version" / "artifacts" / "adapter", tmp_path / "adapter")
    today = save_version_model(adapter, tmp_path / "today", "tiny-random", tiny_model_dir, config, "# card\n")
    new = mlflow.pyfunc.load_model(str(today)).predict(prompts, params=params)
    assert len(old) == len(prompts) and all(isinstance(answer, str) and answer for answer in old)
    assert old == new


def test_the_model_class_asks_for_no_type_hint() -> None:
    """MLflow checks predict's hint whenever the class is defined (each save and load) and warns, under a filter
    of its own that no caller's filter overrides, unless the hint is one it infers no schema from."""
    import importlib.util
    import warnings

    import tasks.registry.pyfunc_adapter as adapter

    spec = importlib.util.spec_from_file_location("fresh_pyfunc_adapter", adapter.__file__)
    module = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec.loader.exec_module(module)
    assert [str(w.message) for w in caught if "type hint" in str(w.message).lower()] == []
