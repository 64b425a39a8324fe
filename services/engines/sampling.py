"""Pure sampling math shared by the local engine: the processed distribution q, sampling, top-K, stop strings.

q is the distribution a token is actually drawn from (docs/design.md, "Behaviour top-K"): logits / temperature,
then top-p masking (removed tokens get -inf), renormalised with log-softmax. Greedy rows (temperature 0) use
temperature 1 and no top-p. Shapes: B = rows, V = vocabulary, K = recorded top-K.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from sisrl.services.engines.base import GREEDY_TEMPERATURE, MIN_LOGPROB
from transformers import PreTrainedTokenizerBase


def top_p_mask(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside the nucleus. scaled [B, V], top_p [B] in (0, 1] -> [B, V].

    A token is kept when the mass of the tokens ranked strictly above it is < top_p, so the most probable
    token is always kept and the kept set is the smallest prefix (by rank) holding at least top_p of the mass.
    """
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, V]
    probs = sorted_logits.softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs  # [B, V] mass of strictly higher-ranked tokens
    remove_sorted = mass_above >= top_p.unsqueeze(-1)
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return scaled.masked_fill(remove, float("-inf"))


def processed_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """log q for each row. logits [B, V] (any float dtype), temperature [B] (< 1e-5 = greedy), top_p [B] -> [B, V] fp32."""
    logits = logits.float()
    greedy = temperature < GREEDY_TEMPERATURE
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)  # [B, 1]
    scaled = logits / scale
    # Only rows that ask for a nucleus are masked: with top_p = 1 fp32 cumsum round-off could cut the tail.
    nucleus = (top_p < 1.0) & ~greedy
    if bool(nucleus.any()):
        rows = nucleus.nonzero().squeeze(-1)
        scaled[rows] = top_p_mask(scaled[rows], top_p[rows])
    return torch.log_softmax(scaled, dim=-1)


def sample_tokens(
    logprobs: torch.Tensor, greedy: Sequence[bool], generators: Sequence[torch.Generator], block: int = 1024
) -> torch.Tensor:
    """Draw one token per row from exp(logprobs) with that row's own generator. [B, V] -> [B] long.

    Inverse-CDF sampling with one uniform per row from the row's generator, so a seeded request is reproducible
    whatever else shares its batch. The CDF is two-level to stay cheap at a 49k vocabulary: the running total
    of `block`-sized slice sums picks the slice, then an fp64 cumulative sum inside that slice picks the token.
    A token of probability 0 (removed by top-p) is never drawn.
    """
    rows, vocab = logprobs.shape
    probs = logprobs.float().exp()  # [B, V]
    pad = (-vocab) % block
    blocks = (F.pad(probs, (0, pad)) if pad else probs).view(rows, -1, block)  # [B, nb, block]
    block_cdf = blocks.sum(-1).double().cumsum(-1)  # [B, nb]; fp32 pairwise sums, fp64 running total
    u = torch.stack([torch.rand((), dtype=torch.float64, generator=g) for g in generators])  # [B] in [0, 1)
    # (1 - u) * total lies in (0, total]: the first CDF entry that reaches it belongs to a token with mass > 0.
    target = ((1.0 - u) * block_cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    b = torch.searchsorted(block_cdf, target).clamp(max=block_cdf.shape[-1] - 1)  # [B, 1] chosen slice
    before = torch.where(b > 0, block_cdf.gather(-1, (b - 1).clamp(min=0)), torch.zeros_like(target))
    inside = blocks.gather(1, b.unsqueeze(-1).expand(-1, -1, block)).squeeze(1)  # [B, block]
    i = torch.searchsorted(inside.cumsum(-1, dtype=torch.float64), target - before)  # [B, 1]
    # Round-off may push the residual past the slice's last token: take its last token with mass instead.
    last = (inside > 0).long().mul(torch.arange(block)).argmax(-1, keepdim=True)  # [B, 1]
    drawn = (b * block + torch.minimum(i, last)).squeeze(-1)  # [B]
    return torch.where(torch.tensor(list(greedy)), logprobs.argmax(dim=-1), drawn)


def topk_by_rank(logits: torch.Tensor, logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K ids of q and their log q, most probable first. logits, logprobs [B, V] -> ([B, K], [B, K]).

    Ranked by the raw logits: temperature and top-p keep that order (top-p keeps a rank prefix), and the raw
    logits still order the tokens top-p removed, which all share log q = -inf. Values floored at MIN_LOGPROB.
    """
    ids = logits.float().topk(k, dim=-1).indices
    return ids, logprobs.gather(-1, ids).clamp(min=MIN_LOGPROB)


class StopChecker:
    """Detects stop strings in the decoded text of the generated tail (detection only; ids are never re-encoded)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._stops = tuple(stops)
        # Each token that overlaps a stop string holds at least one of its UTF-8 bytes, so a stop string that
        # ends in the newest token lies within the last len(stop.encode()) tokens (+1 for slack).
        self._window = max((len(s.encode("utf-8", "surrogatepass")) for s in self._stops), default=0) + 1

    def match(self, generated: Sequence[int]) -> str | None:
        """The stop string that the generated ids now contain, if any. Called after each new token."""
        if not self._stops:
            return None
        text = self._tokenizer.decode(
            list(generated[-self._window :]), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        for stop in self._stops:
            if stop in text:
                return stop
        return None
