"""The wire contract on a real uvicorn process: the exact bodies Search-R1, verl and SkyRL send, the shapes they
parse, and a 4xx with a reason for every bad input.

Client request bodies (facts of their wire format, read from their sources):
- Search-R1 trainer, `search_r1/llm_agent/generation.py` `_batch_search`: {"queries": [...], "topk": 3,
  "return_scores": True}; it reads `["result"]`, then per query `doc_item["document"]["contents"]`.
- verl SearchTool, `verl/tools/utils/search_r1_like_utils.py` `call_search_api`: the same three keys with
  `return_scores=True`, Content-Type/Accept application/json; it reads `item["document"]["contents"]`.
- SkyRL search env, `skyrl_gym/tools/search.py` `SearchToolGroup.search`: one stripped query as
  {"queries": [query], "topk": 3, "return_scores": True}; older SkyRL servers also take {"query": str}.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from .conftest import TOPICS, Server

JSON_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}


def _titles(result: list[list[dict[str, object]]]) -> list[str]:
    return [str(row[0]["document"]["contents"]).split("\n")[0] for row in result]  # type: ignore[index]


def _assert_scored_shape(body: dict[str, object], n_queries: int, k: int) -> None:
    assert set(body) == {"result"}
    result = body["result"]
    assert isinstance(result, list) and len(result) == n_queries
    for row in result:
        assert len(row) == k
        scores = []
        for item in row:
            assert set(item) == {"document", "score"} and set(item["document"]) == {"id", "contents"}
            assert isinstance(item["document"]["id"], str) and isinstance(item["document"]["contents"], str)
            scores.append(item["score"])
        assert scores == sorted(scores, reverse=True) and all(-1.0001 <= s <= 1.0001 for s in scores)


def test_search_r1_trainer_batch(minilm_server: Server) -> None:
    queries = ["When was the Eiffel Tower completed?", "Who discovered penicillin?", "largest hot desert"]
    response = httpx.post(f"{minilm_server.url}/retrieve", json={"queries": queries, "topk": 3, "return_scores": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/json")
    body = response.json()
    _assert_scored_shape(body, 3, 3)
    assert _titles(body["result"]) == ['"Eiffel Tower"', '"Penicillin"', '"Sahara"']
    # Search-R1's _passages2string: title = first line of contents, text = the rest.
    first = body["result"][0][0]["document"]["contents"]
    assert first.split("\n")[1].startswith("The Eiffel Tower is a wrought-iron")


def test_verl_search_tool_body(minilm_server: Server) -> None:
    payload = {"queries": ["coldest continent", "Japanese paper folding"], "topk": 3, "return_scores": True}
    response = httpx.post(f"{minilm_server.url}/retrieve", headers=JSON_HEADERS, json=payload, timeout=30)
    response.raise_for_status()
    _assert_scored_shape(response.json(), 2, 3)
    assert _titles(response.json()["result"]) == ['"Antarctica"', '"Origami"']


def test_skyrl_single_query_forms(minilm_server: Server) -> None:
    listed = minilm_server.retrieve({"queries": ["who wrote Hamlet".strip()], "topk": 3, "return_scores": True})
    _assert_scored_shape(listed.json(), 1, 3)
    single = minilm_server.retrieve({"query": "who wrote Hamlet", "topk": 3, "return_scores": True})
    assert single.status_code == 200 and single.json() == listed.json()
    assert _titles(single.json()["result"]) == ['"Shakespeare"']


def test_without_scores_each_item_is_the_document(minilm_server: Server) -> None:
    scored = minilm_server.retrieve({"queries": ["marsupial that hops"], "topk": 2, "return_scores": True}).json()
    plain = minilm_server.retrieve({"queries": ["marsupial that hops"], "topk": 2, "return_scores": False}).json()
    assert plain == {"result": [[item["document"] for item in scored["result"][0]]]}
    assert plain["result"][0][0]["contents"].startswith('"Kangaroo"')


def test_default_topk_and_order_with_duplicates(minilm_server: Server) -> None:
    queries = ["the Moon landing", "chess board game", "the Moon landing", "chess board game", "violin"]
    body = minilm_server.retrieve({"queries": queries}).json()
    assert [len(row) for row in body["result"]] == [3] * 5  # Search-R1's default topk
    assert body["result"][0] == body["result"][2] and body["result"][1] == body["result"][3]
    assert [row[0]["id"] for row in body["result"]] == ["doc11", "doc8", "doc11", "doc8", "doc18"]


def test_topk_bounds_are_inclusive(minilm_server: Server) -> None:
    assert len(minilm_server.retrieve({"queries": ["x"], "topk": 1}).json()["result"][0]) == 1
    # 100 is allowed; a 40-passage index simply has 40 to give.
    assert len(minilm_server.retrieve({"queries": ["x"], "topk": 100}).json()["result"][0]) == len(TOPICS)


@pytest.mark.parametrize(
    ("body", "needle"),
    [({"queries": [], "topk": 3}, "at least 1 item"),
     ({"queries": ["a"], "topk": 0}, "greater than or equal to 1"),
     ({"queries": ["a"], "topk": 101}, "less than or equal to 100"),
     ({"queries": ["a"], "topk": "many"}, "valid integer"),
     ({"queries": "not a list"}, "valid list"),
     ({"topk": 3}, "exactly one of 'queries'"),
     ({"queries": ["a"], "query": "b"}, "exactly one of 'queries'"),
     ({"queries": ["q"] * 65}, "65 queries in one request; the limit is 64")],
)
def test_bad_requests_get_a_422_with_the_reason(minilm_server: Server, body: dict[str, object], needle: str) -> None:
    response = minilm_server.retrieve(body)
    assert response.status_code == 422, response.text
    assert needle in response.text


def test_oversized_bodies_get_a_413(minilm_server: Server) -> None:
    big = {"queries": ["x" * 70_000]}
    response = minilm_server.retrieve(big)
    assert response.status_code == 413 and "exceeds the limit of 65536 bytes" in response.json()["detail"]

    def chunks() -> object:  # no Content-Length: the limit must hold while the body streams in
        data = json.dumps(big).encode()
        for start in range(0, len(data), 8192):
            yield data[start:start + 8192]

    streamed = httpx.post(f"{minilm_server.url}/retrieve", content=chunks(), headers=JSON_HEADERS)  # type: ignore[arg-type]
    assert streamed.status_code == 413 and "max_body_bytes" in streamed.text


def test_malformed_json_is_a_4xx(minilm_server: Server) -> None:
    response = httpx.post(f"{minilm_server.url}/retrieve", content=b'{"queries": [', headers=JSON_HEADERS)
    assert response.status_code == 422 and "json_invalid" in response.text


def test_over_long_query_is_truncated_not_refused(minilm_server: Server) -> None:
    long_query = "Eiffel Tower in Paris " + "padding words " * 3000  # ~45 k characters, far past 256 tokens
    response = minilm_server.retrieve({"queries": [long_query], "topk": 1})
    assert response.status_code == 200
    assert response.json()["result"][0][0]["id"] == "doc0"


def test_request_id_is_echoed_and_metrics_count_requests(minilm_server: Server) -> None:
    response = minilm_server.retrieve({"queries": ["honey bees"]}, headers={"X-Request-ID": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    assert len(httpx.post(f"{minilm_server.url}/retrieve", json={"queries": ["x"]}).headers["x-request-id"]) == 32
    minilm_server.retrieve({"queries": ["honey bees"]})  # the same query again: a cache hit
    text = httpx.get(f"{minilm_server.url}/metrics").text
    for name in ("sisrl_retriever_requests_total", "sisrl_retriever_request_latency_seconds_bucket",
                 "sisrl_retriever_encoder_batch_queries_count", "sisrl_retriever_request_queries_count",
                 "sisrl_retriever_cache_hit_rate"):
        assert name in text
    hits = next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("sisrl_retriever_cache_hits_total"))
    assert hits >= 1


def test_health_and_openapi(minilm_server: Server) -> None:
    health = httpx.get(f"{minilm_server.url}/health").json()
    assert health["status"] == "ok" and health["passages"] == len(TOPICS) and health["encoder"] == "minilm"
    schema = httpx.get(f"{minilm_server.url}/openapi.json").json()
    assert {"/retrieve", "/health", "/metrics"} <= set(schema["paths"])
    assert "RetrieveRequest" in schema["components"]["schemas"]


def test_health_names_the_faiss_build_and_the_encoder_dtype(minilm_server: Server, minilm_index: Path) -> None:
    import faiss
    from sisrl.retriever.manifest import load_manifest

    health = httpx.get(f"{minilm_server.url}/health").json()
    assert health["faiss_version"] == faiss.__version__
    assert health["faiss_simd"] == faiss.SIMDConfig.get_level_name()  # this process loads the same wheel
    assert health["faiss_simd"] != "NONE" or "avx2" not in open("/proc/cpuinfo").read()
    assert health["encoder_dtype"] == "float32"  # the server's --dtype float32 (tests/retriever/conftest.py)
    assert health["encoder_forward"] == ("onnx" if health["encoder_backend"] == "onnx" else "traced")
    # the fixture's build states float32 (conftest.py); the E5 recall test checks what `--dtype auto` records
    assert load_manifest(minilm_index).build_dtype == "float32"
