"""Fixtures of the gateway tests: a tiny policy on disk, a real retriever over shared passages, gateways
started as real uvicorn subprocesses on free loopback ports, and a private PostgreSQL server (tests/utils/pg_cluster.py)."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from sisrl.common.procs import Service, free_port, launch_module, stop_process, wait_healthy

from tests.utils.pg_cluster import Cluster, Unavailable, start_cluster

GATEWAY_TOKEN = "test-token-123456"
NQ_QUESTIONS = 6  # nq/dev questions whose gold passages go into the small index
OTHER_PASSAGES = 50
SEED = 7


STARTUP_S = 180.0


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny Llama with the real SmolLM2 tokenizer, saved as an HF directory."""
    from sisrl.common.models import build_tiny_policy, load_tokenizer

    out = tmp_path_factory.mktemp("tiny_policy")
    tokenizer = load_tokenizer()
    build_tiny_policy(tokenizer, seed=0).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@dataclass(frozen=True)
class QASubset:
    corpus: Path
    titles: dict[str, str]  # passage id -> title line
    nq: list[dict[str, Any]]  # the nq/dev records whose gold passages are indexed


@pytest.fixture(scope="session")
def qa_subset(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> QASubset:
    """Real passages: the gold passages of the first nq/dev questions plus a fixed random sample of others."""
    with (shared_data / "nq" / "dev.jsonl").open(encoding="utf-8") as handle:
        nq = [json.loads(line) for _, line in zip(range(NQ_QUESTIONS), handle, strict=False)]
    gold = {pid for rec in nq for pid in rec["metadata"]["gold_passage_ids"]}
    lines = (shared_data / "corpus" / "wiki_passages.jsonl").read_text(encoding="utf-8").splitlines()
    others = random.Random(SEED).sample(range(len(lines)), OTHER_PASSAGES)
    keep = [json.loads(lines[i]) for i in sorted(set(others))]
    keep = [doc for doc in keep if doc["id"] not in gold] + [json.loads(lines[int(pid)]) for pid in sorted(gold)]
    assert all(doc["id"] in gold for doc in keep[-len(gold):]), "passage ids are line numbers in the corpus"
    corpus = tmp_path_factory.mktemp("qa_corpus") / "passages.jsonl"
    corpus.write_text("".join(json.dumps(doc) + "\n" for doc in keep), encoding="utf-8")
    titles = {doc["id"]: doc["contents"].split("\n", 1)[0] for doc in keep}
    return QASubset(corpus=corpus, titles=titles, nq=nq)


@pytest.fixture(scope="session")
def retriever_url(qa_subset: QASubset, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`sisrl-retriever serve` (MiniLM, exact index built by the server) over the passage subset, a subprocess."""
    index = tmp_path_factory.mktemp("qa_index")
    port = free_port()
    log = tmp_path_factory.mktemp("logs") / "retriever.log"
    service = launch_module("retriever", "sisrl.retriever.cli",
                            ["serve", "--index", str(index), "--corpus", str(qa_subset.corpus), "--encoder", "minilm",
                             "--dtype", "float32", "--port", str(port), "--log-level", "warning"], port=port, log=log)
    wait_healthy(service, timeout_s=STARTUP_S)
    yield service.url
    service.stop()


@dataclass
class Gateway:
    """A `sisrl-gateway serve` subprocess; `client` carries the bearer token when one is set."""

    url: str
    args: list[str]
    db_url: str
    log: Path
    process: subprocess.Popen[bytes]
    root: Path = Path(".")  # the checkpoint root (POST /v1/policy)
    token: str | None = None
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def wait_batch(self, batch_id: str, timeout: float = 120.0) -> dict[str, Any]:
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            body: dict[str, Any] = self.client.get(f"/v1/batches/{batch_id}").raise_for_status().json()
            if body["status"] != "running":
                return body
            time.sleep(0.1)
        raise TimeoutError(f"batch {batch_id} still running after {timeout}s")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.client.close()
        stop_process(self.process, sig)


GatewayFactory = Callable[..., Gateway]


@pytest.fixture(scope="session")
def start_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayFactory]:
    """Factory: start a gateway with the given CLI options (db defaults to a fresh SQLite file)."""
    started: list[Gateway] = []

    def start(*options: str, db_url: str | None = None, token: str | None = None,
              env: dict[str, str | None] | None = None) -> Gateway:
        tmp = tmp_path_factory.mktemp("gateway")
        db_url = db_url or f"sqlite:///{tmp / 'rollouts.db'}"
        port = free_port()
        args = ["serve", "--port", str(port), "--db-url", db_url, "--checkpoint-root", str(tmp), *options]
        env = {"SISRL_GATEWAY_LOG_LEVEL": "warning", "SISRL_GATEWAY_API_TOKEN": token, **(env or {})}  # None: unset
        service = launch_module("gateway", "sisrl.services.cli", args, port=port, log=tmp / "gateway.log", env=env)
        wait_healthy(service, timeout_s=STARTUP_S)
        gateway = Gateway(url=service.url, args=args, db_url=db_url, log=service.log, process=service.process,
                          root=tmp, token=token)
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        gateway.stop()


def rollout_body(items: list[dict[str, Any]], **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"run": "test", "step": 0, "policy_version": 0, "items": items, "samples_per_item": 1,
                            "sampling": {"max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0,
                                         "logprobs_k": 5, "seed": 1},
                            "max_turns": 2, "idempotency_key": None}
    body.update(overrides)
    return body


def nq_item(record: dict[str, Any]) -> dict[str, Any]:
    return {"id": record["id"], "question": record["question"], "golden_answers": record["golden_answers"],
            "data_source": "nq"}


@pytest.fixture(scope="session")
def make_body() -> Callable[..., dict[str, Any]]:
    """Builder of `POST /v1/rollouts` bodies (keyword overrides replace top-level fields)."""
    return rollout_body


@pytest.fixture(scope="session")
def to_item() -> Callable[[dict[str, Any]], dict[str, Any]]:
    """An nq/dev record as a rollout item."""
    return nq_item


# --- engines: the OpenAI-compatible policy server (sisrl.services.engines.openai_server) ---------------------


@dataclass
class PolicyServer:
    """`python -m sisrl.services.engines.openai_server` over the tiny policy; weights load from `checkpoint_root`."""

    url: str
    checkpoint_root: Path
    log: Path
    process: subprocess.Popen[bytes]


@pytest.fixture(scope="session")
def policy_server(tiny_policy_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                  request: pytest.FixtureRequest) -> Iterator[PolicyServer]:
    """One policy server for the session (max_tokens capped at 16 so schema fuzzing stays fast). When the
    session also has tests of `policy_server_b`, that server is launched here too, so the two start-ups (mostly
    imports, one core each) overlap."""
    root = tmp_path_factory.mktemp("policy_checkpoints")
    log = tmp_path_factory.mktemp("policy_server") / "server.log"
    port = free_port()
    service = launch_module("policy server", "sisrl.services.engines.openai_server",
                            ["--model", str(tiny_policy_dir), "--port", str(port), "--checkpoint-root", str(root),
                             "--max-tokens", "16", "--log-level", "warning", "--threads", "1", "--dtype", "float32"],
                            port=port, log=log, env={"SISRL_ENGINE_API_TOKEN": None})
    second = None
    if any("policy_server_b" in item.fixturenames for item in request.session.items):
        second = SecondPolicyServer.under(tiny_policy_dir, tmp_path_factory)
        _EARLY_B.append((second, second.launch()))
    try:
        wait_healthy(service, timeout_s=STARTUP_S)
    except RuntimeError:
        if second is not None:
            second.stop()
        raise
    yield PolicyServer(url=service.url, checkpoint_root=root, log=log, process=service.process)
    service.stop()
    if second is not None:
        second.stop()  # a no-op once policy_server_b has stopped it


ENGINE_TOKEN = "engine-token-123456"


@dataclass
class SecondPolicyServer:
    """A second policy server (restartable on its port), requiring the bearer token ENGINE_TOKEN: its own
    checkpoint root, so a checkpoint can exist for one server and not the other (tests/services/test_engine_pool.py)."""

    model: Path
    root: Path
    log: Path
    port: int
    process: subprocess.Popen[bytes] | None = None
    token: str = ENGINE_TOKEN

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def under(cls, model: Path, tmp_path_factory: pytest.TempPathFactory) -> SecondPolicyServer:
        tmp = tmp_path_factory.mktemp("policy_server_b")
        (tmp / "root").mkdir()
        return cls(model=model, root=tmp / "root", log=tmp / "server.log", port=free_port())

    def launch(self) -> Service:
        """Start the process and return at once (`start` waits for /health too)."""
        service = launch_module(
            "policy server B", "sisrl.services.engines.openai_server",
            ["--model", str(self.model), "--port", str(self.port), "--checkpoint-root", str(self.root),
             "--max-tokens", "16", "--log-level", "warning", "--threads", "1", "--dtype", "float32"],
            port=self.port, log=self.log, env={"SISRL_ENGINE_API_TOKEN": self.token})
        self.process = service.process
        return service

    def start(self) -> None:
        wait_healthy(self.launch(), timeout_s=STARTUP_S)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)


_EARLY_B: list[tuple[SecondPolicyServer, Service]] = []  # launched by `policy_server`, awaited by `policy_server_b`


@pytest.fixture(scope="session")
def policy_server_b(policy_server: PolicyServer, tiny_policy_dir: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecondPolicyServer]:
    """The second server; after `policy_server` so that fixture can launch both at once."""
    if _EARLY_B:
        second, service = _EARLY_B.pop()
        wait_healthy(service, timeout_s=STARTUP_S)
    else:
        second = SecondPolicyServer.under(tiny_policy_dir, tmp_path_factory)
        second.start()
    yield second
    second.stop()


@pytest.fixture(scope="session")
def gateway_token() -> str:
    return GATEWAY_TOKEN


@pytest.fixture(scope="session")
def local_gateway(start_gateway: GatewayFactory, tiny_policy_dir: Path, retriever_url: str) -> Gateway:
    """The tiny policy on the local engine behind a gateway with a bearer token and small work limits."""
    return start_gateway("--engine", "local", "--model", str(tiny_policy_dir), "--dtype", "float32",
                         "--retriever-url", retriever_url,
                         "--max-pending", "8", "--max-response-tokens", "128", "--max-request-bytes", "65536",
                         token=GATEWAY_TOKEN)


@pytest.fixture(scope="session")
def free_port_fn() -> Callable[[], int]:
    return free_port


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """The CI box has 2 cores shared by several jobs; spinning intra-op threads there cost ~100x per matmul."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- the viewer and SIS records: a store of real trajectories, copied per module; store-only gateways over it ---


@pytest.fixture(scope="session")
def viewer_template(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A SQLite store filled once per session by the gateway's batch runner (tests/services/viewer_data.py)."""
    from tests.services.viewer_data import fill_store

    return fill_store(f"sqlite:///{tmp_path_factory.mktemp('viewer_template') / 'rollouts.db'}")


@pytest.fixture(scope="module")
def viewer_store(viewer_template: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """This module's own copy of the template store (tests that post records do not see each other's)."""
    source = Path(viewer_template.db_url.removeprefix("sqlite:///"))
    target = tmp_path_factory.mktemp("viewer_store") / "rollouts.db"
    for suffix in ("", "-wal", "-shm"):
        if source.with_name(source.name + suffix).is_file():
            shutil.copyfile(source.with_name(source.name + suffix), target.with_name(target.name + suffix))
    return replace(viewer_template, db_url=f"sqlite:///{target}")


@pytest.fixture(scope="module")
def store_only_gateway(start_gateway: GatewayFactory, viewer_store: Any) -> Iterator[Gateway]:
    """`sisrl-gateway serve --store-only` over this module's store, with a bearer token; stopped after the module."""
    gateway = start_gateway("--store-only", "--max-request-bytes", "262144", db_url=viewer_store.db_url,
                            token=GATEWAY_TOKEN)
    yield gateway
    gateway.stop()


# --- PostgreSQL: one private server per session, a fresh database per test ---------------------------------------


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[Cluster]:
    """A PostgreSQL server of our own on a free loopback port, removed after the session; skips where none can run."""
    pytest.importorskip("psycopg", reason="psycopg 3 is not installed (pip install 'psycopg[binary]')")
    try:
        cluster = start_cluster()
    except Unavailable as exc:
        pytest.skip(str(exc))
    yield cluster
    cluster.stop()


@pytest.fixture
def pg_url(pg_cluster: Cluster) -> str:
    """SQLAlchemy URL (postgresql+psycopg://) of a new empty database on the session's server."""
    return pg_cluster.create_database()
