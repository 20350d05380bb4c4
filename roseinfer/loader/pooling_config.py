"""An embedding checkpoint's pooling, from its sentence-transformers files when it has them: the
Pooling module's mode (1_Pooling/config.json) and whether a Normalize module follows (modules.json),
as sentence-transformers runs it. Without them: last-token pooling, normalized (vLLM's default for a
decoder LM run as an embedding model)."""
from __future__ import annotations

import json
from pathlib import Path

from roseinfer.pooling_params import PoolingParams

ST_PACKAGE = "sentence_transformers.models."
# sentence-transformers' pooling_mode_* flags -> PoolingParams.pooling
POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def pooling_defaults(model_folder: str | Path) -> PoolingParams:
    """The checkpoint's pooling; a ValueError for a sentence-transformers mode roseinfer lacks (max, ...)."""
    modules_file = Path(model_folder) / "modules.json"
    if not modules_file.is_file():
        return PoolingParams()
    modules = {m.get("type", "").removeprefix(ST_PACKAGE): m.get("path", "") for m in json.loads(modules_file.read_text())}
    if "Pooling" not in modules:
        return PoolingParams(normalize="Normalize" in modules)
    config = json.loads((Path(model_folder) / modules["Pooling"] / "config.json").read_text())
    chosen = [mode for key, mode in POOLING_MODES.items() if config.get(key)]
    others = sorted(key for key, on in config.items() if key.startswith("pooling_mode_") and on
                    and key not in POOLING_MODES)
    if others or len(chosen) != 1:
        raise ValueError(f"the checkpoint's sentence-transformers pooling ({', '.join(others + chosen) or 'none'}) "
                         f"is not one roseinfer has (one of {', '.join(POOLING_MODES)})")
    return PoolingParams(pooling=chosen[0], normalize="Normalize" in modules)
