"""GET /health: liveness and what is loaded (used by the Docker healthcheck and test start-up waits)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from sisrl.retriever.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/health", response_model=Health)
async def health(request: Request) -> Health:
    searcher = request.app.state.service.searcher
    return Health(status="ok", passages=searcher.manifest.count, dim=searcher.manifest.dim,
                  encoder=searcher.manifest.encoder.model, index_type=searcher.manifest.index_type,
                  startup_seconds=round(request.app.state.startup_seconds, 3), encoder_dtype=searcher.encoder.dtype,
                  encoder_backend=searcher.encoder.backend, encoder_forward=searcher.encoder.forward,
                  **faiss_build())


def faiss_build() -> dict[str, str]:
    """The faiss version and the SIMD level its loaded library dispatches to.

    faiss-cpu >= 1.12 wheels ship one library with dynamic SIMD dispatch; the loader's log line "Could not load
    library with AVX2 support ... No module named 'faiss.swigfaiss_avx2'" comes from its search for the older
    per-ISA modules and is harmless (docs/retriever.md).
    """
    import faiss

    config = getattr(faiss, "SIMDConfig", None)
    if config is not None:
        simd = str(config.get_level_name())
    else:  # older wheels: one module per ISA, named in the compile options
        simd = " ".join(o for o in str(faiss.get_compile_options()).split() if o != "OPTIMIZE") or "NONE"
    return {"faiss_version": str(faiss.__version__), "faiss_simd": simd}
