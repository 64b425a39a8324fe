"""Baseline for bench/retriever.py: Search-R1's serving algorithm on a sisrl index, with the same encoder.

What it reproduces (from Search-R1's `search_r1/search/retrieval_server.py`, facts only):
- a plain `def` FastAPI handler (run in FastAPI's thread pool) that calls `batch_search` directly;
- every query of every request is encoded, in batches of `retrieval_batch_size` (512): no dedupe, no cache,
  no coalescing of concurrent requests;
- its encoder is plain transformers: `AutoTokenizer(use_fast=True)` + `AutoModel`, each batch tokenised in
  request order with `padding=True, truncation=True, max_length=256` (padded to its longest query, no length
  sorting), one forward pass, attention-masked mean pooling, L2 normalisation, float32 numpy; the e5 prefix
  `query: ` before each query;
- after `index.search`, passages are fetched with a Python loop over the row ids (`load_docs`) from the corpus
  loaded with `datasets.load_dataset("json", ...)`; the response is a dict FastAPI encodes itself.
The model, its prefix and the FAISS file are the ones the index manifest names, so recall must equal sisrl's
within float noise. bench/peer_check.py runs it side by side with the real server on one machine (Search-R1's
own file through bench/search_r1_cpu.py), the same workloads and the top-3 of 100 questions; its records are in
docs/results.md.

    python bench/baseline_retriever.py --index DIR --port 8001
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from sisrl.retriever.encoder import resolve_model
from sisrl.retriever.index import load_faiss
from sisrl.retriever.manifest import load_manifest

RETRIEVAL_BATCH_SIZE = 512  # Search-R1's default retrieval_batch_size
QUERY_MAX_LENGTH = 256  # Search-R1's default retrieval_query_max_length
DEFAULT_TOPK = 3


class QueryRequest(BaseModel):
    queries: list[str]
    topk: int | None = None
    return_scores: bool = False


def load_corpus(path: Path, cache_dir: Path) -> Any:
    """The corpus as a `datasets` table (Search-R1's `load_corpus`); a list of dicts if datasets is missing."""
    try:
        import datasets
    except ImportError:
        import json

        return [json.loads(line) for line in path.open(encoding="utf-8")]
    return datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(cache_dir))


class PlainEncoder:
    """Search-R1's query encoder as it behaves: HF tokenizer + model, padded to the batch's longest, mean pooled."""

    def __init__(self, model: str, prefix: str, dtype: str, device: str) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.torch = torch
        self.device = "cuda" if device == "auto" and torch.cuda.is_available() else \
            ("cpu" if device == "auto" else device)
        self.tokenizer = AutoTokenizer.from_pretrained(model, use_fast=True)
        self.model = AutoModel.from_pretrained(model).eval().to(self.device)
        if dtype == "float16":  # Search-R1's --use_fp16 (GPU)
            self.model = self.model.half()
        self.prefix = prefix

    def encode_queries(self, queries: list[str]) -> Any:
        torch = self.torch
        inputs = self.tokenizer([self.prefix + q for q in queries], max_length=QUERY_MAX_LENGTH, padding=True,
                                truncation=True, return_tensors="pt").to(self.device)
        with torch.no_grad():
            hidden = self.model(**inputs).last_hidden_state  # [batch, tokens, dim]
            mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [batch, tokens, 1]
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1)
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return pooled.float().cpu().numpy().astype("float32", order="C")


class BaselineRetriever:
    def __init__(self, index_dir: Path, dtype: str, device: str) -> None:
        manifest = load_manifest(index_dir)
        self.encoder = PlainEncoder(resolve_model(manifest.encoder.model), manifest.encoder.query_prefix, dtype,
                                    device)
        self.index = load_faiss(index_dir, count=manifest.count, dim=manifest.dim)
        self.corpus = load_corpus(index_dir / "docs.jsonl", index_dir.parent / f".{index_dir.name}-baseline-cache")

    def batch_search(self, queries: list[str], num: int) -> tuple[list[list[dict[str, Any]]], list[list[float]]]:
        results: list[list[dict[str, Any]]] = []
        scores: list[list[float]] = []
        for start in range(0, len(queries), RETRIEVAL_BATCH_SIZE):
            batch = queries[start:start + RETRIEVAL_BATCH_SIZE]
            embeddings = self.encoder.encode_queries(batch)
            batch_scores, batch_idxs = self.index.search(embeddings, k=num)
            flat = batch_idxs.flatten().tolist()
            docs = [self.corpus[int(i)] for i in flat]  # Search-R1's load_docs: one Python lookup per hit
            results.extend(docs[i * num:(i + 1) * num] for i in range(len(batch)))
            scores.extend(batch_scores.tolist())
        return results, scores


def create_app(retriever: BaselineRetriever) -> FastAPI:
    app = FastAPI(title="baseline retriever (Search-R1 algorithm)")

    @app.post("/retrieve")
    def retrieve(request: QueryRequest) -> dict[str, Any]:
        k = request.topk or DEFAULT_TOPK
        results, scores = retriever.batch_search(request.queries, k)
        if request.return_scores:
            return {"result": [[{"document": doc, "score": score} for doc, score in zip(docs, row, strict=True)]
                               for docs, row in zip(results, scores, strict=True)]}
        return {"result": results}

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, required=True, help="sisrl index directory (required)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8001, help="TCP port (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", help="encoder dtype (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="encoder device (default: %(default)s)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    app = create_app(BaselineRetriever(args.index, args.dtype, args.device))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
