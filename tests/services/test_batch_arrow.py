"""`GET /v1/batches/{id}/trajectories.arrow` of a real store-only gateway on loopback, read by the trainer's
Arrow client (trainer/arrow_batch.py): the same collated tensors as the JSON form bit for bit, paging that covers
every trajectory once, and pages cut or corrupted on the way refused with the batch and page named. The store
holds seeded random trajectories (float32 log-probs drawn at random, so an equality test can fail) written with
the store's own `add_trajectory`."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pyarrow as pa
import pytest
import torch
from sisrl.common import arrow_wire
from sisrl.services import arrow_pages, store
from sisrl.services.schemas import RolloutCreate
from sisrl.services.schemas import Trajectory as StoredTrajectory
from sisrl.trainer.arrow_batch import (
    collate_arrow,
    collate_trajectories,
    decode_page,
    fetch_trajectories,
    page_trajectories,
    trajectories_to_batch,
)
from sisrl.trainer.batch import Trajectory, collate, plain
from sisrl.trainer.gateway_client import GatewayClient, GatewayError
from sqlalchemy import event, update

from tests.services.conftest import rollout_body

BATCH = "batch-arrow"
RUNNING = "batch-running"
FAILED = "batch-failed"
HALF = "batch-half"  # the same trajectories as BATCH, stored as a gateway with topk_logprobs_dtype float16 does
N = 10
K = 4


def _trajectory(i: int, rng: np.random.Generator) -> StoredTrajectory:
    n_p, n_r = int(rng.integers(3, 9)), int(rng.integers(0, 23)) if i else 0  # the first one has no tokens
    mask = (rng.random(n_r) < 0.7).astype(int)
    logq = np.where(mask > 0, -rng.exponential(1.0, n_r), 0.0).astype(np.float32)
    top_lp = np.sort(-rng.exponential(2.0, (n_r, K)).astype(np.float32), axis=1)[:, ::-1]
    versions = np.where(mask > 0, 3 + (np.arange(n_r) > n_r // 2), -1)  # a load mid-trajectory
    return StoredTrajectory(
        id=f"t{i}", batch_id=BATCH, item_id=f"q{i // 2}", group_id=f"g{i // 2}", run="arrow", step=0,
        data_source="nq" if i % 3 else "hotpotqa", question=f"question {i}?", golden_answers=["a"],
        prompt_ids=rng.integers(0, 50_000, n_p).tolist(), response_ids=rng.integers(0, 50_000, n_r).tolist(),
        loss_mask=mask.tolist(), behaviour_logprobs=logq.tolist(),
        topk_ids=rng.integers(0, 50_000, (n_r, K)).tolist() if n_r else [], topk_logprobs=top_lp.tolist() if n_r else [],
        token_versions=versions.tolist(), turns=[{"query": f"q {i}", "doc_ids": ["7", "9"], "scores": [0.25, 0.125]}],
        finish_reason="answer", answer=None if i % 4 == 0 else "a", reward=float(rng.random()),
        reward_parts={"em": float(i % 2), "f1": 0.5, "format": 0.0}, policy_version=3, timings={"total_s": 1.0},
        error="boom" if i == 5 else None,
    )


@pytest.fixture(scope="module")
def gateway(start_gateway: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A store-only gateway over a store with a done batch of N random trajectories and a running one."""
    db_url = f"sqlite:///{tmp_path_factory.mktemp('arrow') / 'rollouts.db'}"
    sessions = store.open_db(db_url)
    rng = np.random.default_rng(11)
    items = [{"id": f"q{i}", "question": f"question {i}?", "golden_answers": ["a"], "data_source": "nq"}
             for i in range(N // 2)]
    request = RolloutCreate.model_validate(rollout_body(items, run="arrow", samples_per_item=2)).model_dump_json()
    with sessions() as s:
        for batch_id, state in ((BATCH, "done"), (RUNNING, "running"), (FAILED, "failed"), (HALF, "done")):
            store.create_batch(session=s, batch_id=batch_id, run="arrow", step=0, idempotency_key=None,
                               request_hash="-", request_json=request, total=N)
            store.set_batch_status(session=s, batch_id=batch_id, status=state)
        for i in range(N):
            traj = _trajectory(i, rng)
            assert store.add_trajectory(session=s, trajectory=traj, sample_index=i % 2)
            half = traj.model_copy(update={"id": f"h{i}", "batch_id": HALF, "run": "arrow-half",
                                           "topk_logprobs": arrow_wire.round_to_half(traj.topk_logprobs)})
            assert store.add_trajectory(session=s, trajectory=half, sample_index=i % 2)
        # t3 as a store from before token_versions holds it: both forms give policy_version at policy tokens
        s.execute(update(store.TrajectoryRow).where(store.TrajectoryRow.id == "t3").values(token_versions=None))
        s.commit()
    store.dispose(sessions)
    yield start_gateway("--store-only", db_url=db_url)


def _json_trajectories(gw: Any, batch_id: str = BATCH) -> list[Trajectory]:
    body = gw.client.get(f"/v1/batches/{batch_id}").raise_for_status().json()
    assert body["status"] == "done" and len(body["trajectories"]) == N
    return [Trajectory.from_json(t) for t in body["trajectories"]]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32) if x.dtype == torch.float32 else x


def test_arrow_and_json_give_the_same_tensors_bit_for_bit(gateway: Any) -> None:
    from_json = _json_trajectories(gateway)
    from_arrow = fetch_trajectories(gateway.client, BATCH, page_size=3)
    assert from_arrow == from_json  # every field, token versions, turns and errors included
    assert [plain(t.token_versions) for t in from_arrow] == [t.token_versions for t in from_json]
    assert set(plain(from_arrow[3].token_versions)) == {-1, 3}  # the stored NULL, as `policy_version`
    whole = gateway.client.get(f"/v1/batches/{BATCH}/trajectories.arrow", params={"limit": N})
    page = decode_page(whole.content, whole.headers, batch_id=BATCH, offset=0)
    b = collate(from_json, pad_id=0, k=K)
    # the trainer's collate of either form, and the vectorised collate of the page itself (k < K: truncation)
    for a in (collate(from_arrow, pad_id=0, k=K), collate_arrow(page, pad_id=0, k=K),
              collate_trajectories(from_arrow, pad_id=0, k=K, chunk=2),
              collate_arrow(trajectories_to_batch(from_json), pad_id=0, k=K)):
        for name in ("input_ids", "attention_mask", "position_ids", "response_ids", "mask", "logq", "topk_ids",
                     "topk_logq", "rewards"):
            assert torch.equal(_bits(getattr(a, name)), _bits(getattr(b, name))), name
        assert a.group_ids == b.group_ids
    short_k = collate_arrow(page, pad_id=0, k=K - 1)
    assert torch.equal(short_k.topk_logq, collate(from_json, pad_id=0, k=K - 1).topk_logq)
    assert float(a.mask.sum()) > 50 and float(a.logq.abs().sum()) > 1.0  # the batch holds real, non-zero tokens


def test_top_k_log_probs_stored_as_half_floats_travel_in_two_bytes_with_the_same_tensors(gateway: Any) -> None:
    """A page whose top-K log-probs are all half floats exactly carries them as float16 (any Arrow reader sees
    the type); the trainer widens them to the float32 values the JSON form gives, bit for bit. A page of
    unrounded values stays float32."""
    pages = {b: gateway.client.get(f"/v1/batches/{b}/trajectories.arrow", params={"limit": N}) for b in (BATCH, HALF)}
    decoded = {b: decode_page(r.content, r.headers, batch_id=b, offset=0) for b, r in pages.items()}
    assert decoded[BATCH].schema.field("topk_logprobs").type == pa.list_(pa.float32())
    assert decoded[HALF].schema.field("topk_logprobs").type == pa.list_(pa.float16())
    assert len(pages[HALF].content) < len(pages[BATCH].content)
    from_json = _json_trajectories(gateway, HALF)
    from_arrow = fetch_trajectories(gateway.client, HALF, page_size=4)
    assert from_arrow == from_json
    b = collate(from_json, pad_id=0, k=K)
    broadcast = trajectories_to_batch(from_arrow)  # rank 0's form for the other ranks keeps the two bytes too
    assert broadcast.schema.field("topk_logprobs").type == pa.list_(pa.float16())
    for a in (collate(from_arrow, pad_id=0, k=K), collate_arrow(decoded[HALF], pad_id=0, k=K),
              collate_trajectories(from_arrow, pad_id=0, k=K, chunk=3), collate_arrow(broadcast, pad_id=0, k=K)):
        for name in ("logq", "topk_ids", "topk_logq"):
            assert torch.equal(_bits(getattr(a, name)), _bits(getattr(b, name))), name
    unrounded = collate(_json_trajectories(gateway), pad_id=0, k=K).topk_logq
    assert not torch.equal(unrounded, b.topk_logq)  # the rounding is real: the values moved ...
    assert float((unrounded - b.topk_logq).abs().max()) <= 2.0 ** -11 * float(unrounded.abs().max())  # ... by half an ulp


@pytest.mark.parametrize("page_size", [1, 4, 10, 64])
def test_paging_covers_every_trajectory_once(gateway: Any, page_size: int) -> None:
    expected = [t.id for t in _json_trajectories(gateway)]
    offsets, seen, offset = [], [], 0
    while True:
        resp = gateway.client.get(f"/v1/batches/{BATCH}/trajectories.arrow",
                                  params={"offset": offset, "limit": page_size}).raise_for_status()
        assert resp.headers["content-type"] == arrow_wire.MEDIA_TYPE
        page = decode_page(resp.content, resp.headers, batch_id=BATCH, offset=offset)
        offsets.append(offset)
        seen += page.column("id").to_pylist()
        if arrow_wire.HEADER_NEXT not in resp.headers:
            break
        offset = int(resp.headers[arrow_wire.HEADER_NEXT])
    assert seen == expected
    assert offsets == list(range(0, N, page_size))
    assert [t.id for t in fetch_trajectories(gateway.client, BATCH, page_size=page_size)] == expected


def test_running_and_unknown_batches_are_refused(gateway: Any) -> None:
    resp = gateway.client.get(f"/v1/batches/{RUNNING}/trajectories.arrow")
    assert resp.status_code == 409 and "still running" in resp.json()["detail"]
    assert gateway.client.get("/v1/batches/nope/trajectories.arrow").status_code == 404
    status_only = gateway.client.get(f"/v1/batches/{BATCH}", params={"trajectories": "false"}).json()
    assert status_only["status"] == "done" and status_only["trajectories"] is None


def test_the_client_waits_then_reads_pages_and_reports_a_stopped_batch_as_before(gateway: Any) -> None:
    client = GatewayClient(gateway.url)
    try:
        assert client.wait_arrow(BATCH, timeout_s=10, poll_s=0.05) == _json_trajectories(gateway)
        with pytest.raises(GatewayError, match=f"batch {FAILED} failed"):
            client.wait_arrow(FAILED, timeout_s=10, poll_s=0.05)
        with pytest.raises(GatewayError, match=f"batch {RUNNING} not done after"):
            client.wait_arrow(RUNNING, timeout_s=0.3, poll_s=0.05)
    finally:
        client.close()


class _Tamper(httpx.HTTPTransport):
    """The real gateway's answers, with the body of the Arrow page at `offset` rewritten by `change`; with
    `rehash`, the SHA-256 header is made to match (what a faulty gateway, not the wire, would send)."""

    def __init__(self, change: Callable[[bytes], bytes], *, offset: int, rehash: bool) -> None:
        super().__init__()
        self.change, self.offset, self.rehash = change, offset, rehash

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        resp = super().handle_request(request)
        if not request.url.path.endswith(".arrow") or request.url.params.get("offset") != str(self.offset):
            return resp
        body = self.change(resp.read())
        headers = dict(resp.headers)
        headers.pop("content-length", None)
        if self.rehash:
            headers[arrow_wire.HEADER_SHA256.lower()] = hashlib.sha256(body).hexdigest()
        return httpx.Response(resp.status_code, headers=headers, content=body)


def _flip(raw: bytes) -> bytes:
    i = len(raw) // 2
    return raw[:i] + bytes([raw[i] ^ 0x40]) + raw[i + 1:]


def _reencode(change: Callable[[pa.RecordBatch], pa.RecordBatch]) -> Callable[[bytes], bytes]:
    def rewrite(raw: bytes) -> bytes:
        return arrow_wire.to_stream(change(pa.ipc.open_stream(raw).read_next_batch()))
    return rewrite


def _drop_column(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.drop_columns(["topk_logprobs"])


def _short_page(batch: pa.RecordBatch) -> pa.RecordBatch:
    """One row fewer than the page's metadata says."""
    return pa.RecordBatch.from_arrays(batch.slice(0, batch.num_rows - 1).columns, schema=batch.schema)


def _cut_mask(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A trajectory's mask one entry short of its response."""
    masks = batch.column("loss_mask").to_pylist()
    masks[1] = masks[1][:-1]
    i = batch.schema.get_field_index("loss_mask")
    return batch.set_column(i, batch.schema.field(i), pa.array(masks, pa.list_(pa.uint8())))


@pytest.mark.parametrize(("change", "rehash", "why"), [
    (lambda raw: raw[: len(raw) - 100], False, "does not match its SHA-256"),
    (_flip, False, "does not match its SHA-256"),
    (lambda raw: raw[: len(raw) // 2], True, "not a complete Arrow IPC stream"),
    (_reencode(_drop_column), True, "schema differs"),
    (_reencode(_short_page), True, "the page header says 3 trajectories, the record batch holds 2"),
    (_reencode(_cut_mask), True, "loss_mask entries"),
], ids=["cut", "flipped-byte", "cut-rehashed", "wrong-schema", "row-count", "row-lengths"])
def test_a_cut_or_corrupted_page_is_refused(gateway: Any, change: Callable[[bytes], bytes], rehash: bool,
                                            why: str) -> None:
    with httpx.Client(base_url=gateway.url, transport=_Tamper(change, offset=3, rehash=rehash)) as http:
        with pytest.raises(GatewayError, match=rf"batch {BATCH} page offset=3: .*{why}"):
            fetch_trajectories(http, BATCH, page_size=3)


def test_the_listing_reads_no_token_blobs(gateway: Any) -> None:
    sessions = store.open_db(gateway.db_url)
    statements: list[str] = []
    event.listen(sessions.kw["bind"], "before_cursor_execute",
                 lambda _c, _cur, sql, *_a: statements.append(sql))
    try:
        with sessions() as s:
            rows, _ = store.list_trajectories(session=s, run="arrow", limit=N)
            summaries = [store.to_summary(r) for r in rows]
    finally:
        store.dispose(sessions)
    assert [x.id for x in summaries] == [f"t{i}" for i in range(N)]
    selects = [sql for sql in statements if sql.lstrip().upper().startswith("SELECT")]
    assert len(selects) == 1, selects  # no lazy load per row either
    for blob in ("response_ids", "topk_ids", "topk_logprobs", "behaviour_logprobs", "token_versions", "prompt_ids"):
        assert blob not in selects[0], blob
    listed = gateway.client.get("/v1/rollouts", params={"run": "arrow"}).raise_for_status().json()
    assert [x["id"] for x in listed["data"]] == [f"t{i}" for i in range(N)]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_page_of_either_store_holds_what_the_json_form_does(backend: str, tmp_path: Any,
                                                              request: pytest.FixtureRequest) -> None:
    """The page query and the blob decoding on SQLite and on a real PostgreSQL server (bytea), mid-batch page."""
    url = f"sqlite:///{tmp_path / 'r.db'}" if backend == "sqlite" else str(request.getfixturevalue("pg_url"))
    sessions = store.open_db(url)
    rng = np.random.default_rng(3)
    try:
        with sessions() as s:
            store.create_batch(session=s, batch_id=BATCH, run="arrow", step=0, idempotency_key=None,
                               request_hash="-", request_json="{}", total=6)
            for i in range(6):
                assert store.add_trajectory(session=s, trajectory=_trajectory(i, rng), sample_index=i % 2)
            rows = store.batch_page(session=s, batch_id=BATCH, offset=2, limit=3)
            page = arrow_pages.page_batch(rows, batch_id=BATCH, offset=2, total=store.count_batch(session=s,
                                                                                                   batch_id=BATCH))
            stored = [Trajectory.from_json(store.to_trajectory(r).model_dump(mode="json"))
                      for _, r in store.batch_trajectories(session=s, batch_id=BATCH)]
    finally:
        store.dispose(sessions)
    assert page_trajectories(arrow_wire.read_page(arrow_wire.to_stream(page), where="p")) == stored[2:5]
    assert (page.schema.metadata or {})[arrow_wire.META_TOTAL] == b"6"
