"""One policy update's forward/backward on the demo policy: full layout vs compact logits vs frozen lower layers
vs the shared prompt prefix.

Every variant runs the trainer's own code (`sisrl.trainer.policy.policy_logits` + `sis.gather_logprobs`, one
backward) on the same batch: B search-agent-shaped sequences (a prompt, then a response in which only
`--policy-share` of the tokens are the policy's own, the rest inserted passages; the first `--shared` prompt
tokens, the instructions, the same in every row), SmolLM2-135M-Instruct in fp32,
alternating the variants `--repeats` times in one process. The table gives the median seconds per
forward+backward and the speed-up against the full layout with every layer trainable (the baseline).

    .venv/bin/python bench/update_cost.py                   # 8 x (150 prompt + 230 response) tokens
    .venv/bin/python bench/update_cost.py --batch 16 --trainable 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from record import write_record
from sisrl.common.hardware import cpu_model
from sisrl.common.models import smollm2_dir
from sisrl.trainer.batch import RolloutBatch
from sisrl.trainer.config import ModelConfig
from sisrl.trainer.policy import load_policy, policy_logits
from sisrl.trainer.sis import gather_logprobs


def make_batch(batch: int, prompt: int, response: int, policy_share: float, vocab: int, k: int,
               shared: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, prompt + response), generator=g)
    ids[:, :shared] = ids[0, :shared]  # the instructions every prompt starts with
    mask = torch.zeros(batch, response)
    n_policy = max(1, int(response * policy_share))
    for row in range(batch):  # policy tokens in three turns, passages between them
        cols = torch.linspace(0, response - 1, n_policy).long()
        mask[row, cols] = 1.0
    return RolloutBatch(
        input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(prompt + response).expand(batch, -1),
        response_ids=ids[:, prompt:], mask=mask, logq=torch.zeros(batch, response),
        topk_ids=torch.zeros(batch, response, k, dtype=torch.long), topk_logq=torch.zeros(batch, response, k),
        rewards=torch.zeros(batch), group_ids=tuple(str(i) for i in range(batch)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=150)
    p.add_argument("--response", type=int, default=230)
    p.add_argument("--policy-share", type=float, default=0.25, help="share of response tokens sampled by the policy")
    p.add_argument("--trainable", type=int, default=8, help="top layers trained in the frozen variant")
    p.add_argument("--shared", type=int, default=130, help="leading prompt tokens all rows share (the demo's "
                   "instructions: 130 of 150)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    # (name, trainable layers, compact logits, shared prefix)
    variants = [("full layout, all layers", None, False, False), ("compact logits, all layers", None, True, False),
                (f"compact logits, top {args.trainable} layers", args.trainable, True, False),
                ("compact logits + shared prefix, all layers", None, True, True),
                (f"compact logits + shared prefix, top {args.trainable} layers", args.trainable, True, True)]
    models = {}
    for _, layers, _, _ in variants:
        if layers not in models:
            models[layers] = load_policy(ModelConfig(path=str(smollm2_dir()), trainable_layers=layers), seed=0,
                                         device=torch.device("cpu"))[0]
    b = make_batch(args.batch, args.prompt, args.response, args.policy_share, models[None].config.vocab_size, 20,
                   shared=args.shared)
    times: dict[str, list[float]] = {name: [] for name, _, _, _ in variants}
    for _ in range(args.repeats):
        for name, layers, compact, shared in variants:
            model = models[layers]
            t0 = time.perf_counter()
            logits, view = policy_logits(model, b, compact=compact, shared_prefix=shared)
            logp = gather_logprobs(logits, view.response_ids, 1.0, 128)
            (-(torch.where(view.mask > 0, logp, 0.0)).sum()).backward()
            model.zero_grad(set_to_none=True)
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times[variants[0][0]])
    print(f"CPU: {cpu_model()}; torch threads {torch.get_num_threads()}; batch {args.batch} x ({args.prompt} prompt + "  # noqa: T201
          f"{args.response} response tokens, {args.policy_share:.0%} policy tokens, the first {args.shared} prompt "
          f"tokens common to all rows); median of {args.repeats}")
    print("| variant | s per forward+backward | speed-up |\n|---|---|---|")  # noqa: T201
    rows = [(name, round(statistics.median(times[name]), 3), round(base / statistics.median(times[name]), 3))
            for name, _, _, _ in variants]
    for label, med, speed_up in rows:
        print(f"| {label} | {med:.2f} | {speed_up:.2f}x |")  # noqa: T201
    rl = rows[-1]  # the demo's RL layout: compact logits + shared prefix, top layers only
    write_record(
        bench="update_cost", title="One policy update: compact logits, frozen layers, shared prompt prefix",
        measures="Seconds per forward + backward of the trainer's own log-prob path (policy_logits + "
                 "gather_logprobs) on one batch of search-agent-shaped sequences of SmolLM2-135M-Instruct in fp32, "
                 "each layout against the full layout with every layer trainable, alternating in one process.",
        summary=f"The demo's RL layout ({rl[0]}) runs a forward + backward {rl[2]:.2f}x faster than the full "
                f"layout with every layer trainable ({rl[1]:.2f} s against {base:.2f} s).",
        figures={f"s per forward+backward: {label}": med for label, med, _ in rows[1:]}
        | {f"speed-up: {label}": speed_up for label, _, speed_up in rows[1:]},
        baseline={"what": "full layout, all layers trainable, same process",
                  "figures": {f"s per forward+backward: {rows[0][0]}": rows[0][1]}},
        table={"columns": ["variant", "s per forward+backward (median)", "speed-up"], "rows": [list(r) for r in rows]},
        notes=f"batch {args.batch} x ({args.prompt} prompt + {args.response} response tokens), "
              f"{args.policy_share:.0%} policy tokens, the first {args.shared} prompt tokens shared by all rows; "
              f"median of {args.repeats}; torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
