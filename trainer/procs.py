"""Start the retriever and the gateway as real processes on loopback (the demo and the end-to-end loop test).

The process mechanics (free port, launch, wait for health, stop, SIGTERM as Ctrl-C) live in
`sisrl.common.procs` and are re-exported here; this module only knows the two services' command lines.
"""

from __future__ import annotations

from pathlib import Path

from sisrl.common.procs import Service, free_port, launch_module, sigterm_as_interrupt, wait_healthy

__all__ = ["Service", "free_port", "launch_gateway", "launch_retriever", "sigterm_as_interrupt", "wait_healthy"]


def launch_retriever(*, index_dir: Path, corpus: Path, encoder: str, log: Path, port: int | None = None) -> Service:
    """`sisrl-retriever serve`; builds an exact index from `corpus` first when `index_dir` holds none."""
    port = port or free_port()
    args = ["serve", "--index", str(index_dir), "--corpus", str(corpus), "--encoder", encoder,
            "--port", str(port), "--log-level", "warning"]
    return launch_module("retriever", "sisrl.retriever.cli", args, port=port, log=log)


def launch_gateway(*, model: str, retriever_url: str, db: Path, checkpoint_root: Path, log: Path,
                  port: int | None = None, extra: list[str] | None = None, script: Path | None = None) -> Service:
    """`sisrl-gateway serve --engine local` (or `--engine scripted --script SCRIPT`, the tokenizer from `model`);
    POST /v1/policy accepts directories under `checkpoint_root`."""
    port = port or free_port()
    engine = ["--engine", "local"] if script is None else ["--engine", "scripted", "--script", str(script)]
    args = ["serve", *engine, "--model", model, "--retriever-url", retriever_url,
            "--db-url", f"sqlite:///{db}", "--checkpoint-root", str(checkpoint_root), "--port", str(port),
            "--log-level", "warning", *(extra or [])]
    return launch_module("gateway", "sisrl.services.cli", args, port=port, log=log)
