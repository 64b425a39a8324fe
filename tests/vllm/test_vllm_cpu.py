"""Real vLLM (PyPI's CPU build) behind sisrl's engines: one vLLM OpenAI server on loopback for the module,
started with the flags docs/engines.md prescribes and sisrl's worker extension, serving SmolLM2-135M-Instruct
(the project's offline conversion) in float32.

Checks: the engine contract of `VLLMHttpEngine` against a fresh fp32 transformers forward (tolerances below);
a gateway batch through it with real searches on a real retriever; a weight update through the gateway's
`POST /v1/policy`, also one that lands while a batch runs (partial), and one of the trainer's sharded bf16
pushes (`trainer/push.py`) read shard by shard; bad checkpoints refused with the server still serving the old weights; the in-process engine
(`VLLMEngine`, run in the vLLM venv) generating and loading weights. Runs only through `make test-vllm`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from sisrl.common.models import SMOLLM2, build_tiny_policy, cast_parameters, load_tokenizer, smollm2_dir
from sisrl.common.procs import Service, free_port, launch, launch_module, log_tail, wait_healthy
from sisrl.common.vllm_cpu import server_command, server_env
from sisrl.services.engines.base import MIN_LOGPROB, Generation, SamplingParams
from sisrl.services.engines.vllm_http import VLLMHttpEngine
from sisrl.trainer.push import write_push
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.services.conftest import nq_item, qa_subset, retriever_url  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(900)  # the first test also waits for the server (1-2 minutes on 2 cores)

K = 20
# Max |log q| difference against the fp32 transformers forward: different kernels on the same float32 weights
# put the sampled and the top-K log q up to ~6e-5 apart.
LOGPROB_TOL = 2e-4
VLLM_PYTHON = Path(os.environ.get("SISRL_VLLM_PYTHON", "python"))  # set by tests/vllm/run.py
VENV = VLLM_PYTHON.parents[1]
SISRL_PATH = os.environ.get("SISRL_VLLM_PYTHONPATH", "")
STARTUP_S = 600.0
QUESTION = "Who wrote the novel Dracula?"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer()


@pytest.fixture(scope="module")
def reference() -> PreTrainedModel:
    """The same weights in fp32 transformers: the reference of every log-prob the server reports."""
    torch.set_num_threads(1)  # 2 shared cores (see tests/services/conftest.py, one_torch_thread)
    return AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()


@dataclass(frozen=True)
class Checkpoints:
    root: Path
    original: Path  # the served weights (hard links of the cached conversion)
    perturbed: Path  # every tensor + 2% Gaussian noise of its own scale: different outputs, still a language model
    corrupt: Path  # a .safetensors file that is not one
    wrong_shape: Path  # the tiny test Llama: SmolLM2's names, other shapes
    pushed_bf16: Path  # the perturbed weights as the trainer pushes them: bf16 shards of 32 MiB and their index


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Checkpoints:
    root = tmp_path_factory.mktemp("checkpoints")
    source = smollm2_dir()
    original = root / "original"
    original.mkdir()
    for file in source.iterdir():
        try:
            os.link(file, original / file.name)
        except OSError:  # another file system
            shutil.copyfile(file, original / file.name)
    generator = torch.Generator().manual_seed(0)
    state = load_file(str(source / "model.safetensors"))
    noisy = {n: t + 0.02 * t.float().std() * torch.randn(t.shape, generator=generator) for n, t in state.items()}
    perturbed = root / "perturbed"
    perturbed.mkdir()
    save_file({n: t.contiguous() for n, t in noisy.items()}, str(perturbed / "model.safetensors"))
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a safetensors header")
    wrong_shape = root / "wrong_shape"
    build_tiny_policy(tokenizer, seed=0).save_pretrained(wrong_shape, safe_serialization=True)
    write_push(perturbed_model(perturbed), tokenizer, root / "pushed_bf16", dtype=torch.bfloat16,
               max_shard_bytes=32 << 20)
    return Checkpoints(root, original, perturbed, corrupt, wrong_shape, root / "pushed_bf16")


def perturbed_model(perturbed: Path) -> PreTrainedModel:
    """SmolLM2 in fp32 with the perturbed checkpoint's weights (its head tied to the embedding again)."""
    noisy = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    noisy.load_state_dict(load_file(str(perturbed / "model.safetensors")), strict=False)
    noisy.tie_weights()
    return noisy


@pytest.fixture(scope="module")
def prompt(tokenizer: Any) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)
    return [int(t) for t in out["input_ids"]]


@dataclass(frozen=True)
class InProc:
    process: subprocess.Popen[str]  # tests/vllm/inproc_check.py in the vLLM venv; its stdout is the result
    stderr: Path


@pytest.fixture(scope="module")
def inproc(checkpoints: Checkpoints, prompt: list[int], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[InProc]:
    """The in-process engine check, started first: its model load overlaps the server's."""
    log = tmp_path_factory.mktemp("inproc") / "stderr.log"
    env = {**os.environ, **server_env(VENV, kv_cache_gib=1, sisrl_path=SISRL_PATH)}
    script = Path(__file__).with_name("inproc_check.py")
    with log.open("w") as err:
        process = subprocess.Popen([str(VLLM_PYTHON), str(script), str(checkpoints.original),
                                    str(checkpoints.perturbed), str(checkpoints.wrong_shape), json.dumps(prompt)],
                                   stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    yield InProc(process, log)
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def vllm_server(inproc: InProc, checkpoints: Checkpoints,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """`python -m vllm.entrypoints.openai.api_server` as docs/engines.md prescribes (the `vllm` console script of
    vllm-cpu fails with PackageNotFoundError), over the original checkpoint, served as `smollm2-135m-instruct`."""
    port = free_port()
    command = server_command(VLLM_PYTHON, str(checkpoints.original), port=port, served_model_name=SMOLLM2,
                             max_logprobs=K)
    env = server_env(VENV, sisrl_path=SISRL_PATH)
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    start = time.perf_counter()
    service = launch("vllm", command, url=f"http://127.0.0.1:{port}", log=log, env=env)
    wait_healthy(service, timeout_s=STARTUP_S)
    print(f"\nvLLM server healthy after {time.perf_counter() - start:.0f}s")
    yield service
    service.stop()


def engine_for(server: Service, **kwargs: Any) -> VLLMHttpEngine:
    return VLLMHttpEngine(server.url, model=SMOLLM2, retries=0, weights_route="/collective_rpc",
                          after_weights_routes=("/reset_prefix_cache",), **kwargs)


def generate_all(server: Service, prompts: list[list[int]], params: list[SamplingParams]) -> list[Generation]:
    """All requests at once (one vLLM batch), through the engine under test."""
    async def run() -> list[Generation]:
        engine = engine_for(server)
        try:
            return list(await asyncio.gather(*[engine.generate(p, s) for p, s in zip(prompts, params, strict=True)]))
        finally:
            await engine.close()

    return asyncio.run(run())


@torch.no_grad()
def reference_logq(model: PreTrainedModel, prompt: list[int], tokens: list[int], params: SamplingParams
                   ) -> torch.Tensor:
    """[T, V] log q at each generated position: the fp32 forward, logits / temperature, then top-p (vLLM keeps a
    token unless the ascending cumulative probability up to it is <= 1 - top_p). Greedy: temperature 1, no top-p."""
    ids = torch.tensor([prompt + tokens])
    logits = model(ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(tokens)].float()  # [T, V]
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / params.temperature
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1)  # ascending
        removed = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - params.top_p
        removed[:, -1] = False
        logits = logits.masked_fill(removed.scatter(1, order, removed), float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def check_against_reference(gen: Generation, logq: torch.Tensor) -> dict[str, float]:
    """Sampled and top-K log-probs vs the reference; K by rank; the sampled token in top-K iff its rank <= K."""
    sampled_diff, topk_diff, outside = 0.0, 0.0, 0
    for t, (token, lp, ids, lps) in enumerate(zip(gen.token_ids, gen.logprobs, gen.topk_ids, gen.topk_logprobs,
                                                   strict=True)):
        row = logq[t]
        sampled_diff = max(sampled_diff, abs(lp - float(row[token])))
        assert len(ids) == len(set(ids)) == K and lps == sorted(lps, reverse=True), t
        inside = [(i, v) for i, v in zip(ids, lps, strict=True) if v > MIN_LOGPROB]  # -9999: outside the nucleus
        for i, v in inside:
            topk_diff = max(topk_diff, abs(v - float(row[i])))
        support = int(torch.isfinite(row).sum())
        assert len(inside) == min(K, support), (t, len(inside), support)
        # The sampled token's rank under the reference, bounded both ways: a near-tie (within the tolerance)
        # may order either way, so only a clear rank decides.
        best_rank = 1 + int((row > row[token] + LOGPROB_TOL).sum())
        worst_rank = int((row > row[token] - LOGPROB_TOL).sum())  # itself, and everything within the tolerance
        if worst_rank <= K:
            assert token in ids, (t, worst_rank)
        if best_rank > K:
            assert token not in ids, (t, best_rank)
            outside += 1
    assert sampled_diff <= LOGPROB_TOL and topk_diff <= LOGPROB_TOL, (sampled_diff, topk_diff)
    return {"sampled": sampled_diff, "topk": topk_diff, "outside": outside}


def test_engine_contract_against_fp32_transformers(vllm_server: Service, reference: PreTrainedModel,
                                                   tokenizer: Any, prompt: list[int]) -> None:
    free = generate_all(vllm_server, [prompt], [SamplingParams(max_new_tokens=48, temperature=0.0, stop=(),
                                                               logprobs_k=K)])[0]
    stop = tokenizer.decode(free.token_ids[3:5])  # a stop string the greedy continuation reaches
    cases = [
        SamplingParams(max_new_tokens=24, temperature=1.0, seed=1, logprobs_k=K, stop=()),
        SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.9, seed=2, logprobs_k=K, stop=()),
        SamplingParams(max_new_tokens=24, temperature=1.5, seed=3, logprobs_k=K, stop=()),
        SamplingParams(max_new_tokens=48, temperature=0.0, logprobs_k=K, stop=(stop,)),
        SamplingParams(max_new_tokens=200, temperature=0.0, logprobs_k=K, stop=()),
    ]
    gens = generate_all(vllm_server, [prompt] * len(cases), cases)
    assert [g.finish_reason for g in gens] == ["length", "length", "length", "stop", "eos"]
    assert all(len(g.token_ids) == 24 for g in gens[:3])
    assert stop in tokenizer.decode(gens[3].token_ids) and gens[3].token_ids == free.token_ids[:len(gens[3].token_ids)]
    assert gens[4].token_ids[:48] == free.token_ids and gens[4].token_ids[-1] == tokenizer.eos_token_id
    stats = [check_against_reference(g, reference_logq(reference, prompt, g.token_ids, p))
             for g, p in zip(gens, cases, strict=True)]
    print("\nmax |log q - reference|:", stats)
    assert stats[2]["outside"] > 0, "at temperature 1.5 some sampled token ranks below K (the K + 1 wire case)"
    # Same seed, same output: alone now, batched with four others above.
    again = generate_all(vllm_server, [prompt], [cases[0]])[0]
    assert again.token_ids == gens[0].token_ids
    # Alone vs in a batch of five: fp32 kernels may split the work by batch shape (measured: 3.4e-5 on an AMD EPYC
    # Zen 4 with AVX-512, under 1e-5 on an AVX2-only one); the same tokens, log-probs within half of LOGPROB_TOL.
    assert max(abs(a - b) for a, b in zip(again.logprobs, gens[0].logprobs, strict=True)) <= LOGPROB_TOL / 2


def test_wire_sends_k_plus_one_exactly_when_the_sampled_token_ranks_below_k(vllm_server: Service,
                                                                            prompt: list[int]) -> None:
    body = {"model": SMOLLM2, "prompt": prompt, "max_tokens": 24, "temperature": 1.5, "seed": 3, "logprobs": K,
            "return_tokens_as_token_ids": True, "return_token_ids": True, "top_k": -1, "min_p": 0.0}
    choice = httpx.post(f"{vllm_server.url}/v1/completions", json=body, timeout=120).raise_for_status().json()
    choice = choice["choices"][0]
    sizes = []
    for token, lp, top in zip(choice["token_ids"], choice["logprobs"]["token_logprobs"],
                              choice["logprobs"]["top_logprobs"], strict=True):
        better = sum(v > lp for k, v in top.items() if k != f"token_id:{token}")
        assert len(top) == (K + 1 if better >= K else K), (token, better, len(top))
        sizes.append(len(top))
    assert set(sizes) == {K, K + 1}


def start_gateway(vllm_server: Service, retriever: str, checkpoints: Checkpoints, tmp: Path,
                  *options: str) -> Service:
    """`sisrl-gateway serve` on the vLLM server, with vLLM's weight routes (a subprocess of this interpreter)."""
    port = free_port()
    args = ["serve", "--port", str(port), "--db-url", f"sqlite:///{tmp / 'rollouts.db'}",
            "--checkpoint-root", str(checkpoints.root), "--engine-url", vllm_server.url, "--model", SMOLLM2,
            "--retriever-url", retriever, "--engine-weights-route", "/collective_rpc",
            "--engine-after-weights-routes", "/reset_prefix_cache", "--engine-retries", "1",
            "--max-response-tokens", "400", "--topk", "3", *options]
    service = launch_module("gateway", "sisrl.services.cli", args, port=port, log=tmp / "gateway.log",
                            env={"SISRL_GATEWAY_LOG_LEVEL": "warning", "SISRL_GATEWAY_API_TOKEN": None})
    wait_healthy(service, timeout_s=180)
    return service


@pytest.fixture(scope="module")
def gateway(vllm_server: Service, retriever_url: str, checkpoints: Checkpoints,  # noqa: F811
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """`--engine vllm-http`: the policy is SmolLM2 itself, as vLLM samples it."""
    service = start_gateway(vllm_server, retriever_url, checkpoints, tmp_path_factory.mktemp("gateway"),
                            "--engine", "vllm-http")
    with httpx.Client(base_url=service.url, timeout=120) as client:
        yield client
    service.stop()


def wait_batch(client: httpx.Client, batch_id: str, timeout_s: float = 300.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body: dict[str, Any] = client.get(f"/v1/batches/{batch_id}").raise_for_status().json()
        if body["status"] != "running":
            return body
        time.sleep(0.5)
    raise TimeoutError(f"batch {batch_id} still running after {timeout_s}s")


def run_batch(client: httpx.Client, items: list[dict[str, Any]], samples: int, max_new_tokens: int,
              **extra: Any) -> list[dict[str, Any]]:
    body = {"run": "vllm", "step": 0, "policy_version": 0, "items": items, "samples_per_item": samples,
            "max_turns": 2, "sampling": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "top_p": 1.0,
                                         "logprobs_k": K, "seed": 5}} | extra
    batch = wait_batch(client, client.post("/v1/rollouts", json=body).raise_for_status().json()["batch_id"])
    total = len(items) * samples
    assert batch["status"] == "done" and batch["progress"] == {"done": total, "total": total}, batch
    trajectories: list[dict[str, Any]] = batch["trajectories"]
    for traj in trajectories:
        n = len(traj["response_ids"])
        assert traj["error"] is None and len(traj["loss_mask"]) == len(traj["behaviour_logprobs"]) == n
        assert len(traj["topk_ids"]) == len(traj["topk_logprobs"]) == n
        assert all(len(row) == K for row in traj["topk_ids"]) and all(len(r) == K for r in traj["topk_logprobs"])
    return trajectories


def test_gateway_batch_records_what_vllm_sampled(gateway: httpx.Client, qa_subset: Any,  # noqa: F811
                                                 reference: PreTrainedModel) -> None:
    """SmolLM2 (untrained: it answers or writes invalid actions, which the gateway corrects with an inserted
    message) through the gateway: every policy token's q, across turns, is the fp32 forward over the whole
    token context, inserted tokens included, i.e. nothing was re-tokenised between turns."""
    trajectories = run_batch(gateway, [nq_item(r) for r in qa_subset.nq[:2]], samples=4, max_new_tokens=64)
    for traj in trajectories:
        assert traj["policy_version"] == 0
        for m, lp, ids in zip(traj["loss_mask"], traj["behaviour_logprobs"], traj["topk_ids"], strict=True):
            assert (m == 1 and lp <= 0.0 and len(set(ids)) == K) or (m == 0 and lp == 0.0)
    multi = [t for t in trajectories if 0 in t["loss_mask"]]
    assert multi, "no trajectory took a second turn: " + str([t["finish_reason"] for t in trajectories])
    traj = multi[0]
    logq = reference_logq(reference, traj["prompt_ids"], traj["response_ids"], SamplingParams(temperature=1.0))
    diffs = [abs(lp - float(logq[t, tok])) for t, (tok, m, lp) in
             enumerate(zip(traj["response_ids"], traj["loss_mask"], traj["behaviour_logprobs"], strict=True)) if m]
    assert max(diffs) <= LOGPROB_TOL, max(diffs)


def prompt_tokens_served(server: Service) -> float:
    """vLLM's Prometheus counter of prompt tokens it computed or took from its prefix cache."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_total"))


def test_gateway_batch_searches_through_the_real_retriever(vllm_server: Service, retriever_url: str,  # noqa: F811
                                                           checkpoints: Checkpoints, qa_subset: Any,  # noqa: F811
                                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    """A scripted policy that searches for its question (the untrained SmolLM2 hardly writes a valid search)
    with vLLM under it (`--script-base vllm-http`): vLLM generates on every real context, the retriever's
    passages come back into the context with mask 0."""
    tmp = tmp_path_factory.mktemp("scripted_gateway")
    script = {"rules": [{"match": "", "extract": {"q": {"from": "question", "pattern": "^(.*)$"}},
                         "turns": ["<search> {q} </search>", "<answer> unknown </answer>"]}]}
    (tmp / "script.json").write_text(json.dumps(script))
    service = start_gateway(vllm_server, retriever_url, checkpoints, tmp, "--engine", "scripted",
                            "--script", str(tmp / "script.json"), "--script-base", "vllm-http")
    try:
        before = prompt_tokens_served(vllm_server)
        with httpx.Client(base_url=service.url, timeout=120) as client:
            trajectories = run_batch(client, [nq_item(r) for r in qa_subset.nq[:3]], samples=2, max_new_tokens=48)
        served = prompt_tokens_served(vllm_server) - before
    finally:
        service.stop()
    corpus_ids, contexts = set(qa_subset.titles), 0
    for traj in trajectories:
        (turn,) = traj["turns"]
        assert turn["query"] == traj["question"].strip() and len(turn["doc_ids"]) == 3
        assert set(turn["doc_ids"]) <= corpus_ids and turn["scores"] == sorted(turn["scores"], reverse=True)
        assert (traj["finish_reason"], traj["answer"]) == ("answer", "unknown")
        mask = traj["loss_mask"]
        first = mask.index(0)
        second = first + mask[first:].index(1)
        assert 0 not in mask[second:], "policy turn, observation (mask 0), policy turn"
        contexts += 2 * len(traj["prompt_ids"]) + second  # turn 1: the prompt; turn 2: prompt + turn 1 + observation
    assert served == contexts, (served, contexts)  # vLLM saw exactly the real contexts, token for token


def completion(server: Service, prompt: list[int]) -> Generation:
    return generate_all(server, [prompt], [SamplingParams(max_new_tokens=16, temperature=1.0, seed=11,
                                                          logprobs_k=K, stop=())])[0]


def test_weight_update_through_the_gateway(gateway: httpx.Client, vllm_server: Service, checkpoints: Checkpoints,
                                           prompt: list[int]) -> None:
    before = completion(vllm_server, prompt)
    loaded = gateway.post("/v1/policy", json={"path": "perturbed", "version": 1})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json() == {"policy_version": 1, "path": str(checkpoints.perturbed.resolve())}
    after = completion(vllm_server, prompt)
    noisy = perturbed_model(checkpoints.perturbed)
    stats = check_against_reference(after, reference_logq(noisy, prompt, after.token_ids, SamplingParams()))
    assert max(abs(a - b) for a, b in zip(before.logprobs, after.logprobs, strict=True)) > 1e-2
    # New trajectories carry the new version.
    body = {"run": "vllm", "step": 1, "policy_version": 1, "items": [{"id": "q", "question": QUESTION,
            "golden_answers": ["Bram Stoker"], "data_source": "nq"}], "samples_per_item": 1, "max_turns": 1,
            "sampling": {"max_new_tokens": 8, "logprobs_k": K, "seed": 1}}
    batch = wait_batch(gateway, gateway.post("/v1/rollouts", json=body).raise_for_status().json()["batch_id"])
    assert [t["policy_version"] for t in batch["trajectories"]] == [1]
    # The original weights back: outputs as before, bit for bit.
    assert gateway.post("/v1/policy", json={"path": "original", "version": 2}).status_code == 200
    restored = completion(vllm_server, prompt)
    assert (restored.token_ids, restored.logprobs, restored.topk_ids) == (before.token_ids, before.logprobs,
                                                                          before.topk_ids)
    print("\nperturbed weights vs their reference:", stats)


def test_a_partial_load_lands_between_turns_of_running_trajectories(gateway: httpx.Client, qa_subset: Any,  # noqa: F811
                                                                     checkpoints: Checkpoints,
                                                                     reference: PreTrainedModel) -> None:
    """`POST /v1/policy {partial: true}` while a multi-turn batch runs on vLLM: the gate holds new generations,
    waits for the running ones and loads (docs/engines.md, "Weight loads while generating"). Each turn is then
    sampled by one version, later turns of a running trajectory by the new one, and every policy token's q is
    the fp32 forward, over the whole context, of the version its token records."""
    assert gateway.get("/health").json()["load_granularity"] == "turn"
    old = int(gateway.get("/v1/policy").json()["policy_version"])
    assert gateway.post("/v1/policy", json={"path": "original", "version": old + 1}).status_code == 200
    body = {"run": "vllm-partial", "step": 0, "policy_version": old + 1, "samples_per_item": 4, "max_turns": 3,
            "items": [nq_item(r) for r in qa_subset.nq[:2]],
            "sampling": {"max_new_tokens": 48, "temperature": 1.0, "top_p": 1.0, "logprobs_k": K, "seed": 9}}
    batch_id = gateway.post("/v1/rollouts", json=body).raise_for_status().json()["batch_id"]
    time.sleep(1.0)  # the first turns are running
    loaded = gateway.post("/v1/policy", json={"path": "perturbed", "version": old + 2, "partial": True})
    assert loaded.status_code == 200, loaded.text
    batch = wait_batch(gateway, batch_id)
    assert batch["status"] == "done", batch
    policies = {old + 1: reference, old + 2: perturbed_model(checkpoints.perturbed)}
    spans = 0
    for traj in batch["trajectories"]:
        versions, mask = traj["token_versions"], traj["loss_mask"]
        assert [v == -1 for v in versions] == [m == 0 for m in mask]
        turns: list[set[int]] = [set()]
        for v in versions:
            if v == -1 and turns[-1]:
                turns.append(set())
            elif v != -1:
                turns[-1].add(v)
        assert all(len(t) == 1 for t in turns if t), turns  # one version per turn
        policy_versions = [v for v in versions if v >= 0]
        assert policy_versions == sorted(policy_versions) and set(policy_versions) <= set(policies)
        spans += len(set(policy_versions)) == 2
        with torch.no_grad():
            logq = {v: reference_logq(m, traj["prompt_ids"], traj["response_ids"], SamplingParams(temperature=1.0))
                    for v, m in policies.items() if v in policy_versions}
        diffs = [abs(lp - float(logq[v][t, tok])) for t, (tok, v, lp) in
                 enumerate(zip(traj["response_ids"], versions, traj["behaviour_logprobs"], strict=True)) if v >= 0]
        assert max(diffs) <= LOGPROB_TOL, max(diffs)
    assert spans >= 1, "no running trajectory took a turn after the load: " + str(
        [(t["finish_reason"], t["loss_mask"].count(0)) for t in batch["trajectories"]])
    assert gateway.post("/v1/policy", json={"path": "original", "version": old + 3}).status_code == 200


def test_a_sharded_bf16_push_loads_into_vllm(gateway: httpx.Client, vllm_server: Service, checkpoints: Checkpoints,
                                            prompt: list[int], reference: PreTrainedModel) -> None:
    """The trainer's push format: bf16 shards (model-0000i-of-0000N.safetensors, index, no lm_head: tied) read
    tensor by tensor into the float32 server. Its log-probs are the fp32 forward of the perturbed weights cast to
    bf16 and back (exact in fp32), within the module's tolerance; the original weights then come back. The cast is
    of the parameters only: `Module.to(bfloat16)` would also round the rotary `inv_freq` buffer, which vLLM
    computes in fp32, and put the reference ~1e-2 off every engine (`cast_parameters`)."""
    index = json.loads((checkpoints.pushed_bf16 / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 5 and "lm_head.weight" not in index["weight_map"]
    assert gateway.post("/v1/policy", json={"path": "original", "version": 10}).status_code == 200
    before = completion(vllm_server, prompt)
    loaded = gateway.post("/v1/policy", json={"path": "pushed_bf16", "version": 11})
    assert loaded.status_code == 200, loaded.text
    after = completion(vllm_server, prompt)
    cast = cast_parameters(cast_parameters(perturbed_model(checkpoints.perturbed), torch.bfloat16), torch.float32)
    stats = check_against_reference(after, reference_logq(cast, prompt, after.token_ids, SamplingParams()))
    assert max(abs(a - b) for a, b in zip(before.logprobs, after.logprobs, strict=True)) > 1e-2
    assert gateway.post("/v1/policy", json={"path": "original", "version": 12}).status_code == 200
    restored = completion(vllm_server, prompt)
    assert (restored.token_ids, restored.logprobs) == (before.token_ids, before.logprobs)
    print("\nbf16 shards vs the bf16-cast reference:", stats)


def test_bad_checkpoints_are_refused_and_the_server_keeps_serving(gateway: httpx.Client, vllm_server: Service,
                                                                  prompt: list[int]) -> None:
    assert gateway.post("/v1/policy", json={"path": "original", "version": 4}).status_code == 200
    before = completion(vllm_server, prompt)
    for name, message in [("corrupt", "not a readable safetensors file"), ("wrong_shape", "served model")]:
        refused = gateway.post("/v1/policy", json={"path": name, "version": 5})
        assert refused.status_code == 400 and message in refused.text, refused.text
        assert gateway.get("/v1/policy").json()["policy_version"] == 4
        assert httpx.get(f"{vllm_server.url}/health", timeout=10).status_code == 200, log_tail(vllm_server.log)
        now = completion(vllm_server, prompt)
        assert (now.token_ids, now.logprobs) == (before.token_ids, before.logprobs), name


def test_inproc_engine_generates_and_loads_weights(inproc: InProc, vllm_server: Service,
                                                   prompt: list[int]) -> None:
    out, _ = inproc.process.communicate(timeout=STARTUP_S)
    stderr = inproc.stderr.read_text(errors="replace")
    assert inproc.process.returncode == 0, stderr[-4000:]
    result = json.loads(out.strip().splitlines()[-1])
    gens = {key: Generation(**result[key]) for key in ("before", "after", "after_bad", "restored")}
    for gen in gens.values():
        gen.validate(K)
    assert gens["before"].token_ids != gens["after"].token_ids or gens["before"].logprobs != gens["after"].logprobs
    assert "served model" in result["bad_error"] and result["version_after_bad"] == 1
    assert gens["after_bad"].token_ids == gens["after"].token_ids
    assert gens["restored"].token_ids == gens["before"].token_ids and result["version"] == 3
    # Same build, same weights, same seed: the in-process engine samples what the server samples.
    served = completion(vllm_server, prompt)
    assert served.token_ids == gens["before"].token_ids
    assert max(abs(a - b) for a, b in zip(served.logprobs, gens["before"].logprobs, strict=True)) <= 1e-4
    assert "Traceback" not in stderr and "TypeError" not in stderr, stderr[-4000:]
