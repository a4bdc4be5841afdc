from pathlib import Path

import pytest

from tasks.models import ModelSourceError, load_base_model, load_tokenizer, resolve_model_source


def test_tiny_random_builds_a_llama_with_a_char_tokenizer(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    text = "What is 12 + 30? \\boxed{42}"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert tokenizer.chat_template
    model = load_base_model(tiny_model_dir)
    assert model.config.model_type == "llama"
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


def test_tiny_random_is_cached(tiny_model_dir: Path) -> None:
    assert resolve_model_source("tiny-random") == tiny_model_dir


def test_local_folder_is_used_as_is(tiny_model_dir: Path) -> None:
    assert resolve_model_source(str(tiny_model_dir)) == tiny_model_dir.resolve()


def test_missing_local_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="model folder not found"):
        resolve_model_source(str(tmp_path / "no-model"))


def test_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="no config.json"):
        resolve_model_source(str(tmp_path))


def test_hub_id_offline_fails_with_a_clear_message() -> None:
    with pytest.raises(ModelSourceError, match="cannot fetch Hub model 'Qwen/Qwen2.5-0.5B-Instruct'.*HF_HUB_OFFLINE"):
        resolve_model_source("Qwen/Qwen2.5-0.5B-Instruct")


def test_merged_copy_computes_what_the_adapter_computes(tiny_model_dir: Path, tiny_adapter: Path) -> None:
    import torch

    from tasks.models import load_policy, refresh_merged_copy

    policy = load_policy(tiny_model_dir, tiny_adapter, trainable=True)
    inputs = torch.randint(3, 40, (2, 9))
    with torch.no_grad():
        expected = policy(input_ids=inputs).logits
        copy = refresh_merged_copy(policy, None, torch.float32)
        assert torch.allclose(copy(input_ids=inputs).logits, expected, atol=1e-4)
        for name, parameter in policy.named_parameters():  # a training step changes the adapter ...
            if "lora_A" in name:
                parameter.add_(0.3)
        changed = policy(input_ids=inputs).logits
        assert not torch.allclose(changed, expected, atol=1e-3)
        refreshed = refresh_merged_copy(policy, copy, torch.float32)  # ... and the copy follows, in place
        assert refreshed is copy and torch.allclose(copy(input_ids=inputs).logits, changed, atol=1e-4)
    assert not any("lora" in name for name, _ in copy.named_parameters())
