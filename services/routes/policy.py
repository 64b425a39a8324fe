"""`/v1/policy`: load new policy weights into the engine (paths only under the checkpoint root)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException, status
from sisrl.services.deps import STORE_ONLY_RESPONSE, LiveDep, StateDep
from sisrl.services.schemas import PolicyPublic, PolicyUpdate

router = APIRouter(prefix="/v1/policy", tags=["policy"])


def resolve_checkpoint(root: Path, path: str) -> Path:
    """`path` (absolute, or relative to `root`) resolved; HTTPException unless it is a directory under `root`."""
    base = root.resolve()
    try:
        target = (base / path).resolve()
        is_dir = target.is_relative_to(base) and target.is_dir()
    except (OSError, ValueError) as exc:  # NUL bytes, names too long for the file system
        raise HTTPException(status.HTTP_400_BAD_REQUEST, detail=f"unusable path {path!r}: {exc}") from exc
    if not target.is_relative_to(base):
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail=f"path {path!r} is outside the checkpoint root {base}")
    if not is_dir:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"checkpoint directory {str(target)!r} not found")
    return target


@router.get("", response_model=PolicyPublic, summary="The policy version and path loaded in the engine",
            responses=STORE_ONLY_RESPONSE)
def get_policy(state: StateDep, live: LiveDep) -> PolicyPublic:
    return PolicyPublic(policy_version=live.engine.policy_version, path=state.policy_path)


@router.post("", response_model=PolicyPublic, summary="Load a checkpoint into the engine",
             responses={400: {"description": "unusable path, or weights the engine could not load"},
                        403: {"description": "path outside the gateway's checkpoint root"},
                        404: {"description": "no checkpoint directory at path"}, **STORE_ONLY_RESPONSE})
async def load_policy(body: PolicyUpdate, state: StateDep, live: LiveDep) -> PolicyPublic:
    """Answers once the engine serves `version`: with `partial=false` after the running trajectories finished."""
    target = resolve_checkpoint(state.settings.checkpoint_root, body.path)
    async with state.policy_lock:
        try:
            await live.runner.gate.load(str(target), body.version, partial=body.partial)
        except (OSError, ValueError, RuntimeError) as exc:
            raise HTTPException(status.HTTP_400_BAD_REQUEST,
                                detail=f"could not load {str(target)!r}: {type(exc).__name__}: {exc}") from exc
        state.policy_path = str(target)
        state.metrics.policy_version.set(body.version)
    return PolicyPublic(policy_version=live.engine.policy_version, path=state.policy_path)
