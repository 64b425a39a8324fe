"""`POST /v1/load_weights`: a safetensors directory under `--checkpoint-root` becomes the served policy."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from sisrl.services.engines.openai_server.deps import EngineDep, SettingsDep
from sisrl.services.engines.openai_server.schemas import LoadWeightsRequest, LoadWeightsResponse
from sisrl.services.engines.openai_server.settings import ServerSettings

router = APIRouter(prefix="/v1/load_weights", tags=["weights"])


@router.post("", response_model=LoadWeightsResponse,
             responses={400: {"description": "unusable path, or weights that do not fit the model"},
                        403: {"description": "loading is off, or the path is outside the checkpoint root"},
                        404: {"description": "no weights at path"}})
async def load_weights(body: LoadWeightsRequest, engine: EngineDep, settings: SettingsDep) -> LoadWeightsResponse:
    path = _checked_weights_path(body.path, settings)
    try:
        await engine.load_weights(str(path), body.version)
    except FileNotFoundError as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from exc
    except (ValueError, OSError) as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from exc
    return LoadWeightsResponse(policy_version=engine.policy_version)


def _checked_weights_path(given: str, settings: ServerSettings) -> Path:
    """The resolved path, or 403 when loading is off or the path escapes the checkpoint root."""
    if settings.checkpoint_root is None:
        raise HTTPException(
            status_code=403, detail="weight loading is off; start the server with --checkpoint-root"
        )
    if "\x00" in given:
        raise HTTPException(status_code=400, detail="path contains a NUL character")
    root = Path(settings.checkpoint_root).resolve()
    try:
        path = (root / given).resolve()
    except (OSError, RuntimeError) as exc:  # e.g. a name too long, a symlink loop
        raise HTTPException(status_code=400, detail=f"bad path {given!r}: {exc}") from exc
    if not path.is_relative_to(root):
        raise HTTPException(
            status_code=403, detail=f"path {given!r} is outside the checkpoint root {str(root)!r}"
        )
    return path
