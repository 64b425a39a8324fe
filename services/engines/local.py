"""The local transformers engine (the CPU default): continuous batching over one KV cache.

Concurrent `generate` calls join a single running batch. A background task owns the batch and alternates:
when requests wait, their prompts are prefilled together and merged into the running KV cache; otherwise every
running row decodes one token. Finished rows leave at once, new ones join at the next prefill. The model runs
in a single worker thread, so the event loop stays free and the model is never called concurrently.

Weight swaps (`load_weights`) drain the batch first: admissions pause, running rows finish with the old weights,
then the new weights are copied in. So every generation comes from one policy version.
`load_weights_mid_request` (partial rollouts) swaps between two decode steps instead: the running rows' prompts
and tokens so far are prefilled again under the new weights (their old keys/values would mix two policies), and
their next tokens are sampled from it; each token records the version that sampled it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from sisrl.common.hardware import resolve_dtype
from sisrl.common.models import load_tokenizer, resolve_policy_path
from sisrl.services.engines.base import MIN_LOGPROB, Generation, SamplingParams, check_prompt
from sisrl.services.engines.kv_batch import KVBatch, PrefixCache
from sisrl.services.engines.sampling import StopChecker, processed_logprobs, sample_tokens, topk_by_rank
from sisrl.services.engines.weights import check_shapes, copy_safetensors, safetensors_shapes
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters since start. forward_passes < requests under concurrency shows that requests were batched."""

    requests: int = 0
    generated_tokens: int = 0
    forward_passes: int = 0  # prefill + decode passes of the model
    prefill_passes: int = 0
    max_batch_size: int = 0  # most rows ever decoded together
    prefix_hits: int = 0  # requests that continued a cached generation
    prefix_reused_tokens: int = 0  # prompt tokens those requests did not prefill again
    shared_prefix_tokens: int = 0  # prompt tokens not prefilled because rows admitted together share them
    prompt_tokens: int = 0  # prompt tokens asked for (prefilled + reused + shared)


@dataclass
class _Slot:
    """One request while it runs. T = generated so far."""

    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    stops: StopChecker
    future: asyncio.Future[Generation]
    version: int = 0
    token_ids: list[int] = field(default_factory=list)  # [T]
    token_versions: list[int] = field(default_factory=list)  # [T] policy version that sampled each token
    logprobs: list[float] = field(default_factory=list)  # [T]
    topk_ids: list[list[int]] = field(default_factory=list)  # [T][K]
    topk_logprobs: list[list[float]] = field(default_factory=list)  # [T][K]
    finish_reason: str | None = None

    def generation(self) -> Generation:
        assert self.finish_reason is not None
        mixed = any(v != self.version for v in self.token_versions)
        return Generation(
            self.token_ids, self.logprobs, self.topk_ids, self.topk_logprobs, self.finish_reason, self.version,
            token_versions=list(self.token_versions) if mixed else None,
        )


@dataclass
class _Swap:
    path: str  # checked (names, shapes) before it was queued; read tensor by tensor while it is applied
    version: int
    future: asyncio.Future[None]
    mid_request: bool = False  # True: between decode steps, running rows re-prefilled; False: after a drain


class LocalEngine:
    """Engine over a transformers causal LM on CPU (or one device); dtype `auto` = fp32 unless bf16 is native."""

    def __init__(
        self,
        model: str | PreTrainedModel,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        max_batch_size: int = 32,
        dtype: torch.dtype | str = "auto",
        policy_version: int = 0,
        num_threads: int | None = None,
        eos_ids: frozenset[int] | None = None,
        prefix_cache_tokens: int = 8192,
    ) -> None:
        """`model`: a name (`smollm2-135m-instruct`), an HF directory, or a built model (then pass `tokenizer`).

        A built model is used as is (not copied; it may live on any device); `load_weights` writes into it.
        `eos_ids` overrides the ids that end a generation (default: generation config + tokenizer).
        `prefix_cache_tokens`: KV of finished generations kept (at most this many tokens; 0 = off) so that a
        request continuing one (an agent's next turn) prefills only its new tokens; cleared on a weight swap.
        `num_threads` sets torch's intra-op threads for the whole process; use 1 on an oversubscribed CPU, where
        threads that wait for a descheduled peer make each small matmul hundreds of times slower.
        """
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if num_threads is not None:
            if num_threads < 1:
                raise ValueError(f"num_threads must be >= 1, got {num_threads}")
            torch.set_num_threads(num_threads)
        if isinstance(model, str):
            tokenizer = tokenizer or load_tokenizer(model)
            if isinstance(dtype, str):  # `auto`: bf16 only where native (sisrl.common.hardware)
                dtype = getattr(torch, resolve_dtype(dtype, "cpu", what=f"policy {model}"))
            model = AutoModelForCausalLM.from_pretrained(resolve_policy_path(model), dtype=dtype)
        elif tokenizer is None:
            raise ValueError(
                "a built model needs tokenizer=... (its tokenizer decodes text for stop strings)"
            )
        self.model: PreTrainedModel = model.eval()
        self.tokenizer: PreTrainedTokenizerBase = tokenizer
        self.policy_version = policy_version
        self.max_batch_size = max_batch_size
        self.vocab_size = int(model.config.get_text_config().vocab_size)
        self.max_positions: int | None = getattr(model.config, "max_position_embeddings", None)
        self.eos_ids = eos_ids if eos_ids is not None else _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids, default=0)
        self._batch = KVBatch(model, pad_id=int(pad))
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sisrl-local-engine")
        self._pending: list[_Slot] = []
        self._active: list[_Slot] = []
        self._swaps: list[_Swap] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._torn: str | None = None  # set when a swap failed half-way: the weights mix two checkpoints
        self._stats = EngineStats()

    @property
    def stats(self) -> EngineStats:
        """A snapshot of the counters."""
        s = self._stats
        return EngineStats(
            s.requests, s.generated_tokens, self._batch.forward_passes, s.prefill_passes, s.max_batch_size,
            self.prefix_cache.hits, self.prefix_cache.reused_tokens, self._batch.shared_prefix_tokens,
            s.prompt_tokens,
        )

    @property
    def running(self) -> int:
        """Generations waiting or decoding, cancelled ones included until the next step drops them."""
        return len(self._pending) + len(self._active)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Sample one continuation; see `Engine.generate`. Raises ValueError on a bad prompt or K.

        Cancelling the call cancels the generation: its row leaves the batch before the next decode step."""
        self._check_open()
        if self._torn is not None:
            raise RuntimeError(self._torn)
        check_prompt(prompt_ids, self.vocab_size)
        if self.max_positions is not None and len(prompt_ids) >= self.max_positions:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room under {self.max_positions}")
        if params.logprobs_k > self.vocab_size:
            raise ValueError(f"logprobs_k={params.logprobs_k} exceeds the vocabulary size {self.vocab_size}")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        slot = _Slot(
            prompt_ids=list(prompt_ids),
            params=params,
            generator=torch.Generator().manual_seed(seed),
            stops=StopChecker(self.tokenizer, params.stop),
            future=asyncio.get_running_loop().create_future(),
        )
        self._pending.append(slot)
        self._stats.requests += 1
        self._stats.prompt_tokens += len(slot.prompt_ids)
        self._kick()
        return await slot.future

    async def load_weights(self, path: str, version: int) -> None:
        """Load a safetensors HF directory (or file) once running generations finish; then set the version."""
        await self._load(path, version, mid_request=False)

    async def load_weights_mid_request(self, path: str, version: int) -> None:
        """Load a safetensors HF directory between two decode steps, without waiting for running generations:
        their prompts and tokens so far are prefilled again under the new weights, and every later token is
        sampled from them and records `version` (`Generation.token_versions`)."""
        await self._load(path, version, mid_request=True)

    async def _load(self, path: str, version: int, *, mid_request: bool) -> None:
        self._check_open()
        shapes = await asyncio.to_thread(safetensors_shapes, path)  # headers only: no second copy of the weights
        await asyncio.to_thread(check_shapes, self.model, shapes)
        swap = _Swap(path, version, asyncio.get_running_loop().create_future(), mid_request)
        self._swaps.append(swap)
        self._kick()
        await swap.future
        log.info("loaded weights from %s as policy version %d%s", path, version,
                 " (mid-request)" if mid_request else "")

    async def close(self) -> None:
        """Stop the scheduler, fail what is still waiting, release the worker thread."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        closed = RuntimeError("engine closed")
        futures: list[asyncio.Future[Generation] | asyncio.Future[None]] = [
            *(s.future for s in [*self._pending, *self._active]),
            *(w.future for w in self._swaps),
        ]
        for future in futures:
            if not future.done():
                future.set_exception(closed)
        self._pending, self._active, self._swaps = [], [], []
        await asyncio.to_thread(self._executor.shutdown, wait=True)

    # -- scheduler (event-loop side) ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine closed")

    def _kick(self) -> None:
        """Start the scheduler on first use (it needs the running loop) and wake it."""
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name="sisrl-local-engine")
        assert self._wake is not None
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        just_prefilled = False
        while True:
            self._pending = [s for s in self._pending if not s.future.done()]  # drop cancelled waiters
            if not self._active and not self._pending and not self._swaps:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._swaps and (self._swaps[0].mid_request or not self._active):
                await self._apply_swap(loop, self._swaps.pop(0))
                continue
            admit: list[_Slot] = []
            # Alternate prefill and decode so a stream of arrivals cannot stall running rows.
            if self._pending and not self._swaps and not (just_prefilled and self._active):
                room = self.max_batch_size - len(self._active)
                admit, self._pending = self._pending[:room], self._pending[room:]
            keep = [i for i, s in enumerate(self._active) if not s.future.done()]
            try:
                finished = await loop.run_in_executor(self._executor, self._step, keep, admit)
            except Exception as exc:  # a model failure fails the rows it touched, never the scheduler
                log.exception("local engine step failed")
                self._fail([*self._active, *admit], exc)
                continue
            just_prefilled = bool(admit)
            for slot in finished:
                if not slot.future.done():
                    slot.future.set_result(slot.generation())

    async def _apply_swap(self, loop: asyncio.AbstractEventLoop, swap: _Swap) -> None:
        self.prefix_cache.clear()  # computed under the old weights
        try:
            await loop.run_in_executor(self._executor, copy_safetensors, self.model, swap.path)
        except Exception as exc:
            # Tensors are copied one by one, so some may already be new: refuse to generate until a load succeeds.
            log.exception("weight swap to version %d failed", swap.version)
            self._torn = f"the weights are torn: loading {swap.path} failed half-way ({exc!r}); load a policy again"
            self._fail([*self._active, *self._pending], exc)
            self._pending = []
            swap.future.set_exception(exc)
            return
        self._torn = None
        self.policy_version = swap.version
        swap.future.set_result(None)
        self._active = [s for s in self._active if not s.future.done()]
        if not self._active:
            return
        try:  # running rows (mid-request swap): their cached keys/values are the old policy's
            finished = await loop.run_in_executor(self._executor, self._reprefill)
        except Exception as exc:
            log.exception("re-prefill after the weight swap to version %d failed", swap.version)
            self._fail(list(self._active), exc)
            return
        for slot in finished:
            if not slot.future.done():
                slot.future.set_result(slot.generation())

    def _fail(self, slots: list[_Slot], exc: Exception) -> None:
        for slot in slots:
            if not slot.future.done():
                slot.future.set_exception(RuntimeError(f"local engine failed: {exc!r}"))
        self._active = []
        self._batch.keep([])

    # -- one model step (worker-thread side) --------------------------------------------------------

    def _step(self, keep: list[int], admit: list[_Slot]) -> list[_Slot]:
        """Drop cancelled rows, then prefill `admit` or decode every row; returns the rows that finished."""
        self._batch.keep(keep)
        self._active = [self._active[i] for i in keep]
        if not admit and not self._active:  # every running row was cancelled (its client went away): no step
            return []
        if admit:
            for slot in admit:
                slot.version = self.policy_version
            pasts = [self.prefix_cache.take(s.prompt_ids) for s in admit]
            logits = self._batch.prefill([s.prompt_ids for s in admit], pasts)
            self._active.extend(admit)
            self._stats.prefill_passes += 1
            self._record(admit, logits)
        else:
            logits = self._batch.decode([s.token_ids[-1] for s in self._active])
            self._stats.max_batch_size = max(self._stats.max_batch_size, len(self._active))
            self._record(self._active, logits)
        finished = [s for s in self._active if s.finish_reason is not None]
        if finished:
            if self.prefix_cache.max_tokens:
                for i, s in enumerate(self._active):
                    if s.finish_reason is not None:  # its last sampled token was never fed: not in the cache
                        self.prefix_cache.put(s.prompt_ids + s.token_ids[:-1], self._batch.row_kv(i))
            rows = [i for i, s in enumerate(self._active) if s.finish_reason is None]
            self._batch.keep(rows)
            self._active = [self._active[i] for i in rows]
        return finished

    def _reprefill(self) -> list[_Slot]:
        """Rebuild the batch's cache under the current weights: every running row's prompt and sampled tokens
        are prefilled again, and its next token is sampled from the resulting logits (a decode step's work)."""
        slots = list(self._active)
        self._batch.keep([])
        self._active = []
        logits = self._batch.prefill([s.prompt_ids + s.token_ids for s in slots])
        self._active = slots
        self._stats.prefill_passes += 1
        self._record(slots, logits)
        finished = [s for s in slots if s.finish_reason is not None]
        if finished:
            rows = [i for i, s in enumerate(slots) if s.finish_reason is None]
            self._batch.keep(rows)
            self._active = [slots[i] for i in rows]
        return finished

    def _record(self, slots: list[_Slot], logits: torch.Tensor) -> None:
        """Sample one token per slot from q and record log q and the top-K. logits [n, V]."""
        logits = (
            logits.float().cpu()
        )  # sampling runs on CPU: same draws for a seed whatever the model's device
        temperature = torch.tensor([s.params.temperature for s in slots], dtype=torch.float32)  # [n]
        top_p = torch.tensor([s.params.top_p for s in slots], dtype=torch.float32)  # [n]
        logq = processed_logprobs(logits, temperature, top_p)  # [n, V]
        tokens = sample_tokens(logq, [s.params.greedy for s in slots], [s.generator for s in slots])  # [n]
        sampled = logq.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).clamp(min=MIN_LOGPROB)  # [n]
        k_max = max(s.params.logprobs_k for s in slots)
        top_ids, top_lps = topk_by_rank(logits, logq, k_max)  # [n, K_max]
        rows = zip(slots, tokens.tolist(), sampled.tolist(), top_ids.tolist(), top_lps.tolist(), strict=True)
        for slot, token, logprob, ids, lps in rows:
            k = slot.params.logprobs_k
            slot.token_ids.append(token)
            slot.token_versions.append(self.policy_version)
            slot.logprobs.append(logprob)
            slot.topk_ids.append(ids[:k])
            slot.topk_logprobs.append(lps[:k])
            slot.finish_reason = self._finish_reason(slot)
        self._stats.generated_tokens += len(slots)

    def _finish_reason(self, slot: _Slot) -> str | None:
        """vLLM's order: EOS, then stop strings, then the length limits."""
        if slot.token_ids[-1] in self.eos_ids:
            return "eos"
        if slot.stops.match(slot.token_ids) is not None:
            return "stop"
        total = len(slot.prompt_ids) + len(slot.token_ids)
        if len(slot.token_ids) >= slot.params.max_new_tokens or (
            self.max_positions is not None and total >= self.max_positions
        ):
            return "length"
        return None


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """EOS ids from the generation config (int or list) and the tokenizer."""
    ids: set[int] = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured is not None:
        ids.update(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
