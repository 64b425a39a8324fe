"""One node, one recipe: `sisrl-train node` starts the retriever, the vLLM servers, the gateway and the trainer of a
config on one machine's GPUs (docs/guides/gpu.md), with the flags each needs and the gateway's limits derived from
the trainer config.

The GPU split is given as lists (`--trainer-gpus 0-3 --vllm-gpus 4-7 --retriever-gpus 4-7`): the trainer's GPUs
may not overlap vLLM's or the retriever's (each would take the other's memory); the retriever may share vLLM's
GPUs (it loads first, and vLLM sizes its KV cache from what is left). `--print` writes the commands as a shell
script and starts nothing; the docs show that script, and a test keeps the two equal. `--vllm-python` runs vLLM's
CPU build from its own venv instead (`tests/vllm`'s miniature of this topology).

The gateway's budgets follow from the config, so a trajectory the config allows is never cut by the gateway:
`--max-response-tokens` = max_turns x max_new_tokens + (max_turns - 1) x observation_max_tokens (sampled and
inserted tokens), and `--max-concurrency` = one step's trajectories (up to the gateway's cap). `check_gateway`
refuses a run against a gateway whose budget is smaller.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sisrl.common.vllm_cpu import WORKER_EXTENSION, server_command, server_env, sisrl_path
from sisrl.trainer.config import ConfigError, TrainConfig, load_config

OBSERVATION_MAX_TOKENS = 512  # the gateway's default token budget of one <information> block
PROMPT_ALLOWANCE = 1024  # tokens of instructions and question that vLLM's context must hold besides the response
MAX_CONCURRENCY = 4096  # the gateway's cap (services/settings.py)
RETRIEVER_PORT = 8000  # --base-port: the retriever's, the vLLM servers' on the ports after it


def response_budget(max_turns: int, max_new_tokens: int, observation_max_tokens: int) -> int:
    """Sampled plus inserted tokens of the longest trajectory the config allows: every generation at its limit
    and an observation after each but the last."""
    return max_turns * max_new_tokens + (max_turns - 1) * observation_max_tokens


def gateway_limits(cfg: TrainConfig, observation_max_tokens: int = OBSERVATION_MAX_TOKENS) -> dict[str, int]:
    """The gateway flags that `cfg` needs: its response budget and one step's trajectories generating at once."""
    r = cfg.rollout
    obs = r.observation_max_tokens or observation_max_tokens  # the config's own budget wins (sent per request)
    return {"max_response_tokens": response_budget(r.max_turns, r.max_new_tokens, obs),
            "max_concurrency": min(MAX_CONCURRENCY, r.prompts_per_step * r.samples_per_prompt)}


def check_gateway(cfg: TrainConfig, rollout: dict[str, Any] | None) -> None:
    """Refuse a run whose trajectories the gateway would truncate: `rollout` is the gateway's /health `rollout`
    field (None from a gateway that reports none: nothing to check)."""
    if not rollout or "max_response_tokens" not in rollout:
        return
    obs = cfg.rollout.observation_max_tokens or int(rollout.get("observation_max_tokens", OBSERVATION_MAX_TOKENS))
    need = response_budget(cfg.rollout.max_turns, cfg.rollout.max_new_tokens, obs)
    have = int(rollout["max_response_tokens"])
    if have < need:
        raise ConfigError(
            f"the gateway at {cfg.rollout.gateway_url} has max_response_tokens {have}, below the {need} this config "
            f"needs (rollout.max_turns {cfg.rollout.max_turns} x max_new_tokens {cfg.rollout.max_new_tokens} + "
            f"{cfg.rollout.max_turns - 1} observations x {obs}): restart it with --max-response-tokens {need}, or "
            f"lower rollout.max_turns / max_new_tokens")


def parse_gpus(text: str, what: str) -> list[int]:
    """`0-3`, `4,5,6,7`, `0-1,6` -> GPU indices; `cpu` or empty -> []. One line naming the bad value."""
    if text.strip().lower() in ("", "cpu", "none"):
        return []
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ConfigError(f"{what}: expected GPU indices like 0-3 or 4,5,6,7, got {text!r}") from None
    if len(set(out)) != len(out) or any(g < 0 for g in out):
        raise ConfigError(f"{what}: each GPU once and >= 0, got {text!r}")
    return out


@dataclass
class Proc:
    """One process of the node: its name, command, extra environment and the URL that answers when it is up."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    health: str | None = None  # None: the foreground process (the trainer)


@dataclass
class NodeArgs:
    config: Path
    model: str
    index: str
    trainer_gpus: list[int]
    vllm_gpus: list[int]
    retriever_gpus: list[int]
    overrides: list[str] = field(default_factory=list)
    observation_max_tokens: int = OBSERVATION_MAX_TOKENS
    gpu_memory_utilization: float = 0.8
    db_url: str | None = None
    vllm_python: str | None = None  # vLLM's CPU build from this interpreter (the miniature); None: `vllm serve`
    cpu_servers: int = 1  # with --vllm-python: how many CPU vLLM servers
    cpu_ranks: int = 2  # trainer processes where --trainer-gpus is cpu (FSDP2 on gloo)
    base_port: int = RETRIEVER_PORT  # the retriever's; vLLM servers on the ports after it


def plan(a: NodeArgs) -> tuple[TrainConfig, list[Proc]]:
    """The node's processes in start order (retriever, vLLM servers, gateway, trainer), after every check that
    needs no GPU: overlapping GPU lists, a config that does not load, a vLLM context too short."""
    overlap = sorted(set(a.trainer_gpus) & (set(a.vllm_gpus) | set(a.retriever_gpus)))
    if overlap:
        raise ConfigError(f"--trainer-gpus shares GPU(s) {overlap} with --vllm-gpus / --retriever-gpus: the trainer "
                          f"needs its GPUs to itself (the retriever may share vLLM's)")
    cpu = a.vllm_python is not None
    if not cpu and not a.vllm_gpus:
        raise ConfigError("--vllm-gpus: at least one GPU for the vLLM servers (or --vllm-python for vLLM's CPU build)")
    overrides = [*a.overrides, f"model.path={a.model}"]
    cfg = load_config(a.config, overrides)
    gateway = urllib.parse.urlsplit(cfg.rollout.gateway_url)
    if gateway.hostname not in ("127.0.0.1", "localhost") or gateway.port is None:
        raise ConfigError(f"rollout.gateway_url: the node starts its gateway on 127.0.0.1 and an explicit port, got "
                          f"{cfg.rollout.gateway_url!r}")
    limits = gateway_limits(cfg, a.observation_max_tokens)
    context = -(-(limits["max_response_tokens"] + PROMPT_ALLOWANCE) // 1024) * 1024
    k = str(cfg.algorithm.logprobs_k)
    procs: list[Proc] = []

    def on(gpus: list[int]) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if gpus else {}

    retriever = ["sisrl-retriever", "serve", "--index", a.index, "--port", str(a.base_port)]
    if a.retriever_gpus:
        retriever += ["--device", "cuda", "--faiss-gpu"]
    procs.append(Proc("retriever", retriever, on(a.retriever_gpus), f"http://127.0.0.1:{a.base_port}/health"))
    ports = [a.base_port + 1 + i for i in range(a.cpu_servers if cpu else len(a.vllm_gpus))]
    for i, port in enumerate(ports):
        if cpu:
            python = Path(str(a.vllm_python))
            argv = server_command(python, a.model, port=port, served_model_name=a.model, max_model_len=context,
                                  max_logprobs=int(k), seed=cfg.seed)
            env = server_env(python.parent.parent, sisrl_path=sisrl_path())
        else:
            argv = ["vllm", "serve", a.model, "--served-model-name", a.model, "--port", str(port),
                    "--dtype", "bfloat16", "--max-model-len", str(context),
                    "--gpu-memory-utilization", str(a.gpu_memory_utilization),
                    "--logprobs-mode", "processed_logprobs", "--max-logprobs", k, "--generation-config", "vllm",
                    "--worker-extension-cls", WORKER_EXTENSION]
            env = {**on([a.vllm_gpus[i]]), "VLLM_SERVER_DEV_MODE": "1"}
        procs.append(Proc(f"vllm-{i}", argv, env, f"http://127.0.0.1:{port}/health"))
    run_dir = Path(cfg.run_dir)
    gw = ["sisrl-gateway", "serve", "--engine", "vllm-http", "--model", a.model,
          "--engine-url", ",".join(f"http://127.0.0.1:{p}" for p in ports),
          "--engine-weights-route", "/collective_rpc", "--engine-after-weights-routes", "/reset_prefix_cache",
          "--retriever-url", f"http://127.0.0.1:{a.base_port}",
          "--db-url", a.db_url or f"sqlite:///{run_dir}/gateway.db",
          "--checkpoint-root", str(run_dir.parent),  # relative: every process starts in one working directory
          "--observation-max-tokens", str(a.observation_max_tokens),
          "--max-concurrency", str(limits["max_concurrency"]),
          "--max-response-tokens", str(limits["max_response_tokens"]), "--port", str(gateway.port)]
    procs.append(Proc("gateway", gw, {}, f"http://127.0.0.1:{gateway.port}/health"))
    n = len(a.trainer_gpus) or a.cpu_ranks
    trainer = ["torchrun", "--nproc-per-node", str(n), "-m", "sisrl.trainer.cli", "train", "--config", str(a.config),
               *[w for o in overrides for w in ("--set", o)]]
    procs.append(Proc("trainer", trainer, on(a.trainer_gpus)))
    return cfg, procs


def render(procs: list[Proc], width: int = 110) -> str:
    """The processes as a shell script: servers in the background, the trainer in the foreground; each command
    wrapped before `width` columns at an option (`\\` continuations), as the docs print it."""
    out = []
    for p in procs:
        words = [f"{k}={shlex.quote(v)}" for k, v in p.env.items()] + [shlex.quote(w) for w in p.argv]
        words += ["&"] if p.health else []
        lines, line = [], ""
        for i, w in enumerate(words):
            # an option starts a new piece with its value; a line breaks only before an option
            glue = " " if line else ""
            if w.startswith("--") and line and len(line) + 1 + len(w) + 1 + len(words[i + 1] if i + 1 < len(words)
                                                                              else "") > width:
                lines.append(line + " \\")
                line, glue = "    ", ""
            line += glue + w
        out.append("\n".join([*lines, line]))
    return "\n".join(out) + "\n"


def _up(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _say(message: str) -> None:
    sys.stderr.write(f"{message}\n")


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _program(argv: list[str]) -> list[str]:
    """`argv` with its program taken from this interpreter's venv where it lies there (torchrun, sisrl-*, vllm):
    the launcher may run as `.venv/bin/sisrl-train` with the venv not on PATH."""
    if "/" in argv[0]:  # a path already (vLLM's interpreter)
        return argv
    local = Path(sys.executable).with_name(argv[0])
    return [str(local), *argv[1:]] if local.is_file() else argv


def launch(procs: list[Proc], logs: Path, *, ready_timeout_s: float = 1800.0) -> int:
    """Start each server in order and wait for its health URL, then run the trainer in the foreground; stop the
    servers when it ends (or on Ctrl-C / SIGTERM). Each server logs to `logs/<name>.log`. Returns the trainer's
    exit status, or 1 when a server exits or does not answer in time (its log named)."""
    logs.mkdir(parents=True, exist_ok=True)
    started: list[tuple[Proc, subprocess.Popen[bytes]]] = []

    def stop() -> None:
        for _proc, child in reversed(started):
            if child.poll() is None:
                child.terminate()
        for _proc, child in reversed(started):
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()

    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for p in procs:
            env = {**os.environ, **p.env}
            if p.health is None:
                _say(f"node: {p.name}: {render([p]).strip()}")
                return subprocess.call(_program(p.argv), env=env)
            log = logs / f"{p.name}.log"
            with log.open("ab") as out:
                child = subprocess.Popen(_program(p.argv), env=env, stdout=out, stderr=subprocess.STDOUT)
            started.append((p, child))
            deadline = time.monotonic() + ready_timeout_s
            while not _up(p.health):
                if child.poll() is not None:
                    _say(f"node: {p.name} exited with {child.returncode} before answering {p.health}; see {log}")
                    return 1
                if time.monotonic() > deadline:
                    _say(f"node: {p.name} did not answer {p.health} in {ready_timeout_s:.0f} s; see {log}")
                    return 1
                time.sleep(1.0)
            _say(f"node: {p.name} up ({p.health}), log {log}")
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop()


def add_arguments(n: argparse.ArgumentParser) -> None:
    n.add_argument("--config", type=Path, required=True, help="the trainer's YAML config")
    n.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config knob, passed to the trainer too (repeatable)")
    n.add_argument("--model", required=True, help="local model directory: vLLM's weights, the gateway's tokenizer "
                   "and the trainer's model.path")
    n.add_argument("--index", required=True, help="the retriever's index directory (sisrl-retriever build / import)")
    n.add_argument("--trainer-gpus", default="0-3", help="GPUs of the trainer (FSDP2, one rank each)")
    n.add_argument("--vllm-gpus", default="4-7", help="GPUs of the vLLM servers, one server each")
    n.add_argument("--retriever-gpus", default="4-7",
                   help="GPUs the retriever shards its index over (may be vLLM's; 'cpu' = on the CPUs)")
    n.add_argument("--observation-max-tokens", type=int, default=OBSERVATION_MAX_TOKENS,
                   help="the gateway's token budget of one observation (enters the response budget)")
    n.add_argument("--gpu-memory-utilization", type=float, default=0.8, help="vLLM's share of each of its GPUs")
    n.add_argument("--db-url", default=None, help="the gateway's store (default: sqlite in RUN_DIR/gateway.db)")
    n.add_argument("--vllm-python", default=None,
                   help="run vLLM's CPU build with this interpreter (its venv) instead of `vllm serve` on GPUs")
    n.add_argument("--cpu-servers", type=int, default=1, help="with --vllm-python: CPU vLLM servers to start")
    n.add_argument("--cpu-ranks", type=int, default=2, help="trainer processes where --trainer-gpus is cpu")
    n.add_argument("--base-port", type=int, default=RETRIEVER_PORT,
                   help="the retriever's port; the vLLM servers take the ports after it (the gateway's is the config's)")
    n.add_argument("--print", dest="print_only", action="store_true",
                   help="print the commands as a shell script; start nothing")


def main(args: argparse.Namespace) -> int:
    a = NodeArgs(config=args.config, model=args.model, index=args.index,
                 trainer_gpus=parse_gpus(args.trainer_gpus, "--trainer-gpus"),
                 vllm_gpus=parse_gpus(args.vllm_gpus, "--vllm-gpus") if args.vllm_python is None else [],
                 retriever_gpus=parse_gpus(args.retriever_gpus, "--retriever-gpus"), overrides=args.overrides,
                 observation_max_tokens=args.observation_max_tokens,
                 gpu_memory_utilization=args.gpu_memory_utilization, db_url=args.db_url,
                 vllm_python=args.vllm_python, cpu_servers=args.cpu_servers, cpu_ranks=args.cpu_ranks,
                 base_port=args.base_port)
    cfg, procs = plan(a)
    if args.print_only:
        sys.stdout.write(render(procs))
        return 0
    return launch(procs, Path(cfg.run_dir) / "logs")
