"""A throwaway PostgreSQL cluster for tests and benchmarks: `initdb` in a temp dir, `pg_ctl start` on a free
loopback port, fresh databases on demand, `pg_ctl stop` and removal at the end. No server binary: `Unavailable`
(the tests skip, saying so). Never for data you keep: durability is off. Tests import it as `tests.utils.pg_cluster`;
bench/scale_out.py loads it by path (bench/bench_module.py).

PostgreSQL refuses to run as root, so as root the server commands run as the `postgres` OS user (`runuser`)
in a directory handed to that user. Durability is switched off (fsync, synchronous_commit, full_page_writes):
the cluster is thrown away, and these make it several times faster on a shared machine.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from sisrl.common.procs import LOOPBACK, free_port

SERVER_USER = "postgres"
BINARIES = ("initdb", "pg_ctl")


class Unavailable(RuntimeError):
    """No PostgreSQL server can be started here (the message says why): the caller skips."""


@dataclass
class Cluster:
    root: Path  # removed by `stop`
    data: Path
    port: int
    pg_ctl: str
    as_user: list[str]  # the command prefix that runs a server binary as SERVER_USER ([] when not root)

    def url(self, database: str) -> str:
        """SQLAlchemy URL of `database` (psycopg 3 driver)."""
        return f"postgresql+psycopg://{SERVER_USER}@{LOOPBACK}:{self.port}/{database}"

    def create_database(self) -> str:
        """A new empty database; returns its SQLAlchemy URL."""
        import psycopg
        from psycopg import sql

        name = f"t_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(host=LOOPBACK, port=self.port, user=SERVER_USER, dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def stop(self) -> None:
        # `immediate`: no checkpoint, the data is thrown away next.
        subprocess.run([*self.as_user, self.pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop"],
                       capture_output=True, check=False, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


def find_binaries() -> dict[str, str]:
    """initdb and pg_ctl from PATH, else from Debian's /usr/lib/postgresql/<version>/bin (the newest)."""
    found = {name: shutil.which(name) for name in BINARIES}
    for bindir in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        for name in BINARIES:
            candidate = os.path.join(bindir, name)
            if found[name] is None and os.access(candidate, os.X_OK):
                found[name] = candidate
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise Unavailable(f"PostgreSQL server binaries {missing} not found on PATH or in /usr/lib/postgresql/*/bin "
                          "(install the postgresql server package to run the PostgreSQL store tests)")
    return {name: str(path) for name, path in found.items()}


def _as_server_user(root: Path) -> list[str]:
    if os.geteuid() != 0:
        return []
    try:
        user = pwd.getpwnam(SERVER_USER)
    except KeyError:
        raise Unavailable(f"running as root and there is no {SERVER_USER!r} OS user to run PostgreSQL as") from None
    runuser = shutil.which("runuser")
    if runuser is None:
        raise Unavailable("running as root and `runuser` (util-linux) is missing: cannot run PostgreSQL as "
                          f"{SERVER_USER!r}")
    os.chown(root, user.pw_uid, user.pw_gid)
    return [runuser, "-u", SERVER_USER, "--"]


def start_cluster() -> Cluster:
    """initdb + start on a free port; raises Unavailable (binaries or user missing) or RuntimeError (failed)."""
    binaries = find_binaries()
    root = Path(tempfile.mkdtemp(prefix="sisrl-pg-"))
    try:
        as_user = _as_server_user(root)
        data, log = root / "data", root / "server.log"
        _run([*as_user, binaries["initdb"], "-D", str(data), "-U", SERVER_USER, "--auth=trust", "-E", "UTF8",
              "--locale=C", "--no-sync"], what="initdb")
        port = free_port()
        settings = {"port": str(port), "listen_addresses": f"'{LOOPBACK}'", "unix_socket_directories": f"'{root}'",
                    "fsync": "off", "synchronous_commit": "off", "full_page_writes": "off", "max_connections": "200"}
        with (data / "postgresql.conf").open("a", encoding="utf-8") as conf:
            conf.write("".join(f"{key} = {value}\n" for key, value in settings.items()))
        _run([*as_user, binaries["pg_ctl"], "-D", str(data), "-l", str(log), "-w", "-t", "60", "start"],
             what="pg_ctl start", log=log)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return Cluster(root=root, data=data, port=port, pg_ctl=binaries["pg_ctl"], as_user=as_user)


def _run(command: list[str], *, what: str, log: Path | None = None) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=120)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:] if log is not None and log.is_file() else ""
        raise RuntimeError(f"{what} failed with exit code {done.returncode}:\n{done.stdout}{done.stderr}{tail}")
