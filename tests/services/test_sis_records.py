"""`POST /v1/sis_records` on a real store-only gateway over real trajectories (SQLite): records read back with
their trajectory, replaced per (trajectory, policy version), per-step statistics and token lists computed by
hand, every refusal naming its reason, nothing stored by a refused request, the bearer token, and the
trainer's client (`GatewayClient.post_sis_records`) splitting long lists."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
from sisrl.common.wire import MAX_SIS_RECORDS
from sisrl.trainer.gateway_client import GatewayClient, GatewayError

from tests.services.viewer_data import RUN, sis_record


def _post(gateway: Any, records: list[dict[str, Any]], *, run: str = RUN, step: int = 1) -> httpx.Response:
    return gateway.client.post("/v1/sis_records", json={"run": run, "step": step, "records": records})


def _by_id(viewer_store: Any) -> dict[str, dict[str, Any]]:
    return {t["id"]: t for t in viewer_store.trajectories}


def _searched(viewer_store: Any) -> list[dict[str, Any]]:
    return [t for t in viewer_store.trajectories if t["turns"]]


def _expected_summary(traj: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    status = np.asarray(record["status"])
    abs_l = np.abs(np.asarray(record["logp"], np.float32).astype(np.float64)
                   - np.asarray(traj["behaviour_logprobs"], np.float32))
    return {"accepted": int((status == 1).sum()), "rejected": int((status == 0).sum()),
            "outside": int((status == 2).sum()), "d": float(abs_l[status >= 0].sum()),
            "d_sis": float(abs_l[(status == 0) | (status == 2)].sum())}


def test_records_read_back_with_their_trajectory_and_replace_per_version(store_only_gateway: Any,
                                                                         viewer_store: Any) -> None:
    first, second = _searched(viewer_store)[:2]
    records = [sis_record(first, seed=1, policy_version=3), sis_record(second, seed=2, policy_version=3)]
    assert _post(store_only_gateway, records).json() == {"run": RUN, "step": 1, "stored": 2, "replaced": 0}
    got = store_only_gateway.client.get(f"/v1/rollouts/{first['id']}").json()
    sis = got.pop("sis")
    assert got == first  # the trajectory itself is unchanged
    assert (sis["run"], sis["step"], sis["policy_version"]) == (RUN, 1, 3)
    assert sis["status"] == records[0]["status"] and sis["advantage"] == records[0]["advantage"]
    for key in ("ratio", "logp", "log_m"):  # float32 values from the builder: exact round trip
        assert sis[key] == records[0][key]
    assert sis["summary"] == pytest.approx(_expected_summary(first, records[0]), rel=1e-12)
    assert 0 < sis["summary"]["d_sis"] < sis["summary"]["d"]  # D_SIS <= D pathwise, strictly here

    again = sis_record(first, seed=9, policy_version=3)  # same (trajectory, version): replaces
    assert _post(store_only_gateway, [again]).json()["replaced"] == 1
    assert store_only_gateway.client.get(f"/v1/rollouts/{first['id']}").json()["sis"]["status"] == again["status"]
    newer = sis_record(first, seed=10, policy_version=4)  # a newer version: served instead, the old one kept
    older = sis_record(first, seed=11, policy_version=2)
    assert _post(store_only_gateway, [newer, older]).json() == {"run": RUN, "step": 1, "stored": 2, "replaced": 0}
    assert store_only_gateway.client.get(f"/v1/rollouts/{first['id']}").json()["sis"]["status"] == newer["status"]
    untouched = next(t for t in viewer_store.trajectories if t["id"] not in (first["id"], second["id"]))
    assert store_only_gateway.client.get(f"/v1/rollouts/{untouched['id']}").json()["sis"] is None
    runs = store_only_gateway.client.get("/v1/runs").json()["data"]
    assert [(r["run"], r["trajectories"], r["steps"], r["sis_records"]) for r in runs] == \
        [(RUN, len(viewer_store.trajectories), 2, 4)]


def test_refusals_name_the_reason_and_store_nothing(store_only_gateway: Any, viewer_store: Any) -> None:
    traj = _searched(viewer_store)[2]
    good = sis_record(traj, seed=3, policy_version=7)
    n = len(traj["response_ids"])

    def refused(records: list[dict[str, Any]], code: int, text: str, **kw: Any) -> None:
        resp = _post(store_only_gateway, records, **kw)
        assert resp.status_code == code and text in resp.text, resp.text
        # the valid record of the same request was not stored either
        assert store_only_gateway.client.get(f"/v1/rollouts/{traj['id']}").json()["sis"] is None

    refused([good, {**good, "trajectory_id": "no-such-id", "policy_version": 1}], 404,
            "trajectory 'no-such-id' not found")
    short = {**good, **{k: good[k][:-1] for k in ("status", "ratio", "logp", "log_m")}, "policy_version": 8}
    refused([good, short], 400, f"the record has {n - 1} entries per array, the trajectory has {n} response tokens")
    inserted = traj["loss_mask"].index(0)
    on_inserted = {**good, "status": [*good["status"][:inserted], 1, *good["status"][inserted + 1:]], "policy_version": 9}
    refused([good, on_inserted], 400, f"response token {inserted} was inserted by the environment (loss mask 0)")
    refused([good], 400, f"belongs to run '{RUN}', not 'other-run'", run="other-run")
    refused([{**good, "ratio": good["ratio"][:-1]}], 400, "per-token arrays differ in length")
    as_inf = {**good, "logp": [*good["logp"][:-1], 1e39]}  # 1e39 would be inf as float32
    refused([as_inf], 422, f'"loc":["body","records",0,"logp",{n - 1}],"msg":"Input should be less than or equal to')
    refused([good, {**good, "seed": 1}], 422, "Extra inputs are not permitted")
    refused([good, good], 400, f"trajectory '{traj['id']}' has two records for policy version 7")
    tiny = [{"trajectory_id": traj["id"], "policy_version": v, "advantage": 0.0, "status": [], "ratio": [],
             "logp": [], "log_m": []} for v in range(MAX_SIS_RECORDS + 1)]
    refused(tiny, 413, f"{MAX_SIS_RECORDS + 1} records in one request, the limit is {MAX_SIS_RECORDS}")
    big = {**good, "status": [1] * 200_000}  # ~400 kB of JSON: over the gateway's --max-request-bytes
    refused([big], 413, "exceeds the limit of 262144 bytes (setting max_request_bytes)")


def test_step_statistics_and_token_lists(store_only_gateway: Any, viewer_store: Any) -> None:
    trajs = viewer_store.trajectories[:6]
    records = {step: [sis_record(t, seed=100 * step + i, policy_version=20 + step) for i, t in enumerate(trajs)]
               for step in (5, 6)}
    for step, recs in records.items():
        _post(store_only_gateway, recs, step=step).raise_for_status()
    stats = {s["step"]: s for s in store_only_gateway.client.get(f"/v1/runs/{RUN}/sis_stats").json()["data"]}
    trajectory = _by_id(viewer_store)
    for step, recs in records.items():
        sums = [_expected_summary(trajectory[r["trajectory_id"]], r) for r in recs]
        acc, rej, out = (sum(s[k] for s in sums) for k in ("accepted", "rejected", "outside"))
        assert stats[step] == pytest.approx({
            "step": step, "records": len(recs), "policy_tokens": acc + rej + out, "accepted": acc, "rejected": rej,
            "outside": out, "accept_rate": acc / (acc + rej + out), "d_mean": sum(s["d"] for s in sums) / len(recs),
            "d_sis_mean": sum(s["d_sis"] for s in sums) / len(recs)}, rel=1e-12)

    tokens = store_only_gateway.client.get(f"/v1/runs/{RUN}/sis_tokens", params={"step_min": 5, "top": 5}).json()
    counts: dict[int, list[int]] = {}
    for recs in records.values():
        for r in recs:
            for tok, status in zip(trajectory[r["trajectory_id"]]["response_ids"], r["status"], strict=True):
                if status >= 0:
                    counts.setdefault(tok, [0, 0, 0])[status] += 1  # [rejected, accepted, outside]
    best_acc = sorted(counts, key=lambda t: (-counts[t][1], t))[:5]
    best_rej = sorted(counts, key=lambda t: (-(counts[t][0] + counts[t][2]), t))[:5]
    assert [e["token_id"] for e in tokens["most_accepted"]] == best_acc
    assert [e["token_id"] for e in tokens["most_rejected"]] == best_rej
    assert tokens["records_scanned"] == 12 and not tokens["truncated"]
    assert all(e["text"] for e in tokens["most_accepted"])  # decoded by the tokenizer the store-only gateway read
    first = tokens["most_accepted"][0]
    assert [first["rejected"], first["accepted"], first["outside"]] == counts[first["token_id"]]
    capped = store_only_gateway.client.get(f"/v1/runs/{RUN}/sis_tokens", params={"max_records": 3}).json()
    assert capped["records_scanned"] == 3 and capped["truncated"]


def test_every_data_route_needs_the_token_and_the_viewer_does_not(store_only_gateway: Any) -> None:
    url = store_only_gateway.url
    assert httpx.post(f"{url}/v1/sis_records", json={"run": RUN, "step": 0, "records": []}).status_code == 401
    for path in ("/v1/runs", f"/v1/runs/{RUN}/sis_stats", f"/v1/runs/{RUN}/sis_tokens", "/v1/rollouts"):
        assert httpx.get(f"{url}{path}").status_code == 401, path
    assert httpx.get(f"{url}/health").json()["token_required"] is True
    page = httpx.get(f"{url}/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(f"{url}/ui/main.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(f"{url}/ui/..%2Fschemas.py").status_code == 404


def test_the_trainers_client_splits_long_lists(store_only_gateway: Any, viewer_store: Any) -> None:
    trajs = viewer_store.trajectories
    versions = MAX_SIS_RECORDS // len(trajs) + 2  # more records than one request may carry
    records = [{**sis_record(t, seed=v, policy_version=100 + v),
                "logp": np.asarray(sis_record(t, seed=v)["logp"], np.float32)}  # numpy arrays are accepted too
               for v in range(versions) for t in trajs]
    client = GatewayClient(store_only_gateway.url, token=store_only_gateway.token)

    def stored() -> int:
        return int(store_only_gateway.client.get("/v1/runs").json()["data"][0]["sis_records"])

    try:
        before = stored()
        client.post_sis_records(RUN, 9, records, max_bytes=64 * 2**10)  # ~64 KiB a request: many requests
        after = stored()
        assert after - before == len(records) > MAX_SIS_RECORDS
        with pytest.raises(GatewayError, match="HTTP 404.*trajectory 'gone' not found"):
            client.post_sis_records(RUN, 9, [{**records[0], "trajectory_id": "gone"}])
        with pytest.raises(ValueError, match=f"SIS record of trajectory '{trajs[0]['id']}'.*Out of range float"):
            client.post_sis_records(RUN, 9, [{**records[0], "advantage": float("nan")}])
    finally:
        client.close()
