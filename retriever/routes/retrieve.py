"""POST /retrieve: Search-R1's retrieval endpoint (docs/design.md, "Retrieval")."""

from __future__ import annotations

import json

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response
from sisrl.retriever.deps import AdmissionDep, Authorized, MetricsDep, ServiceDep, SettingsDep
from sisrl.retriever.schemas import RetrieveRequest, RetrieveResponse
from sisrl.retriever.searcher import Hit

router = APIRouter(tags=["retrieve"], dependencies=[Authorized])


@router.post("/retrieve", response_model=RetrieveResponse,
             responses={413: {"description": "body too large"}, 422: {"description": "invalid request"},
                        429: {"description": "busy: max_in_flight requests run and max_queued wait (Retry-After)"},
                        503: {"description": "past the request deadline, request_timeout_s (Retry-After)"}})
async def retrieve(body: RetrieveRequest, request: Request, service: ServiceDep, settings: SettingsDep,
                   metrics: MetricsDep, admission: AdmissionDep) -> Response:
    """Top-k passages for each query, one list per query in request order."""
    queries = body.query_list()
    if len(queries) > settings.max_queries:
        raise HTTPException(422, detail=f"{len(queries)} queries in one request; the limit is {settings.max_queries} "
                                        "(setting max_queries)")
    metrics.request_queries.observe(len(queries))
    k = body.topk or settings.default_topk
    results = await admission.run(request, service.retrieve(queries, k))
    # Serialised by hand: the body is RetrieveResponse's shape (checked by the contract and schemathesis
    # tests), and skipping pydantic validation of up to max_queries x 100 items keeps large batches fast.
    payload = {"result": [_render(hits, body.return_scores) for hits in results]}
    return Response(json.dumps(payload, ensure_ascii=False), media_type="application/json")


def _render(hits: list[Hit], with_scores: bool) -> list[dict[str, object]]:
    if with_scores:
        return [{"document": {"id": p.id, "contents": p.contents}, "score": score} for p, score in hits]
    return [{"id": p.id, "contents": p.contents} for p, _ in hits]
