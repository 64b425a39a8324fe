"""Policy setup (model, tokenizer, optimizer, schedule) and the forward pass that yields response logits.

Log-probs are never computed here: `response_logits` returns the [B, T, V] logits of the response positions
and `trainer/sis.py` gathers from them (in chunks when `model.logprob_chunk_size` is set).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from sisrl.common.atomic import atomic_dir
from sisrl.common.models import build_tiny_policy, cast_parameters, load_tokenizer, resolve_policy_path
from sisrl.trainer.batch import RolloutBatch
from sisrl.trainer.config import ModelConfig, OptimConfig
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

TINY = "tiny"


def load_policy(cfg: ModelConfig, *, seed: int, device: torch.device) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the policy in train mode on `device`, and its tokenizer. 'tiny' builds a random test model."""
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    if cfg.path == TINY:
        tokenizer = load_tokenizer()
        tiny = build_tiny_policy(tokenizer, hidden_size=cfg.tiny_hidden_size, seed=seed)
        model: PreTrainedModel = cast_parameters(tiny, dtype)  # buffers (rotary inv_freq) stay fp32
    else:
        path = resolve_policy_path(cfg.path)
        tokenizer = load_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if cfg.trainable_layers is not None:
        freeze_lower_layers(model, cfg.trainable_layers)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.to(device)  # type: ignore[arg-type]  # transformers' stub types `to` oddly; nn.Module.to is in place
    model.train()
    return model, tokenizer


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def lr_factor(step: int, *, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warm-up, then the schedule."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_updates: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        return lr_factor(step, total=total_updates, warmup=cfg.warmup_steps, schedule=cfg.schedule,
                         min_ratio=cfg.min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def autocast_context(enabled: bool, device: torch.device) -> contextlib.AbstractContextManager[None]:
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def response_logits(model: nn.Module, batch: RolloutBatch, *, autocast: bool = False) -> Tensor:
    """Logits that predict each response token: [B, T, V].

    The response occupies the last T columns of `input_ids`; the logit at column c predicts token c + 1, so we
    keep the last T + 1 positions (`logits_to_keep`, the prompt's lm_head is never computed) and drop the last.
    """
    if batch.compacted:
        raise ValueError("response_logits needs the batch in its padded layout, not a compacted token view")
    t = batch.response_len
    device = batch.input_ids.device
    with autocast_context(autocast, device):
        out = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            logits_to_keep=t + 1,
            use_cache=False,
        )
    # [B, T, V] in the model's output dtype: sis.py converts chunk by chunk, so bf16 logits never get a full
    # fp32 copy.
    return out.logits[:, :-1, :]


def policy_logits(model: nn.Module, batch: RolloutBatch, *, autocast: bool = False,
                  compact: bool = False, shared_prefix: bool = False) -> tuple[Tensor, RolloutBatch]:
    """Logits of the response tokens and the batch whose per-token fields line up with them.

    `compact=False`: `response_logits` and `batch` itself ([B, T, V]). `compact=True`: only the policy's own
    tokens (mask 1; in a search trajectory ~1 in 5, the rest are retrieved passages) are kept, moved to the
    left of each row: logits [B, T', V] with T' the most policy tokens in a row, and `batch.compact()`. The
    lm_head and every [.., V] pass after it (log-softmax, top-K, entropy) then run on T' instead of T
    positions; no [B, T, V] tensor is ever formed.

    The model's own forward runs (`logits_to_keep=T + 1`) with a pre-hook on its output head that keeps, of the
    [B, T + 1, H] hidden states it receives, the T' policy positions (`_head_input_at`). Running the whole
    forward rather than decoder and head apart is what lets a wrapper work: FSDP2 gathers the root unit's
    parameters (embeddings, final norm, lm_head) in the root module's forward hook, which a direct call to the
    decoder or the head would bypass; DDP prepares its gradient reduction in its forward. Whatever the forward
    does to the logits after the head (soft-capping, scaling) is elementwise and applies as before.

    `shared_prefix` (compact only): the leading prompt tokens all rows have in common run once (`prefix_inputs`).
    """
    head = _output_head(model) if compact else None
    if head is None:
        return response_logits(model, batch, autocast=autocast), batch
    view = batch.compact()
    assert view.positions is not None
    inputs: dict[str, Any] = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                              "position_ids": batch.position_ids, "use_cache": False}
    with autocast_context(autocast, batch.input_ids.device):
        shared = common_prefix_length(batch) if shared_prefix and _can_share_prefix(model) else 0
        if shared >= MIN_SHARED_PREFIX:
            inputs = prefix_inputs(model, batch, shared)
        with _head_input_at(head, view.positions):
            logits = model(**inputs, logits_to_keep=batch.response_len + 1).logits  # [B, T', V]
    if logits.shape[:2] != view.positions.shape:
        raise RuntimeError(f"{type(unwrap(model)).__name__}'s forward did not call its output head on the kept "
                           f"positions: logits {tuple(logits.shape)}, positions {tuple(view.positions.shape)}")
    return logits, view


@contextlib.contextmanager
def _head_input_at(head: nn.Module, positions: Tensor) -> Iterator[None]:
    """While open, `head` projects only `positions` ([B, T'] response columns) of the hidden states it is given:
    the last T + 1 positions [B, T + 1, H], of which column c predicts response token c + 1, so the last one
    goes and [B, T', H] stay."""

    def pick(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0][:, :-1]  # [B, T, H]
        return (hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])), *args[1:])

    handle = head.register_forward_pre_hook(pick)
    try:
        yield
    finally:
        handle.remove()


# Shorter common prefixes are not worth a second forward call.
MIN_SHARED_PREFIX = 16


def common_prefix_length(batch: RolloutBatch) -> int:
    """How many leading prompt tokens every row shares (same ids at positions 0, 1, ...), capped one short of the
    shortest prompt so that each row keeps a prompt token of its own; 0 for a single row.

    A search agent's prompts are the instructions followed by the question, so rows of different questions share
    the instructions (~130 of the demo's 150 prompt tokens), and the rows of one GRPO group share the whole prompt.
    """
    if batch.compacted:
        raise ValueError("common_prefix_length needs the batch in its padded layout")
    if batch.size < 2:
        return 0
    width = batch.input_ids.shape[1] - batch.response_len  # P: prompt columns, left-padded
    lengths = batch.attention_mask[:, :width].sum(dim=1)  # [B] real prompt tokens per row
    shortest = int(lengths.min())
    if shortest < 2:
        return 0
    cols = (width - lengths).unsqueeze(1) + torch.arange(shortest - 1, device=lengths.device)  # [B, shortest - 1]
    ids, positions = batch.input_ids.gather(1, cols), batch.position_ids.gather(1, cols)
    same = (ids == ids[:1]).all(dim=0) & (positions == torch.arange(shortest - 1, device=lengths.device)).all(dim=0)
    return int(same.long().cumprod(dim=0).sum())


def prefix_inputs(model: nn.Module, batch: RolloutBatch, shared: int) -> dict[str, Any]:
    """Run the first `shared` prompt tokens, common to every row (`common_prefix_length`), once; return the forward
    inputs of the rest of the batch with their keys/values as its cache. `model(**inputs, logits_to_keep=T + 1)`
    then gives the full forward's last T + 1 logits.

    The prefix runs as one row; its keys/values, expanded to B rows, are the cache for the rest: the last R + T
    columns of the batch (R = the longest prompt remainder), in which the columns a row's prefix already covers are
    masked out. Positions stay the batch's own, so every real token sees the same keys, values and positions as in
    the full forward: same hidden states (up to float round-off) and, through the expanded cache, the same
    gradients, the prefix's summed over the rows.
    """
    width = batch.input_ids.shape[1] - batch.response_len
    lengths = batch.attention_mask[:, :width].sum(dim=1)  # [B]
    rest = lengths - shared  # [B] >= 1 prompt tokens after the prefix
    start = width - int(rest.max())  # first column of the remainder block
    first = int(width - lengths[0])
    device = batch.input_ids.device
    ids = batch.input_ids[:1, first:first + shared]  # [1, shared]
    kw = _cache_keyword(unwrap(model))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                position_ids=torch.arange(shared, device=device).unsqueeze(0), use_cache=True, logits_to_keep=1)
    # The prefix's one logit row [1, 1, V] joins the rest's input with weight 0 (`anchor`): a gradient (of zeros)
    # then reaches every layer's prefix output, whose FSDP2 pre-backward hook gathers that layer's weights again
    # before the backward of its prefix keys/values runs. Without it the last layer's prefix output, which feeds
    # only this unused logit, gets no gradient, its hook never fires, and its keys/values' backward (reached only
    # through the cache, after the layer has resharded) finds the weights freed.
    anchor = out.logits.sum() * 0.0
    cache = getattr(out, kw)
    layers = [(layer.keys.expand(batch.size, -1, -1, -1), layer.values.expand(batch.size, -1, -1, -1))
              for layer in cache.layers]
    cols = torch.arange(start, batch.input_ids.shape[1], device=device)  # [R + T]
    mask = batch.attention_mask[:, start:] * (cols.unsqueeze(0) >= (width - rest).unsqueeze(1))  # [B, R + T]
    full_mask = torch.cat([torch.ones(batch.size, shared, dtype=mask.dtype, device=device), mask], dim=1)
    layers[0] = (layers[0][0] + anchor, layers[0][1])
    return {"input_ids": batch.input_ids[:, start:], "attention_mask": full_mask,
            "position_ids": batch.position_ids[:, start:], "use_cache": True, kw: DynamicCache(ddp_cache_data=layers)}


def _cache_keyword(decoder: nn.Module) -> str:
    """transformers 5 renamed `past_key_values` to `cache` (argument and output field); either release works."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def _can_share_prefix(model: nn.Module) -> bool:
    """Whether the prefix may run as a forward of its own. Not under DDP: a second forward before the backward
    trips its reducer ("Expected to have finished reduction in the prior iteration"). Not with gradient
    checkpointing in training: it turns the cache off, so the prefix's keys/values could not be reused."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return False
    inner = unwrap(model)
    return not (inner.training and any(getattr(m, "gradient_checkpointing", False) for m in inner.modules()))


def _output_head(model: nn.Module) -> nn.Module | None:
    """The output head (lm_head) of a transformers causal LM, plain or under DDP / FSDP2, whose forward takes
    `logits_to_keep`; None for anything else, and the caller then keeps every position."""
    inner = unwrap(model)
    if not isinstance(inner, PreTrainedModel) or "logits_to_keep" not in inspect.signature(inner.forward).parameters:
        return None
    head = inner.get_output_embeddings()
    return head if isinstance(head, nn.Module) else None


def freeze_lower_layers(model: PreTrainedModel, trainable: int) -> None:
    """Train only the top `trainable` decoder layers and the final norm; everything else stops needing grad."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"model.trainable_layers={trainable}: {type(model).__name__} has no decoder layer list")
    if trainable > len(layers):
        raise ValueError(f"model.trainable_layers={trainable}: the model has only {len(layers)} decoder layers")
    model.requires_grad_(False)
    for layer in layers[len(layers) - trainable:]:
        layer.requires_grad_(True)
    norm = getattr(decoder, "norm", None)
    if isinstance(norm, nn.Module):
        norm.requires_grad_(True)


def unwrap(model: nn.Module) -> nn.Module:
    """The module under a DDP wrapper (FSDP2 shards in place and needs no unwrapping)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def save_hf_directory(model: nn.Module, tokenizer: PreTrainedTokenizerBase, out: Path) -> Path:
    """Write a Hugging Face safetensors directory (what the gateway's engine loads) durably: into a temp directory
    beside `out`, every file fsynced, then renamed (`common/atomic.atomic_dir`). A push killed midway leaves only
    `.NAME.tmp-*`, which the trainer's next start removes (`sweep_temps`). One process only (an SFT result, an
    evaluated model); the training loop's pushes are `trainer/push.py`'s."""
    base = unwrap(model)
    if not isinstance(base, PreTrainedModel):
        raise TypeError(f"expected a transformers PreTrainedModel, got {type(base).__name__}")
    with atomic_dir(out, overwrite=True) as tmp:
        base.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return out


@contextlib.contextmanager
def no_grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce for accumulation micro-batches (DDP `no_sync`, FSDP2 flag)."""
    if not enabled:
        yield
        return
    no_sync: Any = getattr(model, "no_sync", None)
    set_sync: Any = getattr(model, "set_requires_gradient_sync", None)
    if no_sync is not None:
        with no_sync():
            yield
    elif set_sync is not None:
        set_sync(False)
        try:
            yield
        finally:
            set_sync(True)
    else:
        yield
