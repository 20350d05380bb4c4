# Two commands on a fresh clone: `make serve` (the main job) and `make test`.
# Both create or reuse .venv. torch is installed first, pinned, from PyTorch's CPU wheel index:
# on Linux a plain `pip install torch` brings the CUDA build and ~3 GB of CUDA libraries.
# `make install TORCH_INDEX_URL=` takes PyPI's default build instead (for --device cuda).
# Every other package must come as a wheel (--only-binary): the install compiles nothing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.roseinfer-installed
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --only-binary=:all: torch==2.13.0 \
		$(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install -q --only-binary=:all: -e '.[test]'
	$(PY) -c "from roseinfer.loader.default_model import default_model_path; default_model_path()"
	touch $(STAMP)

.PHONY: install serve generate test
install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/roseinfer serve $(ARGS)

generate: $(STAMP)
	$(VENV)/bin/roseinfer generate "What is the capital of France?" $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)
