"""Sampling defaults from the model's generation_config.json, applied as vLLM applies them: a
request field left unset takes the model's value, and only then the API's own default."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json keys -> SamplingParams fields: the six vLLM reads (it ignores do_sample too)
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model_folder: Path, source: str, override: dict[str, Any] | None) -> dict[str, Any]:
    """SamplingParams fields the model sets. `source`: "auto" reads the model folder's
    generation_config.json (if any), "vllm" reads nothing (the API's defaults, vLLM's name for
    that), anything else names a folder that must hold one. `override` wins key by key."""
    unknown = sorted(set(override or {}) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"override_generation_config: unknown key(s) {', '.join(unknown)}; "
                         f"expected some of {', '.join(SAMPLING_KEYS)}")
    config: dict[str, Any] = {}
    if source != "vllm":
        path = (model_folder if source == "auto" else Path(source).expanduser()) / "generation_config.json"
        if path.is_file():
            config = json.loads(path.read_text())
        elif source != "auto":
            raise ValueError(f"generation_config: {path} does not exist")
    config.update(override or {})
    return {field: config[key] for key, field in SAMPLING_KEYS.items() if config.get(key) is not None}
