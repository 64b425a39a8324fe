"""Run Search-R1's own `search_r1/search/retrieval_server.py` (from a checkout you have) on a CPU.

Search-R1's dense server is written for a GPU: it moves its encoder and every batch to CUDA (`.cuda()`), turns the
encoder to fp16 in its `__main__`, and listens on 0.0.0.0:8000 with no health route. This wrapper changes only
those, from outside the file, and then runs the file unchanged as `__main__` with Search-R1's own arguments:
- `.cuda()` of a module or a tensor returns it as it is (it stays on the CPU), `torch.cuda.empty_cache()` does
  nothing, and a module's `.half()` is a no-op (fp32: emulated fp16 on a CPU would only measure the emulation);
- `uvicorn.run` gets 127.0.0.1 and `--port`, and the app gains `GET /health` (answered once the file has loaded
  its index, corpus and encoder, since uvicorn starts after them) so `bench/peer_check.py` knows when it is up.

    python bench/search_r1_cpu.py --server ~/Search-R1/search_r1/search/retrieval_server.py --port 8002 -- \\
        --index_path IDX/index.faiss --corpus_path IDX/docs.jsonl --retriever_name e5 --retriever_model MODEL_DIR
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path
from typing import Any


def resolve_server(path: Path) -> Path:
    """A Search-R1 checkout or its server file -> the file; ValueError naming the path when there is none."""
    server = path / "search_r1" / "search" / "retrieval_server.py" if path.is_dir() else path
    if not server.is_file():
        raise ValueError(f"--search-r1: no retrieval_server.py at {server}")
    return server


def server_command(server: Path, index: Path, model_dir: str, port: int) -> list[str]:
    """This wrapper serving a sisrl flat index with Search-R1's file: its FAISS file, its corpus as jsonl (row i =
    passage i: sisrl's docs.jsonl) and the encoder directory its manifest names. Search-R1 picks the e5 prefix
    (`query: `) from the retriever name and loads the encoder with AutoModel."""
    return [sys.executable, str(Path(__file__).resolve()), "--server", str(server), "--port", str(port), "--",
            "--index_path", str(index / "index.faiss"), "--corpus_path", str(index / "docs.jsonl"), "--topk", "3",
            "--retriever_name", "e5", "--retriever_model", model_dir]


def main() -> None:
    argv = sys.argv[1:]
    rest: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", type=Path, required=True, help="Search-R1's retrieval_server.py (required)")
    parser.add_argument("--port", type=int, required=True, help="loopback port to serve on (required)")
    args = parser.parse_args(argv)
    if not args.server.is_file():
        parser.error(f"--server: {args.server} is not a file")

    import torch
    import uvicorn

    torch.nn.Module.cuda = lambda self, device=None: self  # type: ignore[method-assign,assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign,assignment]
    torch.nn.Module.half = lambda self: self  # type: ignore[method-assign,assignment]
    torch.cuda.empty_cache = lambda: None
    serve = uvicorn.run

    def run_on_loopback(app: Any, **kwargs: Any) -> None:
        app.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
        serve(app, **{**kwargs, "host": "127.0.0.1", "port": args.port, "log_level": "warning"})

    uvicorn.run = run_on_loopback  # type: ignore[assignment]
    sys.argv = [str(args.server), *rest]
    sys.path.insert(0, str(args.server.parent))
    runpy.run_path(str(args.server), run_name="__main__")


if __name__ == "__main__":
    main()
