"""HTTP client of the rollout gateway (services/): submit a rollout batch, wait for it, push new weights.

Wire contract (docs/design.md, "REST API"): `POST /v1/rollouts` -> {batch_id, status}; `GET /v1/batches/{id}` ->
{status, progress, missing_items, trajectories}; `POST /v1/policy` {path, version}; `GET /health`;
`GET /v1/rollouts?run=&data_source=&reward_min=&cursor=` -> {data, count, next_cursor}; `GET /v1/rollouts/{id}`;
`POST /v1/sis_records` {run, step, records} (docs/design.md, "SIS records"; at most
MAX_SIS_RECORDS records a request).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx
from pydantic import SecretStr
from sisrl.common.wire import MAX_SIS_RECORDS
from sisrl.trainer.batch import Trajectory
from sisrl.trainer.config import RolloutConfig
from sisrl.trainer.data import QAItem

log = logging.getLogger(__name__)
DONE = "done"
PARTIAL = "partial"  # finished with fewer trajectories than asked (e.g. the gateway restarted mid-batch)
FAILED = "failed"


class GatewayError(RuntimeError):
    """The gateway refused a request or a batch failed; the message says which and why."""


class GatewayClient:
    def __init__(self, url: str, *, token: str | SecretStr | None = None, timeout_s: float = 60.0) -> None:
        if isinstance(token, SecretStr):
            token = token.get_secret_value()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)

    def _json(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        try:
            resp = self.http.request(method, path, **kw)
        except httpx.HTTPError as err:
            raise GatewayError(f"{method} {self.http.base_url}{path}: {err}") from err
        if resp.status_code >= 400:
            raise GatewayError(f"{method} {path}: HTTP {resp.status_code}: {resp.text[:500]}")
        body: dict[str, Any] = resp.json()
        return body

    def health(self) -> dict[str, Any]:
        return self._json("GET", "/health")

    def check_reachable(self) -> None:
        """One `GET /health`; a GatewayError naming the URL and what to do when nothing answers there."""
        try:
            self.http.get("/health", timeout=10.0)
        except httpx.HTTPError as err:
            raise GatewayError(f"no rollout gateway answers at {self.http.base_url} ({err}): start one "
                               "(`sisrl-gateway serve`, docs/gateway.md) or set rollout.gateway_url to its URL") from err

    def submit(self, *, run: str, step: int, policy_version: int, items: list[QAItem], cfg: RolloutConfig,
               k: int, seed: int, min_policy_version: int | None = None, key: str | None = None) -> str:
        return self.submit_body(self.rollout_body(run=run, step=step, policy_version=policy_version, items=items,
                                                  cfg=cfg, k=k, seed=seed, min_policy_version=min_policy_version,
                                                  key=key))

    def submit_body(self, body: dict[str, Any]) -> str:
        """`POST /v1/rollouts` with a body from `rollout_body` (kept as is to resubmit it after a crash)."""
        return str(self._json("POST", "/v1/rollouts", json=body)["batch_id"])

    @staticmethod
    def rollout_body(*, run: str, step: int, policy_version: int, items: list[QAItem], cfg: RolloutConfig,
                     k: int, seed: int, min_policy_version: int | None = None,
                     key: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "run": run, "step": step, "policy_version": policy_version,
            "items": [it.to_json() for it in items],
            "samples_per_item": cfg.samples_per_prompt,
            "sampling": {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p,
                         "logprobs_k": k, "seed": seed},
            "max_turns": cfg.max_turns,
            "protocol": {"prompt_template": cfg.prompt(), "append_question_mark": cfg.append_question_mark,
                         "apply_chat_template": cfg.apply_chat_template,
                         "observation_template": cfg.observation_template, "passage_template": cfg.passage_template,
                         "strip_passages": cfg.strip_passages, "observation_truncation": cfg.observation_truncation,
                         "observation_max_tokens": cfg.observation_max_tokens,
                         "invalid_action_message": cfg.invalid_action_message},
            # Same key for the same (run, step): a retried POST after a crash reuses the batch, never duplicates it.
            "idempotency_key": key or f"{run}:{step}",
        }
        if min_policy_version is not None:
            body["min_policy_version"] = min_policy_version
        return body

    def wait(self, batch_id: str, *, timeout_s: float, poll_s: float) -> list[Trajectory]:
        deadline = time.monotonic() + timeout_s
        while True:
            body = self._json("GET", f"/v1/batches/{batch_id}")
            status = str(body.get("status", "")).lower()
            if status == DONE:
                return [Trajectory.from_json(t) for t in body.get("trajectories") or []]
            if status == PARTIAL and body.get("trajectories"):
                log.warning("batch %s is partial (missing items %s): training on what it holds", batch_id,
                            body.get("missing_items"))
                return [Trajectory.from_json(t) for t in body["trajectories"]]
            if status in (FAILED, PARTIAL):
                raise GatewayError(_stopped(batch_id, status, body))
            if time.monotonic() > deadline:
                raise GatewayError(f"batch {batch_id} not done after {timeout_s:.0f}s (progress {body.get('progress')})")
            time.sleep(poll_s)

    def wait_arrow(self, batch_id: str, *, timeout_s: float, poll_s: float) -> list[Trajectory]:
        """`wait`, reading the finished batch as Arrow IPC pages instead of one JSON document (the trainer's
        path; trainer/arrow_batch.py)."""
        from sisrl.trainer.arrow_batch import wait_arrow  # it imports this module

        return wait_arrow(self, batch_id, timeout_s=timeout_s, poll_s=poll_s)

    def list_rollouts(self, *, run: str | None = None, data_source: str | None = None,
                      reward_min: float | None = None, limit: int | None = None,
                      page_size: int = 500) -> list[dict[str, Any]]:
        """Summaries of stored trajectories matching the filters (`GET /v1/rollouts`), all pages, oldest first."""
        filters = {"run": run, "data_source": data_source, "reward_min": reward_min}
        params: dict[str, Any] = {k: v for k, v in filters.items() if v is not None}
        out: list[dict[str, Any]] = []
        cursor: str | None = None
        while limit is None or len(out) < limit:
            page_params = {**params, "limit": page_size, **({"cursor": cursor} if cursor else {})}
            page = self._json("GET", "/v1/rollouts", params=page_params)
            out.extend(page.get("data") or [])
            cursor = page.get("next_cursor")
            if not cursor:
                break
        return out if limit is None else out[:limit]

    def get_rollout(self, trajectory_id: str) -> Trajectory:
        """One stored trajectory with its token arrays (`GET /v1/rollouts/{id}`)."""
        return Trajectory.from_json(self._json("GET", f"/v1/rollouts/{trajectory_id}"))

    def push_policy(self, path: Path, version: int, *, partial: bool = False) -> dict[str, Any]:
        """`POST /v1/policy`; answers once the gateway serves `version` (with `partial=false`, after the
        trajectories running there finished)."""
        body: dict[str, Any] = {"path": str(path), "version": version}
        if partial:
            body["partial"] = True
        return self._json("POST", "/v1/policy", json=body)

    def post_sis_records(self, run: str, step: int, records: list[dict[str, Any]], *,
                         max_bytes: int = 4 * 2**20) -> None:
        """Store the per-token SIS decisions of trained trajectories (`POST /v1/sis_records`).

        Each record: {trajectory_id, policy_version, advantage, status, ratio, logp, log_m}, the four arrays one
        entry per response token (status 1 accepted, 0 rejected, 2 outside V_K, -1 loss mask 0). Sent in
        requests of at most MAX_SIS_RECORDS records and about `max_bytes` (under the gateway's default 8 MiB
        body limit). A record stored already for the same trajectory and version is replaced, so after a
        GatewayError (raised by the first refused request; earlier ones are stored) the same call can be retried."""
        chunk: list[bytes] = []
        size = 0
        for record in records:
            try:
                encoded = json.dumps(record, allow_nan=False, default=_plain).encode()
            except (TypeError, ValueError) as err:  # NaN / inf, or a type JSON has no form for
                raise ValueError(f"SIS record of trajectory {record.get('trajectory_id')!r}: {err}") from err
            if chunk and (len(chunk) == MAX_SIS_RECORDS or size + len(encoded) > max_bytes):
                self._post_sis_chunk(run, step, chunk)
                chunk, size = [], 0
            chunk.append(encoded)
            size += len(encoded) + 1
        if chunk:
            self._post_sis_chunk(run, step, chunk)

    def _post_sis_chunk(self, run: str, step: int, encoded: list[bytes]) -> None:
        # The records are encoded once (to size the chunks); the body is assembled around them.
        body = b'{"run": %s, "step": %d, "records": [%s]}' % (json.dumps(run).encode(), step, b",".join(encoded))
        self._json("POST", "/v1/sis_records", content=body, headers={"Content-Type": "application/json"})

    def close(self) -> None:
        self.http.close()


def _stopped(batch_id: str, status: str, body: dict[str, Any]) -> str:
    """Why a batch gave nothing to train on, for the one-line error: a failed batch's first trajectory error
    (`error`: every trajectory ended with one, most often for one reason, such as a retriever that refuses)."""
    if status == FAILED:
        n = len(body.get("trajectories") or [])
        return f"batch {batch_id} failed: all {n} trajectories ended with an error, the first: {body.get('error')}"
    progress = body.get("progress") or {}
    why = f"; the first trajectory error: {body['error']}" if body.get("error") else ""
    return (f"batch {batch_id} partial: its gateway stopped with {progress.get('done')} of {progress.get('total')} "
            f"trajectories stored (missing items {body.get('missing_items')}){why}")


def _plain(value: Any) -> Any:
    """numpy / torch arrays and scalars as Python lists and numbers (json.dumps' `default`)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


class GatewaySource:
    """Rollouts through the gateway; new weights are saved as an HF directory and announced to it."""

    needs_weights = True

    def __init__(self, client: GatewayClient, cfg: RolloutConfig, *, run: str, k: int, seed: int) -> None:
        self.client = client
        self.cfg = cfg
        self.run = run
        self.k = k
        self.seed = seed

    def rollouts(self, items: list[QAItem], step: int, version: int) -> list[Trajectory]:
        batch_id = self.client.submit(run=self.run, step=step, policy_version=version, items=items, cfg=self.cfg,
                                      k=self.k, seed=self.seed * 1_000_003 + step)
        trajs = self.client.wait_arrow(batch_id, timeout_s=self.cfg.timeout_s, poll_s=self.cfg.poll_interval_s)
        bad = [t.id for t in trajs if t.error]
        if bad:
            log.warning("%d trajectories carry errors (kept with their recorded reward): %s", len(bad), bad[:5])
        if not trajs:
            raise GatewayError(f"batch {batch_id} returned no trajectories")
        return trajs

    def push_policy(self, path: Path | None, version: int) -> None:
        if path is None:
            raise ValueError("the gateway source needs the path of the saved weights")
        self.client.push_policy(path, version)
