"""`sisrl-train node`: the one-node launcher's plan for the GPU recipe (the gateway's limits from the config, one
vLLM server per GPU, the trainer's ranks), its refusals (overlapping GPUs, bad lists), the gateway-budget check,
and the docs' copy of its script (docs/guides/gpu.md), kept equal to what it prints."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from sisrl.trainer.cli import main as cli_main
from sisrl.trainer.config import ConfigError, load_config
from sisrl.trainer.node import NodeArgs, check_gateway, gateway_limits, parse_gpus, plan, response_budget

ROOT = Path(__file__).resolve().parents[2]
GPU_CONFIG = ROOT / "trainer" / "configs" / "nq_hotpotqa_qwen3b_gpu.yaml"
PAGE = ROOT / "docs" / "guides" / "gpu.md"


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_gpu_recipe_plan() -> None:
    cfg, procs = plan(NodeArgs(config=GPU_CONFIG, model="/models/Qwen2.5-3B", index="idx", trainer_gpus=[0, 1, 2, 3],
                               vllm_gpus=[4, 5, 6, 7], retriever_gpus=[4, 5, 6, 7]))
    assert [p.name for p in procs] == ["retriever", "vllm-0", "vllm-1", "vllm-2", "vllm-3", "gateway", "trainer"]
    r = cfg.rollout
    need = r.max_turns * r.max_new_tokens + (r.max_turns - 1) * 512
    assert need == 4548  # 5 generations of 500 and 4 observations of 512: the default 2048 would cut them
    gateway = procs[5].argv
    assert int(_flag(gateway, "--max-response-tokens")) == need
    assert int(_flag(gateway, "--max-concurrency")) == r.prompts_per_step * r.samples_per_prompt == 2560
    assert _flag(gateway, "--engine-url").split(",") == [f"http://127.0.0.1:{8001 + i}" for i in range(4)]
    for i, p in enumerate(procs[1:5]):
        assert p.env["CUDA_VISIBLE_DEVICES"] == str(4 + i) and p.env["VLLM_SERVER_DEV_MODE"] == "1"
        assert int(_flag(p.argv, "--max-model-len")) >= need + 512  # the prompt and the whole response
        assert _flag(p.argv, "--logprobs-mode") == "processed_logprobs"
        assert int(_flag(p.argv, "--max-logprobs")) >= cfg.algorithm.logprobs_k
    trainer = procs[-1]
    assert trainer.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and _flag(trainer.argv, "--nproc-per-node") == "4"
    assert "model.path=/models/Qwen2.5-3B" in trainer.argv and trainer.health is None


@pytest.mark.parametrize(("flags", "message"), [
    (["--trainer-gpus", "0-4"], "--trainer-gpus shares GPU(s) [4]"),
    (["--retriever-gpus", "3"], "--trainer-gpus shares GPU(s) [3]"),
    (["--vllm-gpus", "4-x"], "--vllm-gpus: expected GPU indices like 0-3"),
    (["--vllm-gpus", "4,4"], "--vllm-gpus: each GPU once"),
    (["--vllm-gpus", "cpu", "--retriever-gpus", "cpu"], "--vllm-gpus: at least one GPU"),
])
def test_a_bad_split_is_refused_in_one_line(flags: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path) -> None:
    argv = ["node", "--config", str(GPU_CONFIG), "--model", "/m", "--index", "i", "--print", *flags]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_parse_gpus() -> None:
    assert parse_gpus("0-3", "x") == [0, 1, 2, 3]
    assert parse_gpus("0-1,6", "x") == [0, 1, 6]
    assert parse_gpus("cpu", "x") == []


def test_a_gateway_that_would_truncate_is_refused() -> None:
    cfg = load_config(GPU_CONFIG)
    with pytest.raises(ConfigError, match=r"max_response_tokens 2048, below the 4548 .* --max-response-tokens 4548"):
        check_gateway(cfg, {"max_response_tokens": 2048, "observation_max_tokens": 512})
    check_gateway(cfg, {"max_response_tokens": 4548, "observation_max_tokens": 512})
    check_gateway(cfg, {"max_response_tokens": 2540, "observation_max_tokens": 10})  # its own observation budget
    check_gateway(cfg, None)  # a gateway that reports nothing: nothing to compare
    assert gateway_limits(cfg, 100)["max_response_tokens"] == response_budget(5, 500, 100) == 2900


def test_the_docs_print_the_launchers_script(capsys: pytest.CaptureFixture[str]) -> None:
    text = PAGE.read_text(encoding="utf-8")
    documented = re.search(r"<!-- node:begin -->\n```bash\n(.*?)```\n<!-- node:end -->", text, re.S)
    assert documented, "docs/guides/gpu.md lost its node script block"
    command = re.search(r"```bash\n(sisrl-train node .*?)\n```", text, re.S)
    assert command, "docs/guides/gpu.md lost its `sisrl-train node` command"
    words = shlex.split(command.group(1).replace("\\\n", " "))
    assert cli_main([*words[1:], "--print"]) == 0
    assert capsys.readouterr().out == documented.group(1)  # rerun the command above with --print to refresh
