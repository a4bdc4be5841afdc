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


def test_a_process_waits_for_another_building_the_same_model(tmp_path: Path) -> None:
    """The background conversion ``grpoflow run`` starts and the run's own resolve share a lock: the second
    waits for the first and builds nothing itself."""
    import fcntl
    import os
    import subprocess
    import sys
    import time

    from tasks.models.sources import build_tiny_random

    target = tmp_path / "models" / "tiny-random-v1"
    target.parent.mkdir(parents=True)
    code = "from tasks.models import resolve_model_source; print(resolve_model_source('tiny-random'))"
    env = {**os.environ, "GRPOFLOW_CACHE": str(tmp_path)}
    with open(target.parent / ".tiny-random-v1.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # this test is the process that is building
        waiting = subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        time.sleep(3)
        assert waiting.poll() is None  # blocked on the lock, not building its own copy
        build_tiny_random(target)
        built = (target / "model.safetensors").stat().st_mtime_ns
    out, err = waiting.communicate(timeout=120)
    assert waiting.returncode == 0, err[-2000:]
    assert Path(out.strip().splitlines()[-1]) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == built
    assert sorted(p.name for p in target.parent.iterdir()) == [".tiny-random-v1.lock", "tiny-random-v1"]


def test_only_an_unconverted_smollm2_is_prepared_in_the_background(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.models import SMOLLM2, prepare_in_background

    assert prepare_in_background("tiny-random") is None  # seconds to build: the run does it itself
    assert prepare_in_background(str(tiny_model_dir)) is None  # a folder: nothing to convert
    monkeypatch.setenv("GRPOFLOW_CACHE", str(tmp_path))
    child = prepare_in_background(SMOLLM2)  # an empty cache: the conversion starts
    assert child is not None and child.poll() is None
    child.kill()
    child.wait()
    (tmp_path / "models" / f"{SMOLLM2}-v2").mkdir(parents=True)
    (tmp_path / "models" / f"{SMOLLM2}-v2" / "config.json").write_text("{}")
    assert prepare_in_background(SMOLLM2) is None  # converted before: nothing to do


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

    from tasks.models import load_policy
    from tasks.speedups.merged_copy import MergedCopy

    policy = load_policy(tiny_model_dir, tiny_adapter, trainable=True)
    inputs = torch.randint(3, 40, (2, 9))
    with torch.no_grad():
        for name, parameter in policy.named_parameters():  # a trained adapter (PEFT initialises B to zero)
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
        expected = policy(input_ids=inputs).logits
        merged = MergedCopy(policy, torch.float32)
        copy = merged.model
        assert torch.allclose(copy(input_ids=inputs).logits, expected, atol=1e-4)
        for name, parameter in policy.named_parameters():  # a training step changes the adapter ...
            if "lora_A" in name:
                parameter.add_(0.3)
        changed = policy(input_ids=inputs).logits
        assert not torch.allclose(changed, expected, atol=1e-3)
        refreshed = merged.refresh()  # ... and the copy follows, in place
        assert refreshed is copy and torch.allclose(copy(input_ids=inputs).logits, changed, atol=1e-4)
    assert not any("lora" in name for name, _ in copy.named_parameters())


def test_merged_copy_built_without_its_random_initialisation_is_the_same(
    tiny_model_dir: Path, tiny_adapter: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy skips the initialisation it overwrites; where some weight would stay unwritten it initialises."""
    import torch

    import tasks.speedups.merged_copy as merged_copy
    from tasks.models import load_policy

    policy = load_policy(tiny_model_dir, tiny_adapter, trainable=True)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    built: list[bool] = []
    empty_copy, source_weights = merged_copy._empty_copy, merged_copy._source_weights

    def spy(base, dtype, initialise):  # noqa: ANN001, ANN202
        built.append(initialise)
        return empty_copy(base, dtype, initialise)

    monkeypatch.setattr(merged_copy, "_empty_copy", spy)
    fast = merged_copy.MergedCopy(policy, torch.float32)
    assert built == [False]
    monkeypatch.setattr(merged_copy, "_empty_copy", lambda base, dtype, initialise: spy(base, dtype, True))
    initialised = merged_copy.MergedCopy(policy, torch.float32)
    inputs = torch.randint(3, 40, (2, 9))
    with torch.no_grad():
        assert torch.equal(fast.model(input_ids=inputs).logits, initialised.model(input_ids=inputs).logits)
    for (name, a), (_, b) in zip(fast.model.state_dict().items(), initialised.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # A policy that would leave a weight unwritten (here: its norms not found) gets an initialised copy.
    monkeypatch.setattr(merged_copy, "_empty_copy", spy)
    monkeypatch.setattr(
        merged_copy, "_source_weights", lambda base: [kv for kv in source_weights(base) if "norm" not in kv[0]]
    )
    built.clear()
    merged_copy.MergedCopy(policy, torch.float32)
    assert built == [False, True]


def test_frozen_weights_stored_in_bf16_compute_the_same_under_autocast(
    tiny_model_dir: Path, tiny_adapter: Path
) -> None:
    import torch
    from peft.tuners.lora import LoraLayer

    from tasks.models import load_policy
    from tasks.speedups.frozen import store_frozen_in
    from tasks.speedups.merged_copy import MergedCopy

    policy = load_policy(tiny_model_dir, tiny_adapter, trainable=True)
    inputs = torch.randint(3, 40, (2, 9))
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = policy(input_ids=inputs).logits
    layers = sum(isinstance(m, LoraLayer) for m in policy.modules())
    assert store_frozen_in(policy, "fp32") == 0  # fp32 stays fp32
    assert store_frozen_in(policy, "bf16") == layers > 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(policy(input_ids=inputs).logits, expected)  # autocast cast them the same way
    trainable = [p for p in policy.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)  # the adapters keep fp32
    merged = MergedCopy(policy, torch.bfloat16)  # the fused bf16 merge over bf16 base weights
    with torch.no_grad():
        logits = merged.model(input_ids=inputs).logits.float()
    assert merged.model.dtype == torch.bfloat16
    assert torch.allclose(logits, expected.float(), atol=0.1), float((logits - expected.float()).abs().max())


def test_packed_linear_layers_compute_what_autocast_linear_computes(tiny_model_dir: Path) -> None:
    """bf16 packing where oneDNN has a bf16 path on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); elsewhere bf16
    falls back to the plain layers and fp32 packing is checked instead."""
    import contextlib

    import torch

    from tasks.models import load_base_model
    from tasks.speedups.packing import PackedLinear, packed_for_inference, packing_available

    assert packing_available(torch.float32)  # this CPU build of torch has oneDNN
    precision = "bf16" if packing_available(torch.bfloat16) else "fp32"
    model = load_base_model(tiny_model_dir).eval()
    inputs = torch.randint(3, 40, (3, 11))
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with torch.no_grad(), autocast:
        expected = model(input_ids=inputs).logits
        with packed_for_inference(model, precision):
            assert not any(type(m) is torch.nn.Linear for m in model.modules())
            assert sum(isinstance(m, PackedLinear) for m in model.modules()) == len(linears)
            packed = model(input_ids=inputs).logits
    assert torch.allclose(packed.float(), expected.float(), atol=1e-2), float((packed - expected).abs().max())
    assert [m for m in model.modules() if type(m) is torch.nn.Linear] == linears  # the originals are back
    if precision == "fp32":  # no bf16 path here: asking for it leaves the plain layers
        with torch.no_grad(), packed_for_inference(model, "bf16"):
            assert [m for m in model.modules() if type(m) is torch.nn.Linear] == linears


def _small_delta_adapter(tiny_model_dir: Path, folder: Path) -> Path:
    """A LoRA adapter whose delta is small beside the weights, as a trained one's is (the demo's SFT adapter:
    0.1 % of the weights' norm, below bf16's resolution of 2^-8)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from tasks.models import load_base_model

    torch.manual_seed(0)
    model = get_peft_model(load_base_model(tiny_model_dir), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.002)
    model.save_pretrained(folder)
    return folder


def test_bf16_inference_scores_the_model_the_trainer_scores_not_a_rounded_merge(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """In bf16 the adapter stays apart from the weights (the trainer's PEFT model under autocast, and vLLM, keep
    it apart): merged and rounded to bf16, a small delta became rounding noise as large as itself, and the engines
    disagreed on what the same adapter scores. In fp32 merging is exact and stays."""
    import torch
    from peft import PeftModel

    from tasks.models import compute_autocast, load_base_model, load_policy
    from tasks.speedups.low_rank import LowRankLinear
    from tasks.speedups.packing import packed_for_inference

    adapter = _small_delta_adapter(tiny_model_dir, tmp_path / "adapter")
    ids = torch.randint(3, 90, (4, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        exact = load_policy(tiny_model_dir, adapter, precision="fp32")(input_ids=ids).logits
        trainer = PeftModel.from_pretrained(load_base_model(tiny_model_dir), str(adapter)).eval()
        with compute_autocast("bf16"):
            reference = trainer(input_ids=ids).logits.float()  # what GRPO's loss and vLLM score
            merged = trainer.merge_and_unload()(input_ids=ids).logits.float()  # the old inference path
        inference = load_policy(tiny_model_dir, adapter, precision="bf16")
        assert any(isinstance(m, LowRankLinear) for m in inference.modules())
        with compute_autocast("bf16"), packed_for_inference(inference, "bf16"):
            kept_apart = inference(input_ids=ids).logits.float()
    assert not any(isinstance(m, LowRankLinear) for m in load_policy(tiny_model_dir, adapter).modules())
    base_gap = (reference - exact).abs().mean()  # bf16's own rounding, the same for both paths
    assert (kept_apart - reference).abs().max() < 1e-2
    assert (merged - reference).abs().mean() > 4 * (kept_apart - reference).abs().mean()
    assert (merged - reference).abs().mean() > 0.5 * base_gap


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_kept_base_takes_adapter_after_adapter_and_gives_each_what_a_fresh_load_gives(
    precision: str, tiny_model_dir: Path, tiny_adapter: Path, tmp_path: Path
) -> None:
    """The in-training hold-out keeps the base loaded and swaps adapters: each adapter on the kept base computes
    what the base loaded afresh with it computes (merged in fp32, kept apart in bf16), and after each the base is
    the base again, to the bit."""
    import shutil

    import torch
    from peft.tuners.lora import LoraLayer
    from safetensors.torch import load_file, save_file

    from tasks.models import KeptBase, compute_autocast, load_policy
    from tasks.speedups.low_rank import LowRankLinear

    other = tmp_path / "other"
    shutil.copytree(tiny_adapter, other)
    weights = load_file(other / "adapter_model.safetensors")
    save_file({k: -2 * v if "lora_B" in k else v for k, v in weights.items()}, other / "adapter_model.safetensors")
    ids = torch.randint(3, 90, (2, 16), generator=torch.Generator().manual_seed(1))
    fresh_base = load_base_model(tiny_model_dir)
    kept = KeptBase(tiny_model_dir)
    with torch.no_grad(), compute_autocast(precision):
        base_logits = fresh_base(input_ids=ids).logits
        for adapter in (tiny_adapter, other, tiny_adapter):
            with kept.policy(adapter, precision) as policy:
                swapped = policy(input_ids=ids).logits
            assert torch.equal(swapped, load_policy(tiny_model_dir, adapter, precision=precision)(input_ids=ids).logits)
            assert not torch.equal(swapped, base_logits)
            assert torch.equal(kept.model(input_ids=ids).logits, base_logits)
            assert not any(isinstance(m, LoraLayer | LowRankLinear) for m in kept.model.modules())
