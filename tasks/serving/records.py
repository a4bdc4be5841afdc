"""What a registered version records for serving, and the checks that read it: the adapter's digest and the greedy
answers of a few smoke prompts (with the engine and precision that gave them).

A version's ``adapter_digest`` tag is written at registration; its smoke record is ``smoke.json`` beside its
``MLmodel``. The server refuses a version whose downloaded adapter has another digest, or whose answers to the smoke
prompts do not agree with the record: identical where it serves on the recording's engine and precision, else a
stated share (``serving.smoke_min_agreement``).
Must not import: torch, transformers, Prefect, MLflow (pure records and checks; the engines answer elsewhere).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DIGEST_TAG = "adapter_digest"
SMOKE_FILE = "smoke.json"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_digest(adapter_dir: Path) -> str:
    """The sha256 of an adapter folder's config and weights (names and bytes, in a fixed order).

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "adapter_config.json").write_text("{}")
    >>> _ = (folder / "adapter_model.safetensors").write_bytes(b"w")
    >>> adapter_digest(folder)[:12]
    'c000976b07fa'
    """
    digest = hashlib.sha256()
    for name in ADAPTER_FILES:
        data = (Path(adapter_dir) / name).read_bytes()
        digest.update(f"{name}:{len(data)}:".encode() + data)
    return digest.hexdigest()


@dataclass(frozen=True)
class SmokeRecord:
    """The smoke prompts (chat messages, as a client sends them) and the greedy answers a version gave them."""

    prompts: list[list[dict[str, str]]]
    answers: list[str]
    engine: str
    precision: str
    max_tokens: int
    system_prompt: str | None = None
    device: str = ""  # what computed them (tasks.models.hardware.compute_device): identity holds only on its like
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def write_smoke_record(folder: Path, record: SmokeRecord) -> Path:
    """Write ``record`` as ``smoke.json`` into a version's folder."""
    path = Path(folder) / SMOKE_FILE
    path.write_text(json.dumps(record.to_json(), indent=2))
    return path


def read_smoke_record(folder: Path) -> SmokeRecord | None:
    """The smoke record in a downloaded version's folder, or None for a version registered without one."""
    path = Path(folder) / SMOKE_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return SmokeRecord(**{key: data[key] for key in SmokeRecord.__dataclass_fields__ if key in data})


def prefix_agreement(recorded: str, served: str) -> float:
    """The share of ``recorded``'s characters that ``served`` repeats from its start (1.0 for equal strings).

    >>> prefix_agreement("The answer is 42", "The answer is 41"), prefix_agreement("", "")
    (0.9375, 1.0)
    """
    if not recorded and not served:
        return 1.0
    same = 0
    for a, b in zip(recorded, served, strict=False):
        if a != b:
            break
        same += 1
    return same / max(len(recorded), len(served))


def smoke_verdict(
    record: SmokeRecord, answers: list[str], engine: str, precision: str, min_agreement: float, device: str = ""
) -> tuple[bool, str]:
    """Whether the served ``answers`` agree with the recorded ones, and why: every one identical on the
    recording's engine, precision and device, else a mean prefix agreement of at least ``min_agreement`` (another
    device, a GPU or another CPU's instructions, adds up in another order).

    >>> record = SmokeRecord([[{"role": "user", "content": "2+2?"}]], ["4"], "transformers", "fp32", 8)
    >>> same, other = ("transformers", "fp32"), ("vllm", "fp32")
    >>> smoke_verdict(record, ["4"], *same, 0.5)[0], smoke_verdict(record, ["5"], *other, 0.5)[0]
    (True, False)
    >>> smoke_verdict(record, ["5"], "transformers", "fp32", 0.5)[1]
    "smoke prompt 1 of 1 answered differently on the recording engine (transformers, fp32): recorded '4', served '5'"
    """
    if len(answers) != len(record.answers):
        return False, f"{len(answers)} smoke answers for {len(record.answers)} recorded"
    if engine == record.engine and precision == record.precision and device == record.device:
        for index, (want, got) in enumerate(zip(record.answers, answers, strict=True)):
            if want != got:
                return False, (
                    f"smoke prompt {index + 1} of {len(answers)} answered differently on the recording engine "
                    f"({engine}, {precision}): recorded {want[:60]!r}, served {got[:60]!r}"
                )
        return True, f"{len(answers)} smoke answers identical to the recorded ones ({engine}, {precision})"
    shares = [prefix_agreement(want, got) for want, got in zip(record.answers, answers, strict=True)]
    mean = sum(shares) / len(shares) if shares else 1.0
    said = (
        f"smoke answers agree {mean:.2f} (mean prefix share) with the ones recorded on {record.engine}, "
        f"{record.precision} ({record.device or 'device not recorded'}), served on {engine}, {precision} ({device}) "
        f"(at least {min_agreement:.2f} needed)"
    )
    return mean >= min_agreement, said
