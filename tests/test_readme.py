"""The README's code example runs as printed, on real tensors."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_sis_custom_loss_example_runs(capsys) -> None:  # noqa: ANN001
    text = README.read_text()
    block = re.search(r"## SIS inside your own loss\s+```python\n(.*?)```", text, re.S)
    assert block, "README lost its 'SIS inside your own loss' example"
    torch.manual_seed(0)
    b, t, v, k = 2, 5, 40, 4
    logits = torch.randn(b, t, v, requires_grad=True)
    q_logits = logits.detach() + 0.3 * torch.randn(b, t, v)
    tokens = torch.distributions.Categorical(logits=q_logits).sample()
    logq_full = torch.log_softmax(q_logits, -1)
    topk_logq, topk_ids = logq_full.topk(k, -1)
    scope = {
        "logits": logits, "tokens": tokens, "logq": logq_full.gather(-1, tokens[..., None])[..., 0],
        "topk_ids": topk_ids, "topk_logq": topk_logq, "mask": torch.ones(b, t), "adv": torch.tensor([1.0, -1.0]),
    }
    exec(compile(block.group(1), str(README), "exec"), scope)  # noqa: S102
    scope["loss"].backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert "sis/accept_rate" in capsys.readouterr().out
