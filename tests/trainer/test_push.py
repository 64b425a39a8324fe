"""Weight pushes (`trainer/push.py`): sharded safetensors in Hugging Face's layout, in the push dtype, gathered under
FSDP2 with at most one shard plus one tensor held, and loaded by the local engine.

Memory is checked by construction, with the writer's own counter (`PushStats`): it holds a weak reference to every
gathered or converted tensor and sums the bytes of those still alive after every gather, conversion and write.
Rank 0's peak must stay within one shard plus the largest gathered tensor; after each parameter's turn the other
rank must hold nothing (`peak_kept_bytes == 0`), and at most one gathered tensor at any time.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from sisrl.common.models import build_tiny_policy, cast_parameters, load_tokenizer
from sisrl.common.procs import free_port, run_group
from sisrl.common.shards import INDEX_NAME
from sisrl.services.engines.base import SamplingParams
from sisrl.services.engines.local import LocalEngine
from sisrl.trainer.config import ModelConfig
from sisrl.trainer.policy import load_policy
from sisrl.trainer.push import resolve_push_dtype, write_push
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedTokenizerBase

from tests.trainer.push_worker import SHARD_BYTES

WORKER = Path(__file__).with_name("push_worker.py")


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer()


def _read_push(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The index and every tensor of a pushed directory, each tensor read from the shard the index names."""
    index = json.loads((folder / INDEX_NAME).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / file), framework="pt") as handle:
            assert set(handle.keys()) == {n for n, f in index["weight_map"].items() if f == file}
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return index, tensors


def _check_against(model: LlamaForCausalLM, folder: Path, dtype: torch.dtype, saved_names: set[str]) -> dict:
    """The push holds exactly save_pretrained's names, each the model's tensor cast to `dtype` bit for bit, in
    shards named model-0000i-of-0000N with a right index; returns the index."""
    index, tensors = _read_push(folder)
    assert set(tensors) == saved_names  # tied lm_head.weight written once, under the embedding's name
    own = model.state_dict()
    for name, tensor in tensors.items():
        assert tensor.dtype == dtype, name
        assert torch.equal(tensor, own[name].to(dtype)), name
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert json.loads((folder / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    return index


def test_one_process_push_is_sharded_bf16_with_save_pretrained_names(tmp_path: Path,
                                                                     tokenizer: PreTrainedTokenizerBase) -> None:
    model = build_tiny_policy(tokenizer, seed=0)
    model.save_pretrained(tmp_path / "reference", safe_serialization=True)
    saved = set(load_file(str(tmp_path / "reference" / "model.safetensors")))
    assert "lm_head.weight" not in saved and model.config.tie_word_embeddings

    stats = write_push(model, tokenizer, tmp_path / "push", dtype=torch.bfloat16, max_shard_bytes=SHARD_BYTES)
    index = _check_against(model, tmp_path / "push", torch.bfloat16, saved)
    assert stats.shards == len(set(index["weight_map"].values())) >= 3
    assert stats.bytes_written == index["metadata"]["total_size"]
    assert stats.peak_live_bytes <= SHARD_BYTES + stats.largest_gathered_bytes
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp directory left

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "push")  # transformers reads the index
    assert loaded.dtype == torch.bfloat16
    for name, value in loaded.state_dict().items():  # lm_head.weight included: tied again on load
        assert torch.equal(value, model.state_dict()[name].to(torch.bfloat16)), name


@pytest.mark.timeout(300)  # a torchrun pair: two interpreters import torch and transformers
def test_fsdp2_push_on_two_ranks_gathers_one_tensor_at_a_time(tmp_path: Path,
                                                               tokenizer: PreTrainedTokenizerBase) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(WORKER), str(tmp_path)]
    proc = run_group(cmd, env=env, timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-3000:]

    model = build_tiny_policy(tokenizer, seed=0)  # the workers' model, unsharded
    model.save_pretrained(tmp_path / "reference", safe_serialization=True)
    saved = set(load_file(str(tmp_path / "reference" / "model.safetensors")))
    index = _check_against(model, tmp_path / "push", torch.bfloat16, saved)

    main, other = (json.loads((tmp_path / f"stats_{r}.json").read_text()) for r in (0, 1))
    largest = model.model.embed_tokens.weight.nbytes  # fp32: gathered in the trainer's dtype
    assert main["largest_gathered_bytes"] == other["largest_gathered_bytes"] == largest
    assert main["shards"] == len(set(index["weight_map"].values())) >= 3
    assert main["peak_live_bytes"] <= SHARD_BYTES + largest
    assert main["peak_kept_bytes"] <= SHARD_BYTES  # between parameters: the shard being filled, never a gathered one
    assert other["peak_kept_bytes"] == 0  # rank 1 drops each gathered tensor before the next parameter
    assert other["peak_live_bytes"] <= largest  # and never holds two at once


def test_local_engine_serves_a_bf16_push_with_the_trainers_log_probs(tmp_path: Path,
                                                                      tokenizer: PreTrainedTokenizerBase) -> None:
    """The engine (float32, as on a CPU without native bf16) loads the bf16 shards: its log-probs are those of the
    trainer's model cast to bf16 and back, within the engine tests' 1e-4 (tests/services/test_engines.py)."""
    torch.set_num_threads(1)
    trainer_model = build_tiny_policy(tokenizer, seed=3)
    write_push(trainer_model, tokenizer, tmp_path / "v1", dtype=torch.bfloat16, max_shard_bytes=SHARD_BYTES)
    reference = cast_parameters(cast_parameters(build_tiny_policy(tokenizer, seed=3), torch.bfloat16), torch.float32)
    prompt = list(tokenizer.encode("Who wrote the novel Dracula?"))
    params = SamplingParams(max_new_tokens=8, stop=(), seed=5, logprobs_k=4)

    async def main() -> tuple[list[int], list[float], LocalEngine]:
        engine = LocalEngine(build_tiny_policy(tokenizer, seed=0), tokenizer=tokenizer)
        try:
            await engine.load_weights(str(tmp_path / "v1"), 1)
            gen = await engine.generate(prompt, params)
            assert gen.policy_version == 1
            return gen.token_ids, gen.logprobs, engine
        finally:
            await engine.close()

    token_ids, logprobs, engine = asyncio.run(main())
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, reference.state_dict()[name]), name
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([prompt + token_ids])).logits[0, len(prompt) - 1:-1].double()
    expected = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(token_ids).unsqueeze(-1)).squeeze(-1)
    assert (expected.float() - torch.tensor(logprobs)).abs().max().item() <= 1e-4
    direct = build_tiny_policy(tokenizer, seed=3)
    with torch.no_grad():  # the cast is visible: the fp32 model's own log-probs differ
        fp32 = torch.log_softmax(direct(input_ids=torch.tensor([prompt + token_ids])).logits[0].double(), -1)
    assert not torch.equal(fp32[len(prompt) - 1:-1].gather(-1, torch.tensor(token_ids).unsqueeze(-1)).squeeze(-1),
                           expected)


def test_a_bf16_engine_holds_the_push_bit_for_bit(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    trainer_model = build_tiny_policy(tokenizer, seed=3)
    write_push(trainer_model, tokenizer, tmp_path / "v1", dtype=torch.bfloat16, max_shard_bytes=SHARD_BYTES)

    async def main() -> LocalEngine:
        engine = LocalEngine(cast_parameters(build_tiny_policy(tokenizer, seed=0), torch.bfloat16), tokenizer=tokenizer)
        await engine.load_weights(str(tmp_path / "v1"), 1)
        await engine.close()
        return engine

    engine = asyncio.run(main())
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, trainer_model.state_dict()[name].to(torch.bfloat16)), name


def test_a_missing_shard_is_refused_before_any_weight_changes(tmp_path: Path,
                                                              tokenizer: PreTrainedTokenizerBase) -> None:
    write_push(build_tiny_policy(tokenizer, seed=3), tokenizer, tmp_path / "v1", dtype=torch.bfloat16,
               max_shard_bytes=SHARD_BYTES)
    (tmp_path / "v1" / "model-00002-of-00004.safetensors").unlink()
    model = build_tiny_policy(tokenizer, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    async def main() -> None:
        engine = LocalEngine(model, tokenizer=tokenizer)
        try:
            with pytest.raises(FileNotFoundError, match="model-00002-of-00004.safetensors"):
                await engine.load_weights(str(tmp_path / "v1"), 1)
        finally:
            await engine.close()

    asyncio.run(main())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_push_dtype_auto_follows_the_engine_else_the_trainer() -> None:
    assert resolve_push_dtype("auto", served="bfloat16", trained="float32") == torch.bfloat16
    assert resolve_push_dtype("auto", served=None, trained="float32") == torch.float32
    assert resolve_push_dtype("float32", served="bfloat16", trained="bfloat16") == torch.float32
    with pytest.raises(ValueError, match="weights_dtype: 'int8'"):
        resolve_push_dtype("auto", served="int8", trained="float32")


def test_a_shard_that_breaks_after_the_check_tears_the_engine_until_a_load_succeeds(
        tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """The headers pass, then a shard is truncated while the load waits for a running generation: the copy fails
    half-way (the first shards already copied), so the engine refuses to generate until a load succeeds."""
    write_push(build_tiny_policy(tokenizer, seed=3), tokenizer, tmp_path / "v1", dtype=torch.bfloat16,
               max_shard_bytes=SHARD_BYTES)
    write_push(build_tiny_policy(tokenizer, seed=4), tokenizer, tmp_path / "v2", dtype=torch.bfloat16,
               max_shard_bytes=SHARD_BYTES)
    prompt = list(tokenizer.encode("Who wrote the novel Dracula?"))
    params = SamplingParams(max_new_tokens=64, stop=(), seed=5, logprobs_k=2)

    async def main() -> None:
        engine = LocalEngine(build_tiny_policy(tokenizer, seed=0), tokenizer=tokenizer)
        try:
            running = asyncio.create_task(engine.generate(prompt, params))
            while engine.stats.prefill_passes == 0:  # the generation runs before the load is asked for
                await asyncio.sleep(0.001)
            load = asyncio.create_task(engine.load_weights(str(tmp_path / "v1"), 1))
            while not engine._swaps:  # checked and queued: it waits for the running generation
                await asyncio.sleep(0.001)
            last = sorted((tmp_path / "v1").glob("model-*.safetensors"))[-1]
            last.write_bytes(last.read_bytes()[:-10])
            await running
            with pytest.raises(ValueError, match="not a readable safetensors file"):
                await load
            with pytest.raises(RuntimeError, match="torn"):
                await engine.generate(prompt, params)
            await engine.load_weights(str(tmp_path / "v2"), 2)
            assert (await engine.generate(prompt, params)).policy_version == 2
        finally:
            await engine.close()

    asyncio.run(main())


def test_a_bf16_trainer_policy_keeps_the_rotary_frequencies_the_engines_use(
        tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """The 'tiny' policy trained in bf16 casts its parameters only: its rotary `inv_freq` stays float32, as in
    `from_pretrained(dtype=bfloat16)` and in every engine that loads its pushes, so trainer and engine compute
    the same positions (a whole-module `.to(bfloat16)` rounds them: a learner/engine gap no ratio should see)."""
    torch.set_num_threads(1)
    policy, _ = load_policy(ModelConfig(path="tiny", dtype="bfloat16"), seed=3, device=torch.device("cpu"))
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}
    assert policy.model.rotary_emb.inv_freq.dtype == torch.float32
    policy.save_pretrained(tmp_path / "saved", safe_serialization=True)
    served = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.bfloat16).eval()
    ids = torch.tensor([list(range(5, 205))])  # 200 positions: a rounded frequency would show
    with torch.no_grad():
        assert torch.equal(policy.eval()(input_ids=ids).logits, served(input_ids=ids).logits)
        rounded = build_tiny_policy(tokenizer, seed=3).to(torch.bfloat16)  # the whole-module cast, for contrast
        assert not torch.equal(rounded(input_ids=ids).logits, served(input_ids=ids).logits)
