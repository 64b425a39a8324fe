"""tests/vllm runs only through `make test-vllm` (tests/vllm/run.py), which builds the vLLM venv and names its
interpreter in SISRL_VLLM_PYTHON; plain `make test` / `pytest` collects nothing here."""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("SISRL_VLLM_PYTHON") else ["test_*.py"]
