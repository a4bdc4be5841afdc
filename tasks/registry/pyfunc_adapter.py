"""The MLflow model of a registered adapter, written as models-from-code (no pickled class): MLflow executes this
file when ``mlflow.pyfunc.load_model`` or ``mlflow models serve`` loads a version. It loads the base model the
way grpoflow does (packaged SmolLM2, a local folder, a Hub id), checks it is the one the adapter was trained on,
puts the adapter on top and answers prompts.

Input: a list of prompts (strings), or a DataFrame whose first column holds them. Params: ``max_new_tokens``,
``temperature`` (0 = greedy). Output: one completion per prompt.
Needs grpoflow installed where it is loaded (``--env-manager local``).
Must not import: Prefect, the stages, or torch and transformers at import (MLflow loads this file to list the
model, before it loads the model).
"""

from __future__ import annotations

from typing import Any

import mlflow
import pandas as pd
from mlflow.pyfunc import PythonModel


class GrpoflowAdapterModel(PythonModel):
    """A LoRA adapter on its base model, answering chat prompts with the training run's system prompt."""

    def load_context(self, context: Any) -> None:
        from tasks.models import load_policy, load_tokenizer, resolve_model_source
        from tasks.registry.packaging import check_base_fingerprint

        config = context.model_config or {}
        base_dir = resolve_model_source(config["base_model"], config.get("base_revision"))
        check_base_fingerprint(base_dir, config.get("base_fingerprint"), config["base_model"])
        self.system_prompt = config.get("system_prompt")
        self.precision = config.get("precision", "auto")
        self.tokenizer = load_tokenizer(base_dir)
        self.model = load_policy(base_dir, context.artifacts["adapter"], precision=self.precision)

    # The hint is a DataFrame, what MLflow hands over under the explicit string signature: MLflow infers no schema
    # from it, so the signature and its params (max_new_tokens, temperature) stay, and it asks for no other hint
    # (its "Add type hints" warning on every save and load). A list of prompts is taken too.
    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> list[str]:
        from tasks.inputs import render_prompt
        from tasks.models import generate_completions

        params = params or {}
        if hasattr(model_input, "iloc"):  # a DataFrame: its first column holds the prompts
            prompts = [str(v) for v in model_input.iloc[:, 0]]
        else:
            prompts = [str(v) for v in (model_input if isinstance(model_input, list | tuple) else [model_input])]
        rendered = [
            render_prompt(self.tokenizer, [{"role": "user", "content": p}], self.system_prompt) for p in prompts
        ]
        temperature = float(params.get("temperature", 0.0))
        groups = generate_completions(
            self.model,
            self.tokenizer,
            rendered,
            greedy=temperature <= 0,
            temperature=max(temperature, 1e-5),
            max_new_tokens=int(params.get("max_new_tokens", 64)),
            precision=self.precision,
        )
        return [group[0] for group in groups]


mlflow.models.set_model(GrpoflowAdapterModel())
