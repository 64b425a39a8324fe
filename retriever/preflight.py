"""What `sisrl-retriever serve` checks before it loads an encoder: that there is an index to serve, or a corpus to
build one from and a place it may write it (and `build`: its corpus and its output directory). Each problem is
named in one line that says what to do, instead of a traceback after the model has loaded (in a container under a
restart policy: a crash loop).

Inside the Docker image (Dockerfile) the server runs as uid 1000 and `/data` is the bind mount of the host's
`./data` (docker-compose.yml); paths under it get the host-side hint.
"""

from __future__ import annotations

import os
from pathlib import Path

from sisrl.retriever.manifest import MANIFEST_FILE

DATA_MOUNT = Path("/data")  # the image's VOLUME, bound to ${SISRL_DATA_DIR:-./data} by docker-compose.yml
CORPUS_FORMAT = '{"id", "contents"} per line'


class PreflightError(ValueError):
    """`serve` cannot start; the message is one line naming the problem and the fix."""


def check_serve(index: Path, corpus: Path | None) -> None:
    """Raise PreflightError unless `index` holds an index, or `corpus` is a readable non-empty file and `index`
    can be created (the first existing directory on its path is writable by this process)."""
    if (index / MANIFEST_FILE).is_file():
        return  # an index to serve (its manifest is validated when it is opened); the corpus is not read
    found = [p for p in (_corpus_problem(index, corpus), _unwritable(index)) if p]
    if found:
        raise PreflightError("; ".join(found) + _hint(corpus))


def check_build(corpus: Path, out: Path) -> None:
    """`build`'s check before the encoder loads: `corpus` a readable non-empty file, `out` writable."""
    found = [p for p in (_readable(corpus), _unwritable(out)) if p]
    if found:
        raise PreflightError("; ".join(found))


def _corpus_problem(index: Path, corpus: Path | None) -> str | None:
    if corpus is None:
        return f"no index in {index} and no --corpus to build one from"
    if not corpus.is_file():
        return f"no index in {index} and no corpus at {corpus} to build one from"
    return _readable(corpus)


def _readable(corpus: Path) -> str | None:
    if not corpus.is_file():
        return f"no corpus file at {corpus} (JSONL, {CORPUS_FORMAT})"
    if not os.access(corpus, os.R_OK):
        return f"corpus {corpus} is not readable by uid {os.getuid()} (owner: uid {corpus.stat().st_uid})"
    if corpus.stat().st_size == 0:
        return f"corpus {corpus} is empty"
    return None


def _unwritable(index: Path) -> str | None:
    """Where building `index` would fail for lack of rights: the first existing directory on its path must let
    this process create entries (`build_index` makes the rest with mkdir(parents=True))."""
    existing = index.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot write the index to {index}: {existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return (f"cannot write the index to {index}: {existing} is not writable by uid {os.getuid()} "
                f"(owner: uid {existing.stat().st_uid})")
    return None


def _hint(corpus: Path | None) -> str:
    """What to do: for the image's paths in terms of the host's ./data, else in terms of the flags."""
    if corpus is not None and corpus.is_relative_to(DATA_MOUNT):
        return (f". With docker compose: put a JSONL corpus ({CORPUS_FORMAT}) at ./data/"
                f"{corpus.relative_to(DATA_MOUNT)}, run `sudo chown -R 1000 ./data`, then `docker compose up` "
                f"again (docs/retriever.md, Docker)")
    return (f". Give --corpus a JSONL file ({CORPUS_FORMAT}) and an --index directory this user may write, "
            f"or --index a built index")
