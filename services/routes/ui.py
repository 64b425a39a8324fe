"""`/ui`: the rollout viewer, static files shipped in the package (services/ui/; no CDN, nothing external).

The page and its assets carry no data, so they are served without the token; the page asks for the token when
`/health` says one is required, keeps it in sessionStorage and sends it as `Authorization: Bearer` (never in a
URL). The Content-Security-Policy allows this origin only, so an external asset could not load even by mistake.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException, status
from fastapi.responses import FileResponse

UI_DIR = Path(__file__).resolve().parent.parent / "ui"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}

router = APIRouter(prefix="/ui", tags=["ui"], include_in_schema=False)


def _asset(name: str) -> FileResponse:
    path = UI_DIR / name
    if "/" in name or path.suffix not in _TYPES or not path.is_file():
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no viewer asset {name!r}")
    return FileResponse(path, media_type=_TYPES[path.suffix], headers=HEADERS)


@router.get("")
def index() -> FileResponse:
    return _asset("index.html")


@router.get("/{name}")
def asset(name: str) -> FileResponse:
    return _asset(name)
