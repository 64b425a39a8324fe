"""HTTP client of the rollout gateway (services/): submit a rollout batch, wait for it, push new weights.

Wire contract (docs/design.md, "REST API"): `POST /v1/rollouts` -> {batch_id, status}; `GET /v1/batches/{id}` ->
{status, progress, missing_items, trajectories}; `POST /v1/policy` {path, version}; `GET /health`;
`GET /v1/rollouts?run=&data_source=&reward_min=&cursor=` -> {data, count, next_cursor}; `GET /v1/rollouts/{id}`;
`POST /v1/sis_records` {run, step, records} (docs/design.md, "SIS records"; at most
MAX_SIS_RECORDS records a request).
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
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
PARTIAL = "partial"  # stopped with fewer trajectories than asked (its gateway stopped, e.g. killed or restarted)
FAILED = "failed"
MAX_IDLE_RESUMES = 3  # resubmissions of a partial batch in a row that store no new trajectory before giving up


class GatewayError(RuntimeError):
    """The gateway refused a request or a batch failed; the message says which and why."""


@dataclass(frozen=True)
class RetryPolicy:
    """When a request is tried again: after a transport error, a 429 or a 5xx. The n-th retry (n = 0, 1, ...)
    waits min(max_s, first_s * 2^n) times a jitter in [0.5, 1.5) (so clients that failed together do not retry
    together), or what a 429's or 503's `Retry-After` asks; a request gives up when the next wait would end more
    than budget_s after its first failure. Every POST the trainer sends may be repeated: a rollout batch carries an
    idempotency key, a policy push and SIS records replace what they stored before."""

    budget_s: float = 600.0
    first_s: float = 0.5
    max_s: float = 30.0

    def delay(self, retry: int, rng: random.Random) -> float:
        return min(self.max_s, self.first_s * 2**retry) * rng.uniform(0.5, 1.5)


def retryable(status: int) -> bool:
    """429 (the gateway is full: max_pending) and every 5xx (a gateway or proxy that is restarting)."""
    return status == 429 or status >= 500


def retry_after_s(value: str | None) -> float | None:
    """Seconds a `Retry-After` header asks to wait: delta-seconds or an HTTP date (RFC 9110, 10.2.3); None when
    absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


@dataclass
class Announced:
    """The newest policy a run announced (`POST /v1/policy`), shared by the run's clients (the trainer's and the
    weight-push thread's): a gateway that restarted on its initial weights gets it again before a batch
    resumes there. The lock keeps pushes in order, so a repeated push never lands after a newer one."""

    path: Path | None = None
    version: int = -1
    partial: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class GatewayClient:
    def __init__(self, url: str, *, token: str | SecretStr | None = None, timeout_s: float = 60.0,
                 retry: RetryPolicy | None = None, announced: Announced | None = None) -> None:
        if isinstance(token, SecretStr):
            token = token.get_secret_value()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)
        self.retry = retry or RetryPolicy()
        self.announced = announced or Announced()
        self._rng = random.Random()  # jitter only: unseeded on purpose, so trainers never retry in step

    @property
    def url(self) -> str:
        return str(self.http.base_url).rstrip("/")

    def _json(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        """One request, retried on transport errors, 429 and 5xx (RetryPolicy); a GatewayError of one line,
        naming the gateway URL and the last error, once the retry budget is spent or on any other 4xx."""
        first_failure: float | None = None
        for retry in itertools.count():
            try:
                resp = self.http.request(method, path, **kw)
            except httpx.TransportError as err:
                error, asked = f"{type(err).__name__}: {err}", None
            else:
                if resp.status_code < 400:
                    body: dict[str, Any] = resp.json()
                    return body
                error = f"HTTP {resp.status_code}: {resp.text[:500]}"
                if not retryable(resp.status_code):
                    raise GatewayError(_one_line(f"{method} {self.url}{path}: {error}"))
                asked = retry_after_s(resp.headers.get("retry-after"))
                if asked is not None:
                    error = f"HTTP {resp.status_code} (Retry-After {asked:g} s): {resp.text[:500]}"
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            pause = asked if asked is not None else self.retry.delay(retry, self._rng)
            if now + pause - first_failure > self.retry.budget_s:
                raise GatewayError(_one_line(
                    f"gateway {self.url} did not answer {method} {path} after {retry + 1} attempts in "
                    f"{now - first_failure:.0f} s (retry budget {self.retry.budget_s:g} s, "
                    f"rollout.retry_budget_s); last error: {error}"))
            log.warning("%s %s%s: %s; retry %d in %.1f s", method, self.url, path, _one_line(error)[:300],
                        retry + 1, pause)
            time.sleep(pause)
        raise AssertionError("unreachable")  # itertools.count() never ends

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
        """`POST /v1/rollouts` with a body from `rollout_body` (kept as is to resubmit it after a crash). A gateway
        restarted since the last push serves its --model weights and refuses a `min_policy_version` it does not
        serve (409): the run's newest policy is pushed again and the body sent once more."""
        try:
            return str(self._json("POST", "/v1/rollouts", json=body)["batch_id"])
        except GatewayError as err:
            if "HTTP 409" not in str(err) or "min_policy_version" not in str(err) or self.announced.path is None:
                raise
            self.restore_policy()
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

    def wait(self, batch_id: str, *, timeout_s: float, poll_s: float,
             body: dict[str, Any] | None = None) -> list[Trajectory]:
        """Poll `GET /v1/batches/{id}` until the batch is `done` (every trajectory, errored ones included);
        GatewayError when it failed, or after `timeout_s`.

        A `partial` batch (its gateway stopped, e.g. it was killed and restarted) is resumed when `body`, the
        request it was submitted with, is given: the same idempotency key is submitted again, and the gateway
        runs only the missing samples (docs/gateway.md, "API"). Without `body`, or after MAX_IDLE_RESUMES
        resubmissions in a row that stored no new trajectory, a partial batch is a GatewayError."""
        deadline = time.monotonic() + timeout_s
        resumed_at: int | None = None  # trajectories stored at the last resubmission
        idle = 0
        while True:
            got = self._json("GET", f"/v1/batches/{batch_id}")
            status = str(got.get("status", "")).lower()
            if status == DONE:
                return [Trajectory.from_json(t) for t in got.get("trajectories") or []]
            if status == PARTIAL and body is not None:
                done = int((got.get("progress") or {}).get("done") or 0)
                idle = idle + 1 if resumed_at is not None and done <= resumed_at else 0
                if idle >= MAX_IDLE_RESUMES:
                    raise GatewayError(f"{_stopped(batch_id, status, got)}; resubmitted {idle} times in a row "
                                       "without a new trajectory")
                resumed_at = done
                self._resume(batch_id, body, got)
            elif status in (FAILED, PARTIAL):
                raise GatewayError(_stopped(batch_id, status, got))
            if time.monotonic() > deadline:
                raise GatewayError(f"batch {batch_id} not done after {timeout_s:.0f}s (progress {got.get('progress')})")
            time.sleep(poll_s)

    def _resume(self, batch_id: str, body: dict[str, Any], got: dict[str, Any]) -> None:
        progress = got.get("progress") or {}
        log.warning("batch %s is partial (%s of %s trajectories stored; its gateway stopped): submitting its "
                    "idempotency key %r again to run the missing samples", batch_id, progress.get("done"),
                    progress.get("total"), body.get("idempotency_key"))
        self.restore_policy()
        again = self.submit_body(body)
        if again != batch_id:
            raise GatewayError(f"idempotency key {body.get('idempotency_key')!r} now names batch {again}, "
                               f"not {batch_id}: is the gateway on another store?")

    def restore_policy(self) -> None:
        """Announce the newest policy of this run again when the gateway serves an older version: a restarted
        gateway starts on its `--model` weights, and resumed samples must come from the run's policy."""
        with self.announced.lock:
            if self.announced.path is None:
                return
            served = self.health().get("policy_version")
            if served is None or served >= self.announced.version:
                return
            log.warning("the gateway at %s serves policy version %s, this run announced %d: pushing it again",
                        self.url, served, self.announced.version)
            self._push_policy(self.announced.path, self.announced.version, self.announced.partial)

    def wait_arrow(self, batch_id: str, *, timeout_s: float, poll_s: float,
                   body: dict[str, Any] | None = None) -> list[Trajectory]:
        """`wait`, reading the finished batch as Arrow IPC pages instead of one JSON document (the trainer's
        path; trainer/arrow_batch.py); a partial batch is resumed as `wait` resumes it when `body` is given."""
        from sisrl.trainer.arrow_batch import wait_arrow  # it imports this module

        return wait_arrow(self, batch_id, timeout_s=timeout_s, poll_s=poll_s, body=body)

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
        trajectories running there finished). Recorded in `announced` (for `restore_policy`)."""
        with self.announced.lock:
            answer = self._push_policy(path, version, partial)
            self.announced.path, self.announced.version, self.announced.partial = path, version, partial
        return answer

    def _push_policy(self, path: Path, version: int, partial: bool) -> dict[str, Any]:
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


def _one_line(text: str) -> str:
    return " ".join(text.split())


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
        """One batch, submitted and waited for (resumed if its gateway restarts); errored trajectories are
        left out (`trainable`)."""
        body = self.client.rollout_body(run=self.run, step=step, policy_version=version, items=items, cfg=self.cfg,
                                        k=self.k, seed=self.seed * 1_000_003 + step)
        batch_id = self.client.submit_body(body)
        trajs, _ = trainable(self.client.wait_arrow(batch_id, timeout_s=self.cfg.timeout_s,
                                                    poll_s=self.cfg.poll_interval_s, body=body), step)
        if not trajs:
            raise GatewayError(f"batch {batch_id} returned no trajectory without an error")
        return trajs

    def push_policy(self, path: Path | None, version: int) -> None:
        if path is None:
            raise ValueError("the gateway source needs the path of the saved weights")
        self.client.push_policy(path, version)


def trainable(trajs: list[Trajectory], step: int) -> tuple[list[Trajectory], int]:
    """(the trajectories without an error, how many had one). An errored trajectory (an engine or retriever
    failure) never reaches the loss: its reward says nothing about the policy. It stays in the gateway's store,
    where the viewer shows it."""
    kept = [t for t in trajs if not t.error]
    if len(kept) < len(trajs):
        log.warning("step %d: %d of %d trajectories ended with an error and are left out of the update "
                    "(stored at the gateway): %s", step, len(trajs) - len(kept), len(trajs),
                    [t.id for t in trajs if t.error][:5])
    return kept, len(trajs) - len(kept)
