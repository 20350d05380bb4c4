# Two commands on a fresh clone: `make serve` (the main job) and `make test`.
# Both create or reuse .venv: `make serve` (and `make install`) installs what serving needs, and
# `make test` adds the test extras on top (Triton, Ray, schemathesis...: a server needs none of them).
# torch is installed first, pinned, from PyTorch's CPU wheel index: on Linux a plain
# `pip install torch` brings the CUDA build and ~3 GB of CUDA libraries.
# `make install TORCH_INDEX_URL=` takes PyPI's default build instead (for --device cuda).
# torch alone comes from that index (--no-deps: its own dependencies come from PyPI with ours).
# Every package must come as a wheel (--only-binary): the install compiles nothing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.roseinfer-installed
TEST_STAMP := $(VENV)/.roseinfer-test-installed
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
TORCH_INSTALL = -m pip install -q --only-binary=:all: --no-deps torch==2.13.0 \
	$(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL))
CHECK_DIR ?= build/check-install

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) $(TORCH_INSTALL)
	$(PY) -m pip install -q --only-binary=:all: -e .
	$(PY) -c "from roseinfer.loader.default_model import default_model_path; default_model_path()"
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q --only-binary=:all: -e '.[test]'
	touch $(TEST_STAMP)

.PHONY: install serve generate test check-install
install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/roseinfer serve $(ARGS)

generate: $(STAMP)
	$(VENV)/bin/roseinfer generate "What is the capital of France?" $(ARGS)

# One pytest-xdist worker a core, each given whole test modules (their fixtures built once). Idle OpenMP
# threads sleep instead of spinning: one worker's spinning threads would hold the cores the other needs.
test: $(TEST_STAMP)
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n auto --dist loadscope $(ARGS)

# What `pip install roseinfer` does on a new machine: the built wheel into an empty venv with no
# pip cache, torch first as above; fails if any package would have to be built from source.
# --no-compile: pip's byte-compiling of the installed .py files is not what this checks, and is half its time.
check-install:
	# setuptools builds in ./build: files an older tree left there would go into the wheel
	rm -rf $(CHECK_DIR) build/lib build/bdist.*
	python3 -m pip wheel -q --no-cache-dir --no-deps -w $(CHECK_DIR)/dist .
	python3 -m venv $(CHECK_DIR)/venv
	$(CHECK_DIR)/venv/bin/python $(TORCH_INSTALL) --no-cache-dir --no-compile
	$(CHECK_DIR)/venv/bin/python -m pip install -q --no-cache-dir --no-compile --only-binary=:all: $(CHECK_DIR)/dist/*.whl
