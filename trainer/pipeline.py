"""Rollout batches in flight at the gateway: submitted ahead of the trainer, bounded by `rollout.max_staleness`.

Step j trains batch j while the trainer holds policy version j (one version per step). Batch j is submitted as
soon as the gateway serves version j - k (k = max_staleness; 0 in sync mode), with `min_policy_version` j - k
(the gateway refuses the batch if its engine is older), so no trained token lags more than k versions. Later
tokens may be newer (partial rollouts). In async mode `fill` runs in the trainer's weight-push thread right after
a push lands; a lock keeps the sampler, the batches in flight and the checkpoint's snapshot of both consistent. A trajectory that still carries an older token, or one newer than
the trainer's version (a batch from before a crash, sampled by weights this run no longer has), is dropped and
counted, never trained on; so is one that ended with an error. A batch whose gateway stopped (`partial`) is
resumed by `GatewayClient.wait` with its stored body: same key, only the missing samples run.

A checkpoint stores the bodies of the batches in flight (`state`); a resumed run submits them again with the
same idempotency keys, so the gateway returns the same batches (or runs only their missing samples): nothing is
lost and nothing trained twice. Batches first submitted after a resume carry a fresh key suffix, so a batch
that a crashed process submitted after its last checkpoint (sampled by weights that were never saved) is never
taken for one of them.
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sisrl.trainer.batch import Trajectory
from sisrl.trainer.config import RolloutConfig
from sisrl.trainer.data import MixtureSampler
from sisrl.trainer.gateway_client import GatewayError, GatewaySource, trainable

log = logging.getLogger(__name__)


@dataclass
class Taken:
    """What `RolloutPipeline.take` returns: the trajectories to train on and what was dropped."""

    trajectories: list[Trajectory]
    dropped: int = 0  # trajectories with a token outside [version - k, version]
    errored: int = 0  # trajectories that ended with an error (never trained on)
    submitted_version: int = 0  # min_policy_version the batch was submitted with


@dataclass
class RolloutPipeline:
    source: GatewaySource
    sampler: MixtureSampler
    cfg: RolloutConfig
    ahead: int  # k: batches submitted ahead of the trainer (0 = sync)
    total_steps: int
    suffix: str = ""  # idempotency-key suffix of batches first submitted by this process ("" on a fresh run)
    inflight: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> {"body", "batch_id"}
    next_step: int = 0  # the first step not submitted yet (steps below it are in flight or taken)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def for_run(cls, source: GatewaySource, sampler: MixtureSampler, cfg: RolloutConfig, *, total_steps: int,
                resumed: bool) -> RolloutPipeline:
        ahead = cfg.max_staleness if cfg.mode == "async" else 0
        suffix = f":r{secrets.token_hex(4)}" if resumed else ""
        return cls(source=source, sampler=sampler, cfg=cfg, ahead=ahead, total_steps=total_steps, suffix=suffix)

    def fill(self, version: int) -> None:
        """Submit every batch that may be generated once the gateway serves `version`: steps up to version + k
        (call it after that version's push has landed)."""
        with self.lock:
            self._fill(version)

    def _fill(self, version: int, upto: int | None = None) -> None:
        last = min(self.total_steps - 1, version + self.ahead if upto is None else upto)
        step = self.next_step
        while step <= last:
            items = self.sampler.next_items(self.cfg.prompts_per_step)
            body = self.source.client.rollout_body(
                run=self.source.run, step=step, policy_version=version, items=items, cfg=self.cfg,
                k=self.source.k, seed=self.source.seed * 1_000_003 + step, min_policy_version=version,
                key=f"{self.source.run}:{step}{self.suffix}")
            self.inflight[step] = {"body": body, "batch_id": self.source.client.submit_body(body)}
            step += 1
            self.next_step = step

    def has(self, step: int) -> bool:
        with self.lock:
            return step in self.inflight

    def take(self, step: int, version: int) -> Taken:
        """Wait for batch `step` (submitting it when it is not in flight) and keep the trajectories whose every
        policy token has a version in [version - k, version]. A batch submitted here goes alone, and the
        batches ahead follow once it is back: on one engine they would otherwise share it with the batch the
        trainer waits for (the first step of a run, or of a resumed one, would take k + 1 batches' time)."""
        with self.lock:
            alone = step not in self.inflight
            if alone:  # the first step, of a run or a resumed one; the caller has seen `version` land
                if step < self.next_step:
                    raise RuntimeError(f"batch {step} was taken already")
                self._fill(version, upto=step)
            entry = self.inflight.pop(step)
        batch_id = entry["batch_id"]
        trajs = self.source.client.wait_arrow(batch_id, timeout_s=self.cfg.timeout_s, poll_s=self.cfg.poll_interval_s,
                                              body=entry["body"])
        if alone and self.ahead:
            # the batches `version` allows ahead, generated while the trainer updates (later, the push thread
            # fills after each push lands: the trainer's version may not be the gateway's yet)
            self.fill(version)
        if not trajs:
            raise GatewayError(f"batch {batch_id} returned no trajectories")
        usable, errored = trainable(trajs, step)
        kept = [t for t in usable if within_bound(t, version, self.ahead)]
        if len(kept) < len(usable):
            log.warning("step %d: dropped %d of %d trajectories with a token outside policy versions [%d, %d]",
                        step, len(usable) - len(kept), len(trajs), version - self.ahead, version)
        return Taken(kept, dropped=len(usable) - len(kept), errored=errored,
                     submitted_version=int(entry["body"].get("min_policy_version", version)))

    def snapshot(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(sampler state, bodies of the batches in flight oldest first), taken together: the checkpoint's."""
        with self.lock:
            return self.sampler.state(), [{"step": step, "body": entry["body"]}
                                          for step, entry in sorted(self.inflight.items())]

    def restore(self, entries: list[dict[str, Any]], step: int) -> None:
        """Submit the checkpoint's batches in flight again (same idempotency keys, so the same batches); `step`
        is the checkpoint's, the next batch to train."""
        with self.lock:
            self.next_step = max([step] + [int(e["step"]) + 1 for e in entries])
            for entry in entries:
                body = entry["body"]
                self.inflight[int(entry["step"])] = {"body": body,
                                                     "batch_id": self.source.client.submit_body(body)}


def token_versions(t: Trajectory) -> np.ndarray:
    """The policy version of each policy token (loss mask 1) of `t` (int64)."""
    if t.token_versions is None:
        return np.full(t.policy_tokens, t.policy_version, dtype=np.int64)
    versions, mask = np.asarray(t.token_versions, dtype=np.int64), np.asarray(t.loss_mask)
    if len(versions) != len(mask):
        raise ValueError(f"trajectory {t.id}: {len(versions)} token_versions for {len(mask)} tokens")
    return versions[mask != 0]


def within_bound(t: Trajectory, version: int, k: int) -> bool:
    versions = token_versions(t)
    return bool(((versions >= version - k) & (versions <= version)).all())
