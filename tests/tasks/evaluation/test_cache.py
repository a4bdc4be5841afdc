"""The evaluation cache: a model evaluated again on the same prompts and settings is read back, and the evaluation
table is the same to the byte; another seed, another adapter or the cache turned off samples again."""

import logging
from pathlib import Path

from tasks.config import PipelineConfig
from tasks.evaluate import ModelSpec, run_evaluate
from tasks.evaluation.cache import model_content_key
from tasks.models import cache_dir

FROM_CACHE = "completions from the evaluation cache"


def _evaluation(config: PipelineConfig, split, base: Path, adapter: Path, folder: Path, caplog) -> tuple[str, int]:
    """The evaluation table's bytes, and how many models were read back from the cache."""
    caplog.clear()
    models = {"base": ModelSpec("base", base), "candidate": ModelSpec("grpo", base, adapter)}
    result = run_evaluate(config, split.holdout_path, models, folder)
    return result.table_path.read_text(), sum(FROM_CACHE in r.getMessage() for r in caplog.records)


def _with(config: PipelineConfig, **evaluation) -> PipelineConfig:
    return config.model_copy(update={"evaluation": config.evaluation.model_copy(update=evaluation)})


def test_a_second_evaluation_reads_the_cache_and_gives_the_same_table(
    tiny_config, tiny_split, tiny_model_dir, tiny_adapter, tmp_path, caplog, monkeypatch
) -> None:
    caplog.set_level(logging.INFO, logger="tasks.evaluation.cache")
    # A cache of its own: the session's is shared with the other worker, whose evaluations write entries too.
    monkeypatch.setenv("GRPOFLOW_CACHE", str(tmp_path / "cache"))
    config = _with(tiny_config, forgetting=False).model_copy(update={"seed": 1234})
    entries = set((cache_dir() / "evaluation").glob("*.json"))
    first, hits = _evaluation(config, tiny_split, tiny_model_dir, tiny_adapter, tmp_path / "a", caplog)
    assert hits == 0 and len(set((cache_dir() / "evaluation").glob("*.json")) - entries) == 2
    second, hits = _evaluation(config, tiny_split, tiny_model_dir, tiny_adapter, tmp_path / "b", caplog)
    assert hits == 2 and second == first  # bit-identical table, tokens per second included
    # keyed by the dtype `auto` resolved to: naming it reads the same entries, the other dtype samples again
    from tasks.models.precision import resolve_dtype

    resolved = "bf16" if str(resolve_dtype("auto")) == "torch.bfloat16" else "fp32"
    named = config.model_copy(update={"model": config.model.model_copy(update={"precision": resolved})})
    _, hits = _evaluation(named, tiny_split, tiny_model_dir, tiny_adapter, tmp_path / "named", caplog)
    assert hits == 2

    uncached, hits = _evaluation(
        _with(config, cache=False), tiny_split, tiny_model_dir, tiny_adapter, tmp_path / "c", caplog
    )
    assert hits == 0 and _scores(uncached) == _scores(first)  # what was cached is what sampling gives
    assert len(set((cache_dir() / "evaluation").glob("*.json")) - entries) == 2  # cache off: nothing written
    _, hits = _evaluation(
        config.model_copy(update={"seed": 4321}), tiny_split, tiny_model_dir, tiny_adapter, tmp_path / "d", caplog
    )
    assert hits == 0


def _scores(table: str) -> dict:
    """The table without the one figure that measures time."""
    import json

    models = json.loads(table)["models"]
    return {name: {k: v for k, v in s.items() if k != "tokens_per_second"} for name, s in models.items()}


def test_the_model_key_follows_the_adapter_bytes_not_its_folder(tiny_model_dir, tiny_adapter, tmp_path) -> None:
    import shutil

    copy = Path(shutil.copytree(tiny_adapter, tmp_path / "elsewhere"))
    assert model_content_key(tiny_model_dir, copy) == model_content_key(tiny_model_dir, tiny_adapter)
    weights = copy / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert model_content_key(tiny_model_dir, copy) != model_content_key(tiny_model_dir, tiny_adapter)
    assert model_content_key(tiny_model_dir, None) != model_content_key(tiny_model_dir, tiny_adapter)


def test_a_fresh_adapter_s_forgetting_scores_are_kept_by_its_bytes(
    tiny_config, tiny_split, tiny_model_dir, tiny_adapter, tmp_path, caplog
) -> None:
    """A fresh (unregistered) adapter's general-ability scores are cached under its content key when the
    evaluation cache is on, so a rerun with the same adapter scores nothing again; the table stays the same."""
    config = _with(tiny_config, forgetting=True).model_copy(update={"seed": 2345})
    folder = cache_dir() / "general-ability"
    key = model_content_key(tiny_model_dir, tiny_adapter)
    for entry in folder.glob(f"{key}-*"):
        entry.unlink()
    _evaluation(_with(config, cache=False), tiny_split, tiny_model_dir, tiny_adapter, tmp_path / "off", caplog)
    assert not list(folder.glob(f"{key}-*.json"))  # cache off: a fresh adapter is scored, not kept
    first, _ = _evaluation(config, tiny_split, tiny_model_dir, tiny_adapter, tmp_path / "a", caplog)
    assert len(list(folder.glob(f"{key}-*.json"))) == 1
    second, hits = _evaluation(config, tiny_split, tiny_model_dir, tiny_adapter, tmp_path / "b", caplog)
    assert hits == 2 and second == first


def test_a_rerun_s_adapter_keys_the_same_though_its_folder_s_other_files_differ(tiny_model_dir, tiny_adapter, tmp_path):
    """Two runs of one config write the same weights, but training_args.bin holds each run's paths and PEFT writes
    target_modules in a set's order: neither changes the model, so neither changes the key; the weights do."""
    import json
    import shutil

    copy = Path(shutil.copytree(tiny_adapter, tmp_path / "rerun"))
    (copy / "training_args.bin").write_bytes(b"another run's paths")
    config = json.loads((copy / "adapter_config.json").read_text())
    config["target_modules"] = list(reversed(sorted(config["target_modules"])))
    (copy / "adapter_config.json").write_text(json.dumps(config))
    assert model_content_key(tiny_model_dir, copy) == model_content_key(tiny_model_dir, tiny_adapter)
    (copy / "adapter_model.safetensors").write_bytes(b"other weights")
    assert model_content_key(tiny_model_dir, copy) != model_content_key(tiny_model_dir, tiny_adapter)
