"""The local transformers engine: batching, behaviour log-probs against a fresh forward pass, stops, seeds,
weight swaps and parameter validation. A tiny random Llama with the real SmolLM2 tokenizer stands in for the
policy; every check runs the real engine."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from sisrl.common.models import build_tiny_policy, load_tokenizer
from sisrl.services.engines.base import MIN_LOGPROB, Generation, SamplingParams, create_engine
from sisrl.services.engines.local import LocalEngine
from sisrl.services.engines.sampling import sample_tokens
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

pytestmark = pytest.mark.usefixtures("one_torch_thread")

T = TypeVar("T")
QUESTIONS = [
    "Who wrote the novel Dracula?",
    "What is the capital of Australia? Think first.",
    "<search>tallest mountain in Africa</search>",
    "Name a prime number larger than one hundred and explain why it is prime.",
    "Hi",
    "When did the Berlin Wall fall, and which events led to it?",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer: PreTrainedTokenizerBase) -> LlamaForCausalLM:
    return build_tiny_policy(tokenizer, seed=0)


@pytest.fixture(scope="module")
def prompts(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Prompts of different lengths, so batched rows are left-padded by different amounts."""
    return [list(tokenizer.encode(q)) for q in QUESTIONS]


def run_engine(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, body: Callable[[LocalEngine], Awaitable[T]]
) -> T:
    """Run `body(engine)` on a fresh engine in a fresh event loop, closing the engine afterwards."""

    async def main() -> T:
        engine = LocalEngine(model, tokenizer=tokenizer)
        try:
            return await body(engine)
        finally:
            await engine.close()

    return asyncio.run(main())


def reference_logq(
    model: LlamaForCausalLM, prompt: list[int], gen: Generation, temperature: float, top_p: float
) -> torch.Tensor:
    """log q at every generated position from one full forward pass of prompt + generated ids. -> [T, V].

    Written independently of the engine: plain softmax at the temperature, then a per-position nucleus.
    """
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()  # [T, V]
    temp = temperature if temperature > 0 else 1.0
    logq = torch.log_softmax(logits / temp, dim=-1)
    if top_p < 1.0 and temperature > 0:
        for t in range(logq.shape[0]):
            probs, order = logq[t].exp().sort(descending=True)
            keep = int((probs.cumsum(0) < top_p).sum()) + 1  # smallest prefix with mass >= top_p
            masked = torch.full_like(logq[t], -math.inf)
            masked[order[:keep]] = logq[t, order[:keep]]
            logq[t] = masked - torch.logsumexp(masked, dim=0)
    return logq.clamp(min=MIN_LOGPROB).float()


def assert_matches_reference(
    model: LlamaForCausalLM, prompt: list[int], gen: Generation, params: SamplingParams
) -> None:
    logq = reference_logq(model, prompt, gen, params.temperature, params.top_p)  # [T, V]
    sampled = logq.gather(-1, torch.tensor(gen.token_ids).unsqueeze(-1)).squeeze(-1)
    assert (sampled - torch.tensor(gen.logprobs)).abs().max().item() <= 1e-4
    top_ids = torch.tensor(gen.topk_ids)  # [T, K]
    assert (logq.gather(-1, top_ids) - torch.tensor(gen.topk_logprobs)).abs().max().item() <= 1e-4
    # The recorded ids are the K best by rank (values sorted, nothing better left out).
    kth = logq.gather(-1, top_ids[:, -1:])  # [T, 1]
    assert bool((logq > kth + 1e-4).sum(-1).le(params.logprobs_k - 1).all())
    assert bool((torch.tensor(gen.topk_logprobs).diff(dim=-1) <= 1e-6).all())


def test_sample_tokens_follows_q_and_never_draws_removed_tokens() -> None:
    """Two-level inverse CDF with slices of 3 over 8 tokens (padding included): frequencies within 4 sigma."""
    q = torch.tensor([0.1, 0.0, 0.25, 0.05, 0.0, 0.3, 0.2, 0.1])
    rows = 20000
    logq = q.log().expand(rows, -1)
    drawn = sample_tokens(
        logq, [False] * rows, [torch.Generator().manual_seed(i) for i in range(rows)], block=3
    )
    freq = torch.bincount(drawn, minlength=8).double() / rows
    sigma = (q.double() * (1 - q.double()) / rows).sqrt()
    assert bool(((freq - q.double()).abs() <= 4 * sigma + 1e-12).all()), freq
    assert freq[1] == 0 and freq[4] == 0
    again = sample_tokens(
        logq[:5], [False] * 5, [torch.Generator().manual_seed(i) for i in range(5)], block=3
    )
    assert again.tolist() == drawn[:5].tolist()
    assert sample_tokens(logq[:2], [True, True], [torch.Generator()] * 2).tolist() == [5, 5]


def test_concurrent_requests_are_batched(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_new_tokens=10, stop=(), seed=3, logprobs_k=4)

    async def body(engine: LocalEngine) -> list[Generation]:
        gens = await asyncio.gather(*[engine.generate(p, params) for p in prompts])
        stats = engine.stats
        tokens = sum(len(g.token_ids) for g in gens)
        assert stats.generated_tokens == tokens == 10 * len(prompts)
        # One-at-a-time decoding needs one pass per token; the batch needs about max_new_tokens passes.
        assert stats.forward_passes <= 10 + 2, stats
        assert stats.max_batch_size == len(prompts)
        return gens

    gens = run_engine(model, tokenizer, body)
    assert all(g.finish_reason == "length" for g in gens)
    for prompt, gen in zip(prompts, gens, strict=True):
        gen.validate(4)
        assert_matches_reference(model, prompt, gen, params)


def test_batch_size_cap_queues_the_rest(
    tokenizer: PreTrainedTokenizerBase, model: LlamaForCausalLM, prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_new_tokens=5, stop=(), seed=9, logprobs_k=1)

    async def main() -> None:
        engine = LocalEngine(model, tokenizer=tokenizer, max_batch_size=2)
        gens = await asyncio.gather(*[engine.generate(p, params) for p in prompts])
        assert [len(g.token_ids) for g in gens] == [5] * len(prompts)
        assert engine.stats.max_batch_size == 2 and engine.stats.prefill_passes >= len(prompts) // 2
        await engine.close()
        with pytest.raises(RuntimeError, match="closed"):
            await engine.generate(prompts[0], params)

    asyncio.run(main())


@pytest.mark.parametrize(
    "temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.6, 1.0), (0.8, 0.9), (0.0, 1.0)], ids=str
)
def test_logprobs_equal_fresh_forward(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    temperature: float,
    top_p: float,
) -> None:
    """Rows join a running batch at different times (staggered arrivals) and still match a fresh pass."""
    params = SamplingParams(
        max_new_tokens=8, temperature=temperature, top_p=top_p, stop=(), seed=11, logprobs_k=6
    )

    async def body(engine: LocalEngine) -> list[Generation]:
        async def later(i: int, prompt: list[int]) -> Generation:
            await asyncio.sleep(0.01 * i)
            return await engine.generate(prompt, params)

        gens = await asyncio.gather(*[later(i, p) for i, p in enumerate(prompts[:3])])
        assert engine.stats.prefill_passes >= 2  # some rows joined a batch that was already decoding
        return gens

    gens = run_engine(model, tokenizer, body)
    for prompt, gen in zip(prompts[:3], gens, strict=True):
        assert_matches_reference(model, prompt, gen, params)
        if temperature == 0.0:
            logq = reference_logq(model, prompt, gen, 0.0, 1.0)
            assert gen.token_ids == logq.argmax(-1).tolist()
        if top_p < 1.0:  # a top-p row never samples outside its nucleus
            assert min(gen.logprobs) > MIN_LOGPROB


def test_sampled_token_in_topk_exactly_when_rank_le_k(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]]
) -> None:
    k = 3
    hot = SamplingParams(max_new_tokens=16, temperature=1.0, stop=(), seed=5, logprobs_k=k)
    cold = SamplingParams(max_new_tokens=16, temperature=0.02, stop=(), seed=5, logprobs_k=k)

    async def body(engine: LocalEngine) -> list[Generation]:
        return await asyncio.gather(engine.generate(prompts[0], hot), engine.generate(prompts[1], cold))

    gens = run_engine(model, tokenizer, body)
    seen = set()
    for prompt, gen, params in zip(prompts, gens, (hot, cold), strict=False):
        logq = reference_logq(model, prompt, gen, params.temperature, 1.0)
        for t, token in enumerate(gen.token_ids):
            rank = int((logq[t] > logq[t, token]).sum()) + 1
            assert (token in gen.topk_ids[t]) == (rank <= k), (t, rank)
            seen.add(rank <= k)
    assert seen == {True, False}, "both cases must occur for the check to mean anything"


def test_stop_strings_end_generation_with_the_text_kept(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]]
) -> None:
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, stop=())
    free = run_engine(model, tokenizer, lambda e: e.generate(prompts[2], greedy))
    # A stop string spanning two sampled tokens (the 4th and 5th) of the free-running greedy output.
    stop = tokenizer.decode(free.token_ids[3:5])
    texts = [tokenizer.decode(free.token_ids[: j + 1]) for j in range(len(free.token_ids))]
    end = next(j for j, text in enumerate(texts) if stop in text)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop=("never-appears", stop))
    gen = run_engine(model, tokenizer, lambda e: e.generate(prompts[2], params))
    assert gen.finish_reason == "stop"
    assert gen.token_ids == free.token_ids[: end + 1]
    assert stop in tokenizer.decode(gen.token_ids) and stop not in tokenizer.decode(gen.token_ids[:-1])


def test_eos_ends_generation_with_the_eos_token_kept(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]]
) -> None:
    """The random policy never emits its real EOS, so the 4th greedy token is declared the EOS id."""
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0, stop=())
    free = run_engine(model, tokenizer, lambda e: e.generate(prompts[0], greedy))
    eos = free.token_ids[3]
    end = free.token_ids.index(eos)

    async def main() -> Generation:
        engine = LocalEngine(model, tokenizer=tokenizer, eos_ids=frozenset({eos}))
        try:
            return await engine.generate(prompts[0], greedy)
        finally:
            await engine.close()

    gen = asyncio.run(main())
    assert gen.finish_reason == "eos" and gen.token_ids == free.token_ids[: end + 1]


def test_seed_reproducible_whatever_shares_the_batch(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=1.0, stop=(), seed=1234, logprobs_k=2)
    other = SamplingParams(max_new_tokens=8, temperature=1.0, stop=(), seed=99, logprobs_k=2)

    async def body(engine: LocalEngine) -> tuple[Generation, Generation, Generation]:
        alone = await engine.generate(prompts[0], params)
        crowd = await asyncio.gather(
            engine.generate(prompts[3], other),
            engine.generate(prompts[0], params),
            engine.generate(prompts[5], other),
        )
        reseeded = await engine.generate(prompts[0], other)
        return alone, crowd[1], reseeded

    alone, batched, reseeded = run_engine(model, tokenizer, body)
    assert alone.token_ids == batched.token_ids
    assert max(abs(a - b) for a, b in zip(alone.logprobs, batched.logprobs, strict=True)) <= 1e-5
    assert reseeded.token_ids != alone.token_ids


def test_load_weights_changes_outputs_and_version(
    tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]], tmp_path: Path
) -> None:
    model = build_tiny_policy(tokenizer, seed=0)
    build_tiny_policy(tokenizer, seed=1).save_pretrained(tmp_path / "v1", safe_serialization=True)
    build_tiny_policy(tokenizer, hidden_size=32, seed=2).save_pretrained(
        tmp_path / "wrong", safe_serialization=True
    )
    params = SamplingParams(max_new_tokens=6, stop=(), seed=8, logprobs_k=3)

    async def body(engine: LocalEngine) -> tuple[Generation, Generation]:
        before = await engine.generate(prompts[1], params)
        # A running generation finishes on the old weights; the swap waits for it.
        running = asyncio.create_task(engine.generate(prompts[4], params))
        await asyncio.sleep(0)
        await engine.load_weights(str(tmp_path / "v1"), 3)
        assert (await running).policy_version == 0
        assert engine.policy_version == 3
        with pytest.raises(ValueError, match="shape"):
            await engine.load_weights(str(tmp_path / "wrong"), 4)
        with pytest.raises(FileNotFoundError, match="missing"):
            await engine.load_weights(str(tmp_path / "missing"), 5)
        assert engine.policy_version == 3
        return before, await engine.generate(prompts[1], params)

    before, after = run_engine(model, tokenizer, body)
    assert before.policy_version == 0 and after.policy_version == 3
    assert before.token_ids != after.token_ids
    fresh = build_tiny_policy(tokenizer, seed=1)
    assert_matches_reference(fresh, prompts[1], after, params)


def test_bad_params_raise_errors_naming_the_value(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase
) -> None:
    for kwargs, name in [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"logprobs_k": -1}, "logprobs_k"),
        ({"stop": ("",)}, "stop"),
        ({"stop": "</answer>"}, "stop"),
        ({"seed": -3}, "seed"),
    ]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)  # type: ignore[arg-type]

    async def body(engine: LocalEngine) -> None:
        with pytest.raises(ValueError, match="at least one"):
            await engine.generate([], SamplingParams())
        with pytest.raises(ValueError, match=r"prompt_ids\[1\] = 49152"):
            await engine.generate([1, 49152], SamplingParams())
        with pytest.raises(ValueError, match="logprobs_k=50000"):
            await engine.generate([1, 2], SamplingParams(logprobs_k=50000))

    run_engine(model, tokenizer, body)
    with pytest.raises(ValueError, match="'nope'.*'local', 'vllm-http', 'vllm'"):
        create_engine("nope", model="x")
    with pytest.raises(ValueError, match="tokenizer"):
        LocalEngine(model)


def test_cancelled_request_leaves_the_batch(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]]
) -> None:
    long = SamplingParams(max_new_tokens=1500, stop=(), seed=1, logprobs_k=1)
    short = SamplingParams(max_new_tokens=6, stop=(), seed=2, logprobs_k=1)

    async def body(engine: LocalEngine) -> Generation:
        doomed = asyncio.create_task(engine.generate(prompts[0], long))
        result = await engine.generate(prompts[1], short)
        doomed.cancel()
        await asyncio.sleep(0.01)
        count = engine.stats.generated_tokens
        await asyncio.sleep(0.2)
        assert engine.stats.generated_tokens - count <= 1  # at most the step already running
        assert count < 1500 + 6
        return result

    assert len(run_engine(model, tokenizer, body).token_ids) == 6


def test_a_next_turn_reuses_the_cached_generation_and_still_matches_a_fresh_pass(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]]
) -> None:
    """An agent's second turn (prompt + its first answer + an observation) prefills only the new tokens; two
    samples of one prompt share one prefill. Every row still matches a fresh forward pass."""
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, stop=(), seed=s, logprobs_k=5) for s in (1, 2, 3)]
    observation = list(tokenizer.encode("<information>Doc 1: a passage.</information>"))
    first_turn = [prompts[0], prompts[0], prompts[3]]  # a GRPO group of two, and another question

    async def body(engine: LocalEngine) -> tuple[list[Generation], list[list[int]], list[Generation]]:
        gens = await asyncio.gather(*[engine.generate(p, q) for p, q in zip(first_turn, params, strict=True)])
        second = [p + g.token_ids + observation for p, g in zip(first_turn, gens, strict=True)]

        async def later(i: int) -> Generation:
            await asyncio.sleep(0.01 * i)
            return await engine.generate(second[i], params[i])

        fresh = engine.generate(prompts[5], params[0])  # no cached prefix: joins the same prefills
        *gens2, gen_fresh = await asyncio.gather(*[later(i) for i in range(3)], fresh)
        assert_matches_reference(model, prompts[5], gen_fresh, params[0])
        stats = engine.stats
        assert stats.prefix_hits == 3
        assert stats.prefix_reused_tokens == sum(len(p) + len(g.token_ids) - 1 for p, g in zip(first_turn, gens, strict=True))
        return list(gens), second, list(gens2)

    gens, second, gens2 = run_engine(model, tokenizer, body)
    for prompt, gen, q in [*zip(first_turn, gens, params, strict=True), *zip(second, gens2, params, strict=True)]:
        assert_matches_reference(model, prompt, gen, q)


def test_a_weight_swap_empties_the_prefix_cache(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]], tmp_path: Path
) -> None:
    other = build_tiny_policy(tokenizer, seed=5)
    other.save_pretrained(tmp_path / "other", safe_serialization=True)
    engine_model = build_tiny_policy(tokenizer, seed=0)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, stop=(), seed=1, logprobs_k=5)

    async def body(engine: LocalEngine) -> None:
        gen = await engine.generate(prompts[1], params)
        assert len(engine.prefix_cache) == 1
        await engine.load_weights(str(tmp_path / "other"), 1)
        assert len(engine.prefix_cache) == 0  # KV from the old weights would be stale
        await engine.generate(prompts[1] + gen.token_ids, params)
        assert engine.stats.prefix_hits == 0

    run_engine(engine_model, tokenizer, body)


def test_long_generations_through_cache_reallocations_match_a_fresh_pass(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]]
) -> None:
    """150 tokens per row: each row's cache outgrows its spare room (GrowingLayer.SPARE = 64 columns) twice, while
    rows join and leave the batch; every log-prob still matches a fresh forward pass."""
    from sisrl.services.engines.kv_batch import GrowingLayer

    params = SamplingParams(max_new_tokens=150, temperature=1.0, top_p=1.0, stop=(), seed=3, logprobs_k=4)

    async def main() -> list[Generation]:
        engine = LocalEngine(model, tokenizer=tokenizer, eos_ids=frozenset())  # every row runs to its length

        async def later(i: int, prompt: list[int], n: int) -> Generation:
            await asyncio.sleep(0.02 * i)
            return await engine.generate(prompt, replace(params, max_new_tokens=n))

        try:
            return await asyncio.gather(*[later(i, p, n) for i, (p, n) in
                                          enumerate(zip(prompts[:3], (150, 90, 150), strict=True))])
        finally:
            await engine.close()

    gens = asyncio.run(main())
    assert [len(g.token_ids) for g in gens] == [150, 90, 150]
    for prompt, gen in zip(prompts[:3], gens, strict=True):
        assert_matches_reference(model, prompt, gen, params)
    assert GrowingLayer.SPARE < 150


def test_a_growing_cache_layer_writes_in_place_until_full() -> None:
    from sisrl.services.engines.kv_batch import GrowingLayer

    keys = torch.randn(2, 3, 5, 4)
    layer = GrowingLayer.holding(keys, -keys)
    buffer = layer.keys.data_ptr()
    for step in range(GrowingLayer.SPARE):
        new = torch.full((2, 3, 1, 4), float(step))
        k, v = layer.update(new, -new)
        assert k.data_ptr() == buffer  # the same buffer: nothing copied
    k, v = layer.update(torch.ones(2, 3, 1, 4), -torch.ones(2, 3, 1, 4))  # full: one reallocation
    assert k.data_ptr() != buffer and k.shape == (2, 3, 5 + GrowingLayer.SPARE + 1, 4)
    torch.testing.assert_close(k[:, :, :5], keys)
    torch.testing.assert_close(k[:, :, 5 + 10, 0], torch.full((2, 3), 10.0))
    torch.testing.assert_close(v, -k)


def test_prompts_admitted_together_prefill_their_common_instructions_once(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Three questions after the same instructions arrive together: the instructions run once for all three
    (counted in stats.shared_prefix_tokens), and every log-prob still matches a fresh forward pass."""
    instructions = list(tokenizer.encode("Answer the question. Search with <search> query </search> when you need "
                                         "facts, then give the answer inside <answer> and </answer>. Question: "))
    prompts = [instructions + list(tokenizer.encode(q)) for q in QUESTIONS[:3]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1.0, stop=(), seed=5, logprobs_k=4)

    async def body(engine: LocalEngine) -> tuple[list[Generation], int]:
        gens = await asyncio.gather(*[engine.generate(p, params) for p in prompts])
        return gens, engine.stats.shared_prefix_tokens

    gens, saved = run_engine(model, tokenizer, body)
    assert len(instructions) >= 16
    assert saved == 2 * len(instructions)  # two of the three rows did not prefill the instructions
    for prompt, gen in zip(prompts, gens, strict=True):
        assert_matches_reference(model, prompt, gen, params)


def test_mid_request_load_switches_running_rows_and_records_each_tokens_version(
    tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]], tmp_path: Path
) -> None:
    """Partial rollouts: `load_weights_mid_request` lands between two decode steps while rows run. Every row
    then carries tokens of both versions, and each token's recorded log-prob / top-K is that of a fresh forward
    pass of the version that sampled it (the rows' prefixes were prefilled again under the new weights)."""
    old = build_tiny_policy(tokenizer, seed=0)
    new = build_tiny_policy(tokenizer, seed=1)
    new.save_pretrained(tmp_path / "v1", safe_serialization=True)
    model = build_tiny_policy(tokenizer, seed=0)  # the engine's copy; the load writes into it
    params = SamplingParams(max_new_tokens=40, stop=(), seed=5, logprobs_k=4)
    rows = [prompts[0], prompts[3], prompts[5], prompts[3]]

    async def body(engine: LocalEngine) -> list[Generation]:
        running = [asyncio.create_task(engine.generate(p, replace(params, seed=i))) for i, p in enumerate(rows)]
        while engine.stats.generated_tokens < 8 * len(rows):  # let every row sample some tokens first
            await asyncio.sleep(0.001)
        await engine.load_weights_mid_request(str(tmp_path / "v1"), 1)
        assert engine.policy_version == 1
        return await asyncio.gather(*running)

    gens = run_engine(model, tokenizer, body)
    for prompt, gen in zip(rows, gens, strict=True):
        versions = gen.versions()
        assert len(gen.token_ids) == 40 and gen.policy_version == 0
        assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1, versions
        cut = versions.index(1)
        assert 8 <= cut < 40
        for version, policy in ((0, old), (1, new)):
            logq = reference_logq(policy, prompt, gen, params.temperature, params.top_p)  # [T, V]
            span = [t for t, v in enumerate(versions) if v == version]
            sampled = logq[span].gather(-1, torch.tensor([gen.token_ids[t] for t in span]).unsqueeze(-1))
            recorded = torch.tensor([gen.logprobs[t] for t in span])
            assert (sampled.squeeze(-1) - recorded).abs().max().item() <= 1e-4, version
            top = torch.tensor([gen.topk_ids[t] for t in span])
            recorded_top = torch.tensor([gen.topk_logprobs[t] for t in span])
            assert (logq[span].gather(-1, top) - recorded_top).abs().max().item() <= 1e-4, version
        # the other version's forward pass does not explain the tokens after the load: the test can fail
        wrong = reference_logq(old, prompt, gen, params.temperature, params.top_p)[cut:]
        after = torch.tensor(gen.logprobs[cut:])
        picked = wrong.gather(-1, torch.tensor(gen.token_ids[cut:]).unsqueeze(-1)).squeeze(-1)
        assert (picked - after).abs().max().item() > 1e-3
