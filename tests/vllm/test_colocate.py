"""GRPO, probe and evaluation through a real vLLM engine in the test process (colocate), on the tiny model."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import TrainerCallback

from flows.pipeline import pipeline
from tasks.tracking import RUN_ID_TAG, client_for

LENGTH_REWARD = "def longer(completions, **kwargs):\n    return [len(c) / 12 for c in completions]\n"


def stage_runs(config: Any, run_id: str) -> dict[str, Any]:
    client = client_for(config.resolved_tracking_uri())
    experiment = client.get_experiment_by_name(config.tracking.experiment_name)
    runs = client.search_runs([experiment.experiment_id], f"tags.`{RUN_ID_TAG}` = '{run_id}'")
    return {r.data.tags["grpoflow.stage"]: r for r in runs if "grpoflow.stage" in r.data.tags}


def test_tiny_pipeline_on_vllm_colocate_registers_a_version_and_says_vllm_generated(
    tmp_path: Path, make_vllm_config: Any
) -> None:
    threads = torch.get_num_threads()
    # the hold-out scored through vLLM at every GRPO step, the best checkpoint handed on
    config = make_vllm_config(
        tmp_path / "outputs", **{"grpo.eval_steps": 1, "grpo.eval_prompts": 8, "grpo.select": "best"}
    )
    summary = pipeline(config, "vllm-colocate")
    assert summary["promotion"]["version"] == "1"
    grpo = stage_runs(config, "vllm-colocate")["grpo"].data
    assert grpo.tags["generation_backend"] == "vllm-colocate"
    assert grpo.tags["generation"].startswith(f"vllm-colocate: {config.grpo.max_steps} batches")
    assert summary["evaluation"]["engine"] == "vllm-colocate"  # probes and evaluation name it as GRPO does
    assert summary["probes"]["sft"]["engine"] == "vllm-colocate"
    assert grpo.tags["generation_backend_configured"] == "vllm"
    assert grpo.metrics["sampling/sampling_logp_difference/mean"] < 1e-4  # fp32: vLLM and the trainer agree
    from tasks.training import read_ledger

    ledger = read_ledger(config.output_dir / "vllm-colocate" / "grpo" / "rollouts")
    assert len([row for row in ledger if row["role"] == "grpo"]) == config.grpo.batch_size * config.grpo.max_steps
    assert {row["backend"] for row in ledger} == {"vllm-colocate"}  # GRPO's samples and the hold-out's
    evals = [row for row in ledger if row["role"] == "eval"]
    assert sorted({row["step"] for row in evals}) == list(range(1, config.grpo.max_steps + 1))
    assert "eval_holdout_pass_at_1" in grpo.metrics and summary["grpo"]["selected"]["select"] == "best"
    # vLLM's CPU worker replaced torch.set_num_threads with a no-op in this process; grpoflow put torch's back.
    assert torch.get_num_threads() == threads
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(threads)


class AdapterDigests(TrainerCallback):
    """sha256 of the trainer's adapter file before training and after every optimizer step."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.by_step = folder, {}

    def _digest(self, model: Any, step: int) -> None:
        from tasks.models import adapter_digest

        model.save_pretrained(str(self.folder / f"step-{step}"))
        self.by_step[step] = adapter_digest(self.folder / f"step-{step}")

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._digest(model, state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._digest(model, state.global_step)


def _split(config: Any, tmp_path: Path) -> Any:
    from tasks.validate import run_validate

    return run_validate(config, tmp_path / "split")


def _length_rewarded(make_vllm_config: Any, tmp_path: Path, **overrides: Any) -> Any:
    """The tiny config with a reward that varies within groups (completion length), so every step moves the
    adapter (the tiny model never earns the math reward: zero advantages, zero gradients)."""
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    config = make_vllm_config(tmp_path / "outputs", **{"grpo.learning_rate": 0.01, **overrides})
    return config.model_copy(
        update={"rewards": [type(config.rewards[0])(name="length_reward:longer", path=str(tmp_path))]}
    )


def test_vllm_samples_step_n_plus_1_with_the_trainers_adapter_after_step_n(
    tmp_path: Path, vllm_model_dir: Path, caplog: pytest.LogCaptureFixture, make_vllm_config: Any
) -> None:
    from tasks.grpo import run_grpo

    config = _length_rewarded(make_vllm_config, tmp_path, **{"grpo.max_steps": 3})
    split = _split(config, tmp_path)
    digests = AdapterDigests(tmp_path / "digests")
    caplog.set_level(logging.INFO, logger="tasks.speedups.grpo_trainer")
    caplog.set_level(logging.DEBUG, logger="tasks.speedups.vllm_colocate")  # last: the handler takes this level
    result = run_grpo(config, split.train_path, vllm_model_dir, None, tmp_path / "grpo", [digests])
    assert "shared prefill checked against TRL's log-probs" in caplog.text  # the loss speed-up, self-checked
    syncs = [(int(m[1]), m[2]) for m in re.finditer(r"step (\d+), .* sha256 (\w+)", caplog.text)]
    assert [step for step, _ in syncs] == [0, 1, 2]  # before each generation: the weights of the step before
    assert all(digest == digests.by_step[step] for step, digest in syncs)
    assert len({digest for _, digest in syncs}) == 3  # the adapter moved every step: a stale sync would show
    assert result.generated_by.startswith("vllm-colocate: 3 batches") and "3 adapter syncs" in result.generated_by
    differences = [
        h["sampling/sampling_logp_difference/mean"]
        for h in result.history
        if "sampling/sampling_logp_difference/mean" in h
    ]
    assert len(differences) == 3 and max(differences) < 1e-4


def test_log_probs_beyond_the_bound_fail_grpo_with_the_numbers(
    tmp_path: Path, vllm_model_dir: Path, make_vllm_config: Any
) -> None:
    from tasks.grpo import run_grpo
    from tasks.training import SamplerMismatch

    config = make_vllm_config(tmp_path / "outputs", **{"grpo.generation.max_logp_difference": 1e-12})
    split = _split(config, tmp_path)
    expected = r"^step 1: the vllm-colocate sampler's log-probs differ .* by \d\.\d{4} on average \(max .*> grpo"
    with pytest.raises(SamplerMismatch, match=expected + r"\.generation\.max_logp_difference"):
        run_grpo(config, split.train_path, vllm_model_dir, None, tmp_path / "grpo")


def test_probe_and_evaluation_sample_through_vllm_and_agree_with_transformers(
    tmp_path: Path, vllm_model_dir: Path, lora_adapter_h32: Path, make_vllm_config: Any, capfd: Any
) -> None:
    from tasks.evaluate import ModelSpec, holdout_rows, score_model
    from tasks.inputs import render_prompt
    from tasks.models import TransformersSampler, VllmSampler, policy_sampler
    from tasks.models.vllm_engine import close_engine
    from tasks.probe import run_probe

    config = make_vllm_config(tmp_path / "outputs")
    split = _split(config, tmp_path)
    close_engine()  # an engine of its own: its start-up is what logs the most
    capfd.readouterr()
    sampler = policy_sampler(config, vllm_model_dir, lora_adapter_h32, 64)
    assert isinstance(sampler, VllmSampler)
    # vLLM's own records are in the run's log file, not on the console (tests/tasks/models/test_vllm_logs.py).
    console = "".join(capfd.readouterr())
    kept = (tmp_path / "outputs" / "logs" / "vllm.log").read_text()
    assert "Initializing a V1 LLM engine" in kept and "Initializing a V1 LLM engine" not in console, console[-2000:]
    assert " vllm." not in console and "[cpu_worker.py" not in console, console[-2000:]
    rows = holdout_rows(config, split.holdout_path)
    prompts = [render_prompt(sampler.tokenizer, row["prompt"], config.data.system_prompt) for row in rows]
    seen: list[tuple[int, int]] = []
    first = sampler.sample(prompts, n=3, max_new_tokens=12, seed=5, progress=lambda done, of: seen.append((done, of)))
    assert [len(group) for group in first] == [3] * len(prompts)
    # The bar moves as prompts finish inside the one engine call, not once at its end.
    assert seen == [(i, len(prompts)) for i in range(1, len(prompts) + 1)]
    assert sampler.sample(prompts, n=3, max_new_tokens=12, seed=5) == first  # same seed, same samples
    assert sampler.sample(prompts, n=3, max_new_tokens=12, seed=6) != first

    plain = make_vllm_config(tmp_path / "outputs", **{"grpo.generation.backend": "transformers"})
    reference = policy_sampler(plain, vllm_model_dir, lora_adapter_h32, 64)
    assert isinstance(reference, TransformersSampler)
    ours = sampler.sample(prompts, greedy=True, max_new_tokens=12)
    theirs = reference.sample(prompts, greedy=True, max_new_tokens=12)
    agree = sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(prompts)
    assert agree >= 0.75, (ours, theirs)  # fp32 on both sides: only near-ties may differ

    probe = run_probe(config, split.train_path, vllm_model_dir, lora_adapter_h32, tmp_path / "probe", "sft")
    assert probe.samples_path.read_text().count("\n") == config.probe.num_prompts * config.grpo.num_generations
    scores = score_model(config, ModelSpec("sft", vllm_model_dir, lora_adapter_h32), rows)
    assert scores.n_prompts == len(rows) and len(scores.per_prompt_pass1) == len(rows)
    assert scores.tokens_per_second > 0


def test_same_config_and_seed_give_the_same_adapter_through_vllm(
    tmp_path: Path, vllm_model_dir: Path, make_vllm_config: Any
) -> None:
    """vLLM's CPU sampler takes no per-request seed; it draws from torch's global generator, which the trainer
    seeds: two runs of one config in one process (one shared engine) train the same adapter."""
    from tasks.grpo import run_grpo
    from tasks.models import adapter_digest

    config = _length_rewarded(make_vllm_config, tmp_path, **{"grpo.max_steps": 2})
    split = _split(config, tmp_path)
    first = run_grpo(config, split.train_path, vllm_model_dir, None, tmp_path / "first")
    second = run_grpo(config, split.train_path, vllm_model_dir, None, tmp_path / "second")
    assert adapter_digest(first.adapter_dir) == adapter_digest(second.adapter_dir)
    other = config.model_copy(update={"seed": config.seed + 1})
    third = run_grpo(other, split.train_path, vllm_model_dir, None, tmp_path / "third")
    assert adapter_digest(third.adapter_dir) != adapter_digest(first.adapter_dir)


# Measured on tiny-random-h32 in fp32 with its rank-16 adapter: max |Δ log-prob| over 16 completions 9.5e-7.
ENGINE_LOGP_BOUND = 1e-3


def test_the_engines_log_probs_of_the_same_completions_agree(
    tmp_path: Path, vllm_model_dir: Path, lora_adapter_h32: Path, make_vllm_config: Any
) -> None:
    """vLLM's log-prob of each token it sampled, against grpoflow's transformers model scoring the same tokens
    (teacher-forced), with the adapter on both sides, in fp32: an engine that renders, stops, or applies the LoRA
    differently drifts past the bound (the adapter moves these log-probs far more than the bound)."""
    from vllm import SamplingParams

    from tasks.inputs import render_prompt
    from tasks.models import adapter_request, load_policy, load_tokenizer, pipeline_engine_spec, shared_engine

    config = make_vllm_config(tmp_path / "outputs")
    tokenizer = load_tokenizer(vllm_model_dir)
    prompts = [render_prompt(tokenizer, f"What is {a} + {a * 3}?", config.data.system_prompt) for a in range(8)]
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=0, max_tokens=12, logprobs=0, seed=None)
    torch.manual_seed(3)
    outputs = shared_engine(pipeline_engine_spec(config, vllm_model_dir)).generate(
        [{"prompt_token_ids": ids} for ids in encoded], params, lora_request=adapter_request(lora_adapter_h32)
    )

    def scored(model: Any, prompt: list[int], completion: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]

    policy, base = load_policy(vllm_model_dir, lora_adapter_h32, precision="fp32"), load_policy(vllm_model_dir, None)
    gaps, adapter_moves = [], []
    for prompt, output in zip(encoded, outputs, strict=True):
        for sample in output.outputs:
            tokens = list(sample.token_ids)
            theirs = torch.tensor([step[token].logprob for step, token in zip(sample.logprobs, tokens, strict=True)])
            ours = scored(policy, prompt, tokens)
            gaps.append((ours - theirs).abs().max().item())
            adapter_moves.append((scored(base, prompt, tokens) - ours).abs().max().item())
    assert max(gaps) < ENGINE_LOGP_BOUND, f"engines' log-probs differ by up to {max(gaps):.2e}"
    assert min(adapter_moves) > 100 * ENGINE_LOGP_BOUND  # the adapter's effect is far above the bound


@pytest.mark.xdist_group("ranks")
def test_two_ranks_on_vllm_colocate_draw_their_own_samples_and_the_seed_decides_the_adapter(
    tmp_path: Path, make_vllm_config: Any
) -> None:
    """Two training processes, each with its own in-process engine seeded ``seed + rank`` (as TRL seeds them): one
    group of 8 split 4 + 4 over the ranks draws different completions on each; the same config and seed draw the
    same completions twice and train the same adapter, to the bit. The second run follows an in-process engine
    (the first run's evaluation), which once left the ranks another thread count than the first's: ~5e-6 apart."""
    from safetensors.torch import load_file

    from flows.pipeline import pipeline
    from tasks.training import read_ledger

    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    samples, adapters = [], []
    for run in ("first", "second"):
        config = make_vllm_config(
            tmp_path / run,
            **{
                "orchestration.num_processes": 2,
                "grpo.batch_size": 4,  # per process: the two ranks hold one group of 8 between them
                "grpo.num_generations": 8,
                "grpo.learning_rate": 0.01,
                "sft.enabled": False,
                "probe.enabled": False,
                "canaries.enabled": False,
            },
        )
        config = config.model_copy(
            update={"rewards": [type(config.rewards[0])(name="length_reward:longer", path=str(tmp_path))]}
        )
        summary = pipeline(config, "two-ranks")
        assert summary["evaluation"]["engine"] == "vllm-colocate"
        ledger = read_ledger(config.output_dir / "two-ranks" / "grpo" / "rollouts")
        first_step = [row for row in ledger if row["role"] == "grpo" and row["step"] == 1]
        assert {row["rank"] for row in first_step} == {0, 1} and len({row["prompt_id"] for row in first_step}) == 1
        by_rank = {rank: sorted(r["completion"] for r in first_step if r["rank"] == rank) for rank in (0, 1)}
        assert by_rank[0] != by_rank[1]  # one engine seed for both ranks would draw the same four
        samples.append([(row["step"], row["rank"], row["completion"]) for row in ledger if row["role"] == "grpo"])
        adapters.append(load_file(config.output_dir / "two-ranks" / "grpo" / "adapter" / "adapter_model.safetensors"))
    assert samples[0] == samples[1]
    assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])
