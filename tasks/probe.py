"""Stage 2, probe: sample G completions for N prompts with the GRPO sampling settings and look at the reward
distribution before spending compute. On the base model it tells whether SFT is needed; on the SFT policy it
is the gate before GRPO.
Must not import: another stage's module; Prefect and MLflow appear only in its task wrapper."""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from tasks import restore_defaults
from tasks.config import PipelineConfig
from tasks.errors import GateStop
from tasks.evaluation import Job, JobShare, judge_bias, processes_for, run_jobs, score_groups
from tasks.inputs import read_jsonl, write_jsonl
from tasks.models import GenerationStats, policy_sampler, samples_on_cpu
from tasks.tracking import (
    Tracker,
    emit_pipeline_event,
    prefect_task,
    publish_markdown,
    publish_table,
    tracked_stage,
    work_bar,
)
from tasks.training import LEDGER_DIR, completion_columns, sample_rows, write_part

logger = logging.getLogger(__name__)


class NoLearningSignal(GateStop, RuntimeError):
    """The probe found too few prompt groups whose rewards differ: GRPO would learn nothing."""


@dataclass
class ProbeResult:
    __setstate__ = restore_defaults  # results pickled before a field was added load with its default

    label: str
    prompts: int
    group_size: int
    reward_mean: float
    reward_std: float
    per_function: dict[str, dict[str, float]]
    signal_share: float
    all_zero_groups: int
    all_max_groups: int
    pass_rate_mean: float
    pass_rates: dict[str, float] = field(repr=False)
    histogram_path: Path | None = None
    samples_path: Path | None = None
    tokens_per_second: float = 0.0
    verdict: str = ""
    signal_from: str = "reward"
    engine: str = "transformers"  # what sampled (tasks.models.engine_name)
    judge_bias: dict[str, dict[str, float]] = field(default_factory=dict)  # per judge (tasks.evaluation.judge_bias)

    @property
    def has_signal(self) -> bool:
        return self.signal_share > 0

    def to_json(self) -> dict[str, Any]:
        data = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}
        data.pop("pass_rates")
        return data


def summarize(
    label: str, rows: list[dict[str, Any]], scores: dict[str, Any], signal_from: str = "reward"
) -> ProbeResult:
    """The probe's numbers from a ``prompts × G`` score table (pure). A group carries signal when its
    weighted rewards differ (``signal_from="reward"``) or when some samples solve it and others not."""
    total, correct = scores["total"], scores["correct"]
    judged = correct if signal_from == "correctness" else total
    spread = judged.max(axis=1) - judged.min(axis=1)
    pass_rates = correct.mean(axis=1)
    return ProbeResult(
        label=label,
        prompts=len(rows),
        group_size=total.shape[1],
        reward_mean=float(total.mean()),
        reward_std=float(total.std()),
        per_function={
            name: {
                "mean": float(np.nanmean(values)) if np.isfinite(values).any() else float("nan"),
                "std": float(np.nanstd(values)) if np.isfinite(values).any() else float("nan"),
                "none": int(scores["none_counts"][name]),
            }
            for name, values in scores["per_function"].items()
        },
        signal_share=float((spread > 1e-9).mean()),
        all_zero_groups=int(((spread <= 1e-9) & (np.abs(judged.max(axis=1)) <= 1e-9)).sum()),
        all_max_groups=int(((spread <= 1e-9) & (pass_rates == 1.0)).sum()),
        pass_rate_mean=float(pass_rates.mean()),
        pass_rates={row["id"]: float(rate) for row, rate in zip(rows, pass_rates, strict=True)},
        signal_from=signal_from,
    )


def gate_message(result: ProbeResult, min_signal_share: float, samples: list[str] | None = None) -> str | None:
    """None when the probe shows enough signal; else an actionable message naming the practice guide's pitfall."""
    if result.signal_share >= min_signal_share:
        return None
    flat = result.prompts - round(result.signal_share * result.prompts)
    head = (
        f"{result.label} probe: only {result.signal_share:.0%} of {result.prompts} groups of {result.group_size} "
        f"have {'samples that differ in correctness' if result.signal_from == 'correctness' else 'rewards that differ'}"
        f" (minimum probe.min_signal_share={min_signal_share:.0%}); "
    )
    if result.all_zero_groups >= flat / 2:
        advice = (
            f"{'no sample correct' if result.signal_from == 'correctness' else 'all rewards 0'} in "
            f"{result.all_zero_groups}/{result.prompts} groups — pitfall 'all-zero rewards': the "
            "model never produces a rewarded answer (format). Check SFT (more steps, or enable it), relax parsing, "
            "look at the samples"
        )
    elif result.all_max_groups >= flat / 2:
        advice = (
            f"every sample correct in {result.all_max_groups}/{result.prompts} groups — nothing left to learn; "
            "pitfall 'overfitting the tests': use harder or more diverse prompts, or the pass-rate filter"
        )
    else:
        advice = (
            "rewards are constant within groups — pitfall 'training too slow': raise temperature or "
            "num_generations, or use rewards with partial credit"
        )
    shown = "; ".join(repr(s[:80]) for s in (samples or [])[:3])
    return head + advice + (f". Samples: {shown}" if shown else "")


def prompts_to_keep(config: PipelineConfig, probes: dict[str, ProbeResult]) -> set[str] | None:
    """The prompt ids GRPO trains on when ``probe.pass_rate_band`` is set (judged by the latest probe: the SFT
    policy's, else the base model's); None means every prompt."""
    latest = probes.get("sft") or probes.get("base")
    if not config.probe.pass_rate_band or latest is None:
        return None
    return pass_rate_filter(latest, config.probe.pass_rate_band)


def pass_rate_filter(result: ProbeResult, band: tuple[float, float]) -> set[str]:
    """Ids of probed prompts whose pass rate lies inside ``band`` (inclusive), as open-r1's pass-rate filter.

    >>> r = ProbeResult("sft", 3, 4, 0, 0, {}, 1, 0, 0, 0.5, {"a": 0.0, "b": 0.5, "c": 1.0})
    >>> sorted(pass_rate_filter(r, (0.1, 0.9)))
    ['b']
    """
    low, high = band
    return {row_id for row_id, rate in result.pass_rates.items() if low <= rate <= high}


def _histogram(result: ProbeResult, totals: np.ndarray, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    left.hist(totals.ravel(), bins=20, color="#4c72b0")
    left.set(title=f"{result.label}: weighted reward", xlabel="reward", ylabel="completions")
    right.hist(list(result.pass_rates.values()), bins=np.linspace(0, 1, 11), color="#55a868")
    right.set(title="per-prompt pass rate", xlabel="pass rate", ylabel="prompts")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def sample_probe(
    config: PipelineConfig, sampler: Any, prompts: list[str], report: Callable[[int], None] | None
) -> tuple[list[list[str]], GenerationStats]:
    """``grpo.num_generations`` completions of each prompt, as GRPO samples them. Where models sample with
    transformers on a CPU with two torch threads or more (``probe.processes``), this process and a forked worker
    take every other batch (``tasks.evaluation.parallel``); each batch draws from its own seed, so the completions
    are those of one process."""
    settings = {
        "n": config.grpo.num_generations,
        "temperature": config.grpo.temperature,
        "max_new_tokens": config.grpo.max_completion_length,
        "seed": config.seed,
    }
    # A tool sampler's rollouts take turns (and sandbox calls) in this process: one part.
    forkable = sampler.backend == "transformers" and not hasattr(sampler, "without_tools")
    parts = processes_for(config.probe.processes, 2, samples_on_cpu(config)) if forkable else 1
    started = time.perf_counter()

    def sample_part(index: int, share: Callable[[int], None]) -> tuple[list[list[str]], GenerationStats]:
        stats, counted = GenerationStats(), JobShare(share, len(prompts))
        split = {"part": (index, parts)} if parts > 1 else {}
        return sampler.sample(prompts, stats=stats, progress=counted.progress, **settings, **split), stats

    results = run_jobs([Job(f"part {i}", partial(sample_part, i)) for i in range(parts)], parts, report)
    parts_done = list(results.values())
    completions = [next((done[i] for done, _ in parts_done if done[i]), []) for i in range(len(prompts))]
    sequences, new_tokens = (
        sum(getattr(stats, name) for _, stats in parts_done) for name in ("sequences", "new_tokens")
    )
    return completions, GenerationStats(sequences, new_tokens, time.perf_counter() - started)


def run_probe(
    config: PipelineConfig,
    train_path: Path,
    base_model_dir: Path,
    adapter_dir: Path | None,
    stage_dir: Path,
    label: str,
) -> ProbeResult:
    """Sample, score and summarize; writes a histogram PNG and a JSONL of samples with their rewards."""
    rows = read_jsonl(train_path)
    rows = random.Random(config.seed).sample(rows, min(config.probe.num_prompts, len(rows)))
    sampler = policy_sampler(config, base_model_dir, adapter_dir, config.probe.batch_size)
    prompts = [sampler.prompt_of(row, config.data.system_prompt) for row in rows]
    with work_bar(len(rows), f"probe {label}", "prompt") as advance:
        completions, stats = sample_probe(config, sampler, prompts, advance)
    logger.info("probe %s sampled with %s", label, sampler.backend)
    scores = score_groups(config, rows, completions)
    ledger = sample_rows(f"probe_{label}", rows, completions, scores["per_function"], scores["total"], sampler.backend)
    write_part(stage_dir / LEDGER_DIR, ledger, f"probe-{label}")
    result = summarize(label, rows, scores, config.probe.signal_from)
    result.tokens_per_second = stats.tokens_per_second
    result.engine = sampler.backend
    result.judge_bias = judge_bias(config, rows, completions, scores)
    stage_dir.mkdir(parents=True, exist_ok=True)
    result.histogram_path = _histogram(result, scores["total"], stage_dir / f"probe_{label}_rewards.png")
    result.samples_path = stage_dir / f"probe_{label}_samples.jsonl"
    write_jsonl(
        result.samples_path,
        [
            {
                "id": row["id"],
                "ground_truth": row["ground_truth"],
                **completion_columns(completions[i][j], getattr(completions[i][j], "calls", None)),
                "reward": float(scores["total"][i, j]),
                **{name: _plain(values[i, j]) for name, values in scores["per_function"].items()},
            }
            for i, row in enumerate(rows)
            for j in range(len(completions[i]))
        ],
    )
    (stage_dir / f"probe_{label}.json").write_text(json.dumps(result.to_json(), indent=2))
    return result


def _plain(value: float) -> float | None:
    return None if np.isnan(value) else float(value)


def sample_completions(result: ProbeResult, limit: int = 3) -> list[str]:
    """A few probed completions to quote in messages."""
    if result.samples_path is None or not result.samples_path.is_file():
        return []
    return [record["completion"] for record in read_jsonl(result.samples_path)[:limit]]


@prefect_task("probe", cache="stage", task_run_name="probe-{label}")
def probe_task(
    config: PipelineConfig,
    tracker: Tracker,
    train_path: Path,
    base_model_dir: Path,
    adapter_dir: Path | None,
    label: str,
    gate: bool,
) -> ProbeResult:
    """Prefect wrapper: probe, log the distribution, and (when ``gate``) stop the flow on no learning signal."""
    with tracked_stage(tracker, f"probe_{label}") as stage:
        result = run_probe(config, train_path, base_model_dir, adapter_dir, stage.dir, label)
        stage.log_metrics(
            {
                "reward_mean": result.reward_mean,
                "reward_std": result.reward_std,
                "signal_share": result.signal_share,
                "pass_rate_mean": result.pass_rate_mean,
                "all_zero_groups": result.all_zero_groups,
                "all_max_groups": result.all_max_groups,
                "tokens_per_second": result.tokens_per_second,
                **{f"{name}_mean": v["mean"] for name, v in result.per_function.items()},
                **{
                    f"judge_bias/{judge}/{key}": value
                    for judge, figures in result.judge_bias.items()
                    for key, value in figures.items()
                    if value == value  # NaN: not measurable here
                },
            }
        )
        for path in (result.histogram_path, result.samples_path):
            if path is not None:
                stage.log_artifact(path, "probe")
        publish_table(
            f"probe-{label}",
            [{"reward": name, **values} for name, values in result.per_function.items()]
            + [{"reward": "weighted total", "mean": result.reward_mean, "std": result.reward_std}],
        )
        message = gate_message(result, config.probe.min_signal_share, sample_completions(result))
        result.verdict = probe_verdict(result, message, gate)
        publish_markdown(f"probe-{label}-verdict", f"### probe ({label})\n{result.verdict}\n")
        stage.set_tags({"verdict": result.verdict[:5000]})
        stage.log_params({"generation_engine": result.engine})
        if message and gate:  # the stage run closes FAILED, automations hear of it, the flow stops
            emit_pipeline_event("stopped-by-probe", tracker.run_id, {"message": message})
            raise NoLearningSignal(message)
        return result


def probe_verdict(result: ProbeResult, gate_text: str | None, gates: bool) -> str:
    """One line for the summary: what the probe means for the next stage.

    >>> r = ProbeResult("base", 10, 8, 0.0, 0.0, {}, 0.0, 10, 0, 0.0, {})
    >>> probe_verdict(r, "no signal", gates=False)
    'SFT needed: 0% of groups carry signal, pass rate 0.0%'
    """
    numbers = f"{result.signal_share:.0%} of groups carry signal, pass rate {result.pass_rate_mean:.1%}"
    if gates:
        return f"GRPO goes ahead: {numbers}" if gate_text is None else f"stopped: {gate_text}"
    return f"SFT needed: {numbers}" if gate_text is not None else f"signal present: {numbers}"
