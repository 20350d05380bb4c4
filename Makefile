# Two commands on a fresh clone: `make serve` (the main job) and `make test`.
# Both create or reuse .venv. torch is installed first, pinned to the local CPU wheel,
# so that no later requirement can pull the CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.roseinfer-installed

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

.PHONY: install serve generate test
install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/roseinfer serve $(ARGS)

generate: $(STAMP)
	$(VENV)/bin/roseinfer generate "What is the capital of France?" $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)
