"""The import layering (pyproject.toml's [tool.importlinter] contracts, docs/architecture.md): each
layer imports only the layers below it and no packages import each other in a circle, checked by
import-linter over the working tree; and every package and module of roseinfer sits in a layer, so
a new one cannot slip past the contract."""
from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import roseinfer

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="import-linter 2.17 needs Python 3.11")


def test_import_contracts_are_kept() -> None:
    # in a process of its own: lint_imports configures logging with disable_existing_loggers, which
    # would silence every logger this test session has created
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_every_top_level_module_is_in_a_layer() -> None:
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    [layers] = [c["layers"] for c in contracts if c["type"] == "layers"]
    listed = {name.strip() for layer in layers for part in layer.split("|") for name in part.split(":")}
    modules = {f"roseinfer.{m.name}" for m in pkgutil.iter_modules(roseinfer.__path__)}
    assert modules == listed
