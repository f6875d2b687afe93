"""`aep-bridge up`: the whole bridge on one machine, with nothing installed by hand.

Starts an embedded `nats-server` with JetStream (unless `--nats URL` names one),
bootstraps the streams and buckets, and supervises one mapper and one pairing
worker as child processes: a worker that dies is restarted (with backoff) and the
restart is logged, except one that exits 2 (a setting it cannot use: it would exit 2 on every
restart), which stops `up` with exit 2 and that worker's message; one Ctrl-C (SIGINT) or SIGTERM stops the workers, then the
server, and leaves no process behind. While it runs, `<state dir>/up.json`
tells `demo` and `tail` where the server is.

`--gate` (off by default: the control plane is opt-in, docs/ARCHITECTURE.md
"Control plane") adds a third supervised worker, `aep-bridge gate`, accepting
both commands (``AEP_HERMES_CONTROL=1``, ``AEP_INSTRUCT=1`` unless the environment
says otherwise); its log, metrics URL and pid are kept like the others', and
up.json's ``control`` says what a shim needs to be held and steered by it.

Exposure (issue 13, finding 17): everything listens on loopback only (the embedded server
with ``-a 127.0.0.1``, the workers' HTTP ports via ``AEP_BRIDGE_METRICS_HOST=127.0.0.1``;
the embedded server has no monitoring port), and the embedded server requires a user
``aep-local`` with a password generated at each start (its config file and ``up.json`` are
mode 0600 in a 0700 state directory). The banner prints every command (`tail`, `demo`,
`control`) with that credential, so each works pasted into any shell; ``up.json`` records it
(``client_env``), and ``demo``, ``tail`` and ``control`` read it from there, so any other
local user can neither read HERMES_RAW, delete streams nor answer held calls. The shims get
users of their own (issue 44 item 4: ``aep-shim``, with ``--gate`` ``aep-shim-control``; the
rights of deploy/nats/nats.conf's ``hermes-shim`` and ``hermes-shim-control``), in the
banner's "wire Hermes" line and up.json's ``shim_env`` (``control.shim_env``): an agent that
reads its shim's settings can publish raw events, not answer its own held call nor read
HERMES_RAW or the cards. With ``--nats URL`` the server and its credentials are the caller's
(``AEP_BRIDGE_NATS_*`` from the environment).
`--export URL` (repeatable: kafka://HOST:PORT/TOPIC, otlp+http://HOST:PORT/v1/logs)
adds a supervised `aep-bridge exporter` with those sinks (bridge/services/exporter/).

The relay (`aep-bridge relay`, the AEP door for SDKs and dashboards) always runs too, on
127.0.0.1:8787 (or a free port), with a bearer token generated at each start (every right);
the banner and ``up.json`` (``relay``: url, token) give both.

`--cluster N` (N >= 3) starts N embedded servers instead of one, routed into one JetStream
cluster on loopback (``EmbeddedCluster``: each its own store under ``<state dir>/cluster/``,
the same generated client credential on all, a route credential of their own), bootstraps
every stream, bucket and object store at R3, and gives every worker (and the shim settings)
all N URLs; ``up.json`` lists the servers (``nats_servers``: name, url, pid, store). A server
that dies is reported and not restarted: the cluster goes on with the others, `tail` too.

`--fleet` (issue 41) runs the embedded server (or each `--cluster` node) in a fleet's operator
mode instead of with the generated local user: decentralized JWT auth with a `full` resolver
(bridge/nats/fleet.py). The fleet's keys live in ``<state dir>/fleet`` (made on the first
`up --fleet`, kept: the store's streams belong to its account), each worker connects with its
role's ``.creds``, and the banner prints how to issue an instance's shim settings and how to
revoke one (`aep-bridge fleet issue|revoke --dir <state dir>/fleet`), which pushes the account to
every server: nothing in the servers' configuration changes.
"""

from __future__ import annotations

import asyncio
import fcntl
import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from bridge.config import (
    BY_NAME,
    EXPORTER_METRICS_PORT,
    GATE_METRICS_PORT,
    MAPPER_METRICS_PORT,
    PAIRING_METRICS_PORT,
    Layers,
    Settings,
    default_state_dir,
    resolve_field,
)
from bridge.core.control import accepted_verbs
from bridge.hermes.install import HOOK_SOURCE, build_command, gate_timeout_s
from bridge.nats.bootstrap import bootstrap
from bridge.nats.connection import connect
from bridge.stack.demo import run_demo
from bridge.stack.server import EmbeddedCluster, EmbeddedNats, free_port, jetstream_block, port_is_free, terminate
from bridge.stack.tail import tail

LOCAL_USER = "aep-local"
# The shims' users (issue 44 item 4): what deploy/nats/nats.conf grants hermes-shim (observe-only)
# and hermes-shim-control (--gate), never LOCAL_USER's every right: with it, an agent whose tools
# run as the shim's user could approve its own held call or read HERMES_RAW and the cards.
SHIM_USER = "aep-shim"
SHIM_CONTROL_USER = "aep-shim-control"
SHIM_PERMISSIONS = {"publish": {"allow": ["hermes.raw.>"]}, "subscribe": {"allow": ["_INBOX.hermes.>"]}}
SHIM_CONTROL_PERMISSIONS = {"publish": {"allow": ["hermes.raw.>", "aep.gate.instruct.*"]},
                            "subscribe": {"allow": ["_INBOX.hermes.>"]}, "allow_responses": True}
CLUSTER_REPLICAS = 3  # `--cluster`: every stream, bucket and object store at R3
CLUSTER_READY_S = 30.0  # how long bootstrap retries while a new cluster elects its JetStream leader
RELAY_PORT = 8787
EXIT_SETTINGS = 2  # a command's exit code for a setting it cannot use (bridge/cli.py)
CREDENTIAL_KEYS = ("AEP_BRIDGE_NATS_USER", "AEP_BRIDGE_NATS_PASSWORD", "AEP_BRIDGE_NATS_TOKEN",
                   "AEP_BRIDGE_NATS_CREDS", "AEP_BRIDGE_NATS_NKEY_SEED")


def cli_command() -> str:
    """`aep-bridge` as a fresh shell finds it: the full path of the script installed beside this
    Python (the venv's bin, which need not be on PATH), else this Python with ``-m bridge.cli``."""
    import shlex

    script = Path(sys.executable).parent / "aep-bridge"
    if os.access(script, os.X_OK):
        return shlex.quote(str(script))
    return f"{shlex.quote(sys.executable)} -m bridge.cli"


def shown_url(url: str) -> str:
    """A sink URL without what may be secret (user info, the query: `sasl.password=`...)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    netloc, slash, path = rest.split("?", 1)[0].split("#", 1)[0].partition("/")
    return f"{scheme}{sep}{netloc.rsplit('@', 1)[-1]}{slash}{path}"


def state_file(state_dir: Path) -> Path:
    return state_dir / "up.json"


def apply_up_credentials(settings: Settings, state: dict[str, Any] | None, environ: dict[str, str] | None = None) -> Settings:
    """When ``settings`` point at the running `aep-bridge up`'s server and the environment names
    no credentials of its own, use the ones `up` generated for the operator's commands
    (up.json ``client_env``; ``shim_env`` is the shims' user, with the shim's rights only)."""
    env = os.environ if environ is None else environ
    shim_env = (state or {}).get("client_env") or {}
    if not shim_env.get("AEP_BRIDGE_NATS_USER") or any(env.get(k) for k in CREDENTIAL_KEYS):
        return settings
    if settings.nats_url != state.get("nats_url"):  # type: ignore[union-attr]
        return settings
    settings.nats_user = shim_env["AEP_BRIDGE_NATS_USER"]
    settings.nats_password = shim_env.get("AEP_BRIDGE_NATS_PASSWORD")
    settings.nats_token = None
    return settings


class StateDirBusy(RuntimeError):
    """Another `aep-bridge up` holds the state directory (its lock file names its pid)."""


def lock_state_dir(state_dir: Path) -> int:
    """Hold ``<state dir>/up.lock`` (flock, released when this process ends, however it ends) and
    write this pid in it; the file descriptor. Two `up`s on one state directory would open one
    store with two nats-servers (`Filestore ... Recovering stream state from index errored`):
    the second raises StateDirBusy naming the first's pid."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = state_dir / "up.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # not inherited by the children (PEP 446)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 32).decode("ascii", "replace").strip() or "?"
        os.close(fd)
        raise StateDirBusy(f"another `aep-bridge up` (pid {holder}) is running on the state directory {state_dir} "
                           f"(it holds {path}); stop it first, or give this one --state-dir DIR") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def client_settings(nats: str | None = None, environ: dict[str, str] | None = None,
                    state: dict[str, Any] | None = None, use_up: bool = True) -> Settings:
    """The settings of an operator's command (tail, demo, simulate, usage, status, control): the NATS
    URL is ``nats`` (--nats), else AEP_BRIDGE_NATS_URL, else the running `aep-bridge up`'s
    (up.json, with its generated credential), else the settings file's or the default. The one
    place this precedence is written (issue 38)."""
    env = os.environ if environ is None else environ
    if use_up and state is None:
        state = read_state()
    url = nats or (state["nats_url"] if state and "AEP_BRIDGE_NATS_URL" not in env else None)
    settings = Settings.from_env(environ, flags={"AEP_BRIDGE_NATS_URL": url} if url else None)
    return apply_up_credentials(settings, state, environ)


def read_state(state_dir: Path | None = None) -> dict[str, Any] | None:
    path = state_file(state_dir or default_state_dir())
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    pid = data.get("pid")
    if not isinstance(pid, int):
        return None
    try:
        os.kill(pid, 0)
    except OSError:
        return None  # stale: that `up` is gone
    return data


@dataclass
class Worker:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = field(default_factory=time.monotonic)
    log_offset: int = 0  # the log's size when this run started

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.log_offset = log.seek(0, os.SEEK_END)
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        log.close()
        self.started_at = time.monotonic()

    def stop(self, timeout: float = 25.0) -> None:
        terminate(self.proc, timeout)

    def last_words(self, limit: int = 4096) -> str:
        """The last line this run wrote to its log (a worker that exits 2 names the setting there)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(self.log_offset, os.path.getsize(self.log_path) - limit))
                lines = log.read().decode("utf-8", "replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1] if lines else ""


class Up:
    def __init__(self, settings: Settings, *, nats_url: str | None, port: int | None, state_dir: Path,
                 out: TextIO = sys.stdout, mapper_port: int | None = None, pairing_port: int | None = None,
                 gate: bool = False, gate_port: int | None = None, export: list[str] | None = None,
                 export_port: int | None = None, relay_port: int | None = None, cluster: int = 0,
                 fleet: bool = False) -> None:
        self.settings = settings
        self.external_url = nats_url
        self.port = port
        self.state_dir = state_dir
        self.out = out
        self.server: EmbeddedNats | EmbeddedCluster | None = None
        self.cluster = cluster  # --cluster N: N embedded servers, one JetStream cluster (0: one server)
        self.servers_down: set[str] = set()
        self.workers: list[Worker] = []
        self.mapper_port = mapper_port or (MAPPER_METRICS_PORT if port_is_free(MAPPER_METRICS_PORT) else free_port())
        self.pairing_port = pairing_port or (PAIRING_METRICS_PORT if port_is_free(PAIRING_METRICS_PORT) else free_port())
        self.gate = gate
        self.gate_port = 0
        if gate:
            self.gate_port = gate_port or (GATE_METRICS_PORT if port_is_free(GATE_METRICS_PORT) else free_port())
        # --export URL...: an `aep-bridge exporter` worker with these sinks
        self.export = list(export or [])
        self.export_port = 0
        if self.export:
            self.export_port = export_port or (EXPORTER_METRICS_PORT if port_is_free(EXPORTER_METRICS_PORT) else free_port())
        # the relay: the AEP-0003 door, on loopback, with a token generated for this run
        self.relay_port = relay_port or (RELAY_PORT if port_is_free(RELAY_PORT) else free_port())
        self.relay_token = secrets.token_urlsafe(24)
        self.url = ""
        self.stop_event: asyncio.Event | None = None
        self.refused: Worker | None = None  # a worker that exited 2: restarting cannot help
        self.password: str | None = None  # of LOCAL_USER on the embedded server (generated at start)
        self.shim_passwords: dict[str, str] = {}  # SHIM_USER's and SHIM_CONTROL_USER's (generated at start)
        self.fleet_mode = fleet  # --fleet: the embedded server(s) in a fleet's operator mode
        self.fleet: Any = None  # its bridge.nats.fleet.Fleet once started

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    # ------------------------------------------------------------ lifecycle

    def start_server(self) -> str:
        if self.external_url:
            self.say(f"aep-bridge up: using the NATS server at {self.external_url}")
            return self.external_url
        import secrets

        port = self.port if self.port is not None else (4222 if port_is_free(4222) else free_port())
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.state_dir, 0o700)
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        if self.fleet_mode:
            return self.start_fleet_server(port)
        # A credential of this run: only whoever can read the 0600 files below may connect.
        self.password = secrets.token_urlsafe(24)
        self.shim_passwords = {SHIM_USER: secrets.token_urlsafe(24), SHIM_CONTROL_USER: secrets.token_urlsafe(24)}
        users = [{"user": LOCAL_USER, "password": self.password},
                 {"user": SHIM_USER, "password": self.shim_passwords[SHIM_USER], "permissions": SHIM_PERMISSIONS},
                 {"user": SHIM_CONTROL_USER, "password": self.shim_passwords[SHIM_CONTROL_USER],
                  "permissions": SHIM_CONTROL_PERMISSIONS}]
        auth = ("# written by `aep-bridge up` at each start: the local user (every right: the operator's\n"
                "# commands and the workers) and the shims' users, with generated passwords\n"
                f"authorization {{ users: {json.dumps(users)} }}\n")
        if self.cluster:
            return self.start_cluster(port, auth)
        conf = self.state_dir / "nats-auth.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(auth + jetstream_block())
        os.chmod(conf, 0o600)
        self.server = EmbeddedNats(self.state_dir / "nats", port=port, config_file=conf,
                                   log_file=self.state_dir / "logs" / "nats-server.log")
        started = time.monotonic()
        self.server.start()
        self.say(f"aep-bridge up: embedded nats-server with JetStream on {self.server.url} "
                 f"(store {self.state_dir / 'nats'}, ready in {1000 * (time.monotonic() - started):.0f} ms)")
        return self.server.url

    def start_fleet_server(self, port: int) -> str:
        """`--fleet`: the fleet in ``<state dir>/fleet`` (made once), its resolver block as each
        server's authorization (a resolver store per server)."""
        from bridge.nats.fleet import Fleet

        fleet_dir = self.state_dir / "fleet"
        self.fleet = Fleet.load(fleet_dir) if (fleet_dir / "keys.json").exists() else Fleet.init(fleet_dir)
        if self.cluster:
            url = self.start_cluster(port, "", node_config=lambda name, store: self.fleet.resolver_conf(str(store / "jwt")))
        else:
            conf = self.state_dir / "nats-fleet.conf"
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.fleet.resolver_conf(str(self.state_dir / "nats" / "jwt")) + jetstream_block())
            os.chmod(conf, 0o600)
            self.server = EmbeddedNats(self.state_dir / "nats", port=port, config_file=conf,
                                       log_file=self.state_dir / "logs" / "nats-server.log")
            started = time.monotonic()
            self.server.start()
            url = self.server.url
            self.say(f"aep-bridge up: embedded nats-server in the fleet's operator mode on {url} "
                     f"(store {self.state_dir / 'nats'}, ready in {1000 * (time.monotonic() - started):.0f} ms)")
        self.fleet.keys["urls"] = url  # what `fleet issue` writes and `fleet revoke` pushes to
        self.fleet.save()
        return url

    async def push_fleet(self) -> None:
        """`--fleet`: the accounts AEP and FLEET to every server (the resolver keeps a newer one:
        a revocation pushed while `up` ran stays after a restart). A new cluster answers once its
        servers see each other."""
        from bridge.nats.fleet import FleetError, push

        started = time.monotonic()
        while True:
            try:
                took = await push(self.fleet, self.url, ("AEP", "FLEET"))
                break
            except (FleetError, OSError, asyncio.TimeoutError) as exc:
                if time.monotonic() - started > CLUSTER_READY_S:
                    raise RuntimeError(f"pushing the fleet's accounts: {exc}") from None
                await asyncio.sleep(0.5)
        self.say(f"aep-bridge up: fleet accounts AEP and FLEET pushed to {len(took['FLEET'])} server(s)")

    def start_cluster(self, port: int, auth: str, node_config: Any = None) -> str:
        """`--cluster N`: N servers on loopback, one JetStream cluster (``EmbeddedCluster``)."""
        cluster = EmbeddedCluster(self.state_dir / "cluster", size=self.cluster, first_port=port,
                                  client_config=auth, log_dir=self.state_dir / "logs", node_config=node_config)
        started = time.monotonic()
        self.server = cluster.start()
        self.say(f"aep-bridge up: embedded JetStream cluster of {self.cluster} nats-servers on "
                 f"{', '.join(cluster.urls)} (stores {self.state_dir / 'cluster'}/{{{','.join(cluster.names)}}}, "
                 f"listening in {1000 * (time.monotonic() - started):.0f} ms)")
        return cluster.url

    def check_servers(self) -> None:
        """`--cluster`: say once when a server has died (it is not restarted; the others go on)."""
        if not isinstance(self.server, EmbeddedCluster):
            return
        alive = sum(self.server.running())
        for name, node in zip(self.server.names, self.server.nodes):
            if name not in self.servers_down and not node.running():
                self.servers_down.add(name)
                code = node.proc.returncode if node.proc is not None else None
                self.say(f"aep-bridge up: nats-server {name} ({node.url}) exited with code {code}; the cluster goes "
                         f"on with {alive} of {self.cluster} servers (not restarted: restart `up` to bring it back "
                         f"on its store)")

    async def bootstrap(self) -> None:
        settings = self._settings("bootstrap")
        nc = await connect(settings, name="aep-bridge-up", role="bootstrap")
        try:
            started = time.monotonic()
            self.say("aep-bridge up: bootstrapping streams and buckets"
                     + (f" at R{CLUSTER_REPLICAS}" if self.cluster else "") + " ...")
            if not self.cluster:
                await bootstrap(nc.jetstream(), settings)
            else:  # a new cluster answers JetStream once it has elected its meta leader
                while True:
                    try:
                        await bootstrap(nc.jetstream(), settings, replicas=CLUSTER_REPLICAS)
                        break
                    except Exception:
                        if time.monotonic() - started > CLUSTER_READY_S:
                            raise
                        await asyncio.sleep(0.5)
            self.say(f"aep-bridge up: streams and buckets ready ({1000 * (time.monotonic() - started):.0f} ms)")
        finally:
            await nc.close()

    def _settings(self, role: str = "consumer") -> Settings:
        s = Settings.from_env()
        s.nats_url = self.url
        if self.fleet is not None:
            s.nats_user, s.nats_password, s.nats_token, s.nats_creds, s.nats_nkey_seed = (
                None, None, None, str(self.fleet.creds_path(f"aep-{role}")), None)
        elif self.password is not None:
            s.nats_user, s.nats_password, s.nats_token, s.nats_creds, s.nats_nkey_seed = (
                LOCAL_USER, self.password, None, None, None)
        return s

    def credential_env(self, role: str | None = None) -> dict[str, str]:
        """The NATS settings the operator's commands (tail, demo, control) and the workers use:
        LOCAL_USER, every right, never handed to a shim (``shim_credential_env``); with --fleet,
        a role's .creds (a shim gets its own from `aep-bridge fleet issue`)."""
        env = {"AEP_BRIDGE_NATS_URL": self.url}
        if self.fleet is not None:
            if role:
                env["AEP_BRIDGE_NATS_CREDS"] = str(self.fleet.creds_path(f"aep-{role}"))
        elif self.password is not None:
            env.update(AEP_BRIDGE_NATS_USER=LOCAL_USER, AEP_BRIDGE_NATS_PASSWORD=self.password)
        return env

    def shim_credential_env(self, control: bool = False) -> dict[str, str]:
        """The NATS settings a shim of this `up` gets: its own user, with the shim's rights only
        (publish its raw subjects, hear its inbox; ``control``: also the instruction pull and
        its answers to the gate's requests). With ``--nats URL`` the credentials are the
        caller's, as for every client."""
        env = {"AEP_BRIDGE_NATS_URL": self.url}
        if self.password is not None:
            user = SHIM_CONTROL_USER if control else SHIM_USER
            env.update(AEP_BRIDGE_NATS_USER=user, AEP_BRIDGE_NATS_PASSWORD=self.shim_passwords[user])
        return env

    def _env(self, role: str | None = None) -> dict[str, str]:
        env = dict(os.environ)
        if self.password is not None or self.fleet is not None:
            for key in CREDENTIAL_KEYS:
                env.pop(key, None)
        env.update(self.credential_env(role))
        env.setdefault("AEP_BRIDGE_LOG_FORMAT", "json")
        env["AEP_BRIDGE_METRICS_HOST"] = "127.0.0.1"  # the workers' HTTP ports: loopback only
        if self.cluster:  # what a worker creates itself (the gate's buckets) at R3 too
            env["AEP_BRIDGE_STREAM_REPLICAS"] = str(CLUSTER_REPLICAS)
        return env

    @property
    def relay_url(self) -> str:
        return f"http://127.0.0.1:{self.relay_port}"

    def _gate_env(self) -> dict[str, str]:
        """The gate accepts both commands unless the environment sets the switches itself."""
        env = self._env("gate")
        env.setdefault("AEP_HERMES_CONTROL", "1")
        env.setdefault("AEP_INSTRUCT", "1")
        return env

    def control(self) -> dict[str, Any] | None:
        """With --gate: what the gate accepts and the shim settings that use it (up.json, banner)."""
        if not self.gate:
            return None

        layers = Layers.load(self._gate_env())  # the switches and the hold as the gate and the shim read them
        on = {k: resolve_field(BY_NAME[k], layers).value for k in ("AEP_HERMES_CONTROL", "AEP_INSTRUCT")}
        hold = str(resolve_field(BY_NAME["AEP_HERMES_HOLD_MS"], layers).value)
        return {
            "accepts": accepted_verbs(on["AEP_HERMES_CONTROL"], on["AEP_INSTRUCT"]),
            "shim_env": {**self.shim_credential_env(control=True), "AEP_HERMES_CONTROL": "1", "AEP_HERMES_HOLD_MS": hold,
                         "AEP_INSTRUCT": "1"},
        }

    def start_workers(self) -> None:
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        base = [sys.executable, "-m", "bridge.cli"]
        self.workers = [
            Worker("mapper", base + ["mapper", "--metrics-port", str(self.mapper_port)], logs / "mapper.log", self._env("mapper")),
            Worker("pairing", base + ["pairing", "--metrics-port", str(self.pairing_port), "--replica", "up-pairing"],
                   logs / "pairing.log", self._env("pairing")),
        ]
        if self.gate:
            self.workers.append(Worker("gate", base + ["gate", "--metrics-port", str(self.gate_port)],
                                       logs / "gate.log", self._gate_env()))
        relay_env = {**self._env("relay"), "AEP_BRIDGE_RELAY_LISTEN": f"127.0.0.1:{self.relay_port}",
                     "AEP_BRIDGE_RELAY_TOKEN": self.relay_token}
        relay_env.pop("AEP_BRIDGE_RELAY_TOKENS_FILE", None)
        self.workers.append(Worker("relay", base + ["relay"], logs / "relay.log", relay_env))
        if self.export:
            # The sinks go in a 0600 file, not on the command line: a Kafka URL may carry a
            # SASL password, and every local user can read a process's arguments.
            sinks_file = self.state_dir / "export-sinks.json"
            fd = os.open(sinks_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps({"sinks": [{"url": url} for url in self.export]}))
            os.chmod(sinks_file, 0o600)
            self.workers.append(Worker("exporter", base + ["exporter", "--metrics-port", str(self.export_port),
                                                           "--config", str(sinks_file)],
                                       logs / "exporter.log", self._env("exporter")))
        for w in self.workers:
            w.start()

    def supervise_once(self) -> None:
        now = time.monotonic()
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is not None:
                code = w.proc.returncode
                if code == EXIT_SETTINGS:  # a setting it cannot use: it would exit 2 on every restart
                    self.say(f"aep-bridge up: {w.name} exited with code {code} (a bad setting; not restarted): "
                             f"{w.last_words() or 'see ' + str(w.log_path)}")
                    w.proc = None
                    self.refused = w
                    if self.stop_event is not None:
                        self.stop_event.set()
                    return
                w.restarts += 1
                backoff = min(10.0, 0.5 * 2 ** min(w.restarts, 5)) if now - w.started_at < 30 else 0.5
                words = w.last_words()  # why, here and not only in a log file
                self.say(f"aep-bridge up: {w.name} exited with code {code}; restarting in {backoff:.1f}s "
                         f"(restart #{w.restarts}, log: {w.log_path})" + (f": {words}" if words else ""))
                w.proc = None
                w.next_start = now + backoff
            if w.proc is None and now >= w.next_start:
                w.start()
                self.say(f"aep-bridge up: {w.name} restarted (pid {w.proc.pid if w.proc else '?'})")

    def write_state(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = state_file(self.state_dir)
        tmp = path.with_suffix(".tmp")
        metrics = {"mapper": f"http://127.0.0.1:{self.mapper_port}/metrics", "pairing": f"http://127.0.0.1:{self.pairing_port}/metrics"}
        state: dict[str, Any] = {
            "pid": os.getpid(),
            "nats_url": self.url,
            "embedded": self.server is not None,
            "metrics": metrics,
            "workers": {w.name: (w.proc.pid if w.proc else None) for w in self.workers},
            # what demo, tail and control need to connect: the generated credential, every right
            "client_env": self.credential_env(),
            # what a shim needs: its own user, with the shim's rights only (issue 44 item 4)
            "shim_env": self.shim_credential_env(),
            # the AEP door: SDKs, dashboards and `curl -H "Authorization: Bearer <token>"`
            "relay": {"url": self.relay_url, "token": self.relay_token},
        }
        if self.gate:
            metrics["gate"] = f"http://127.0.0.1:{self.gate_port}/metrics"
            state["control"] = self.control()
        if self.export:
            metrics["exporter"] = f"http://127.0.0.1:{self.export_port}/metrics"
        if self.fleet is not None:
            state["fleet"] = {"dir": str(self.fleet.dir), "consumer_creds": str(self.fleet.creds_path("aep-consumer"))}
        if isinstance(self.server, EmbeddedCluster):
            state["nats_servers"] = [
                {"name": name, "url": node.url, "pid": node.proc.pid if node.proc else None,
                 "running": node.running(), "store": str(node.store_dir)}
                for name, node in zip(self.server.names, self.server.nodes)]
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the password
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(state, indent=2))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)  # readers (demo, tail, tests) never see a half-written file

    def banner(self) -> None:
        compiled = Path(importlib.util.cache_from_source(str(HOOK_SOURCE)))
        command = build_command(sys.executable, compiled, Path("~/.hermes/aep-bridge.env"))
        settings = " ".join(f"{k}={v}" for k, v in self.credential_env("consumer" if self.fleet else None).items())
        cli = cli_command()  # full path: the commands work pasted into a fresh shell
        shim_settings = " ".join(f"{k}={v}" for k, v in self.shim_credential_env().items())
        self.say("")
        self.say("  NATS           " + self.url + ("   (loopback only)" if self.server is not None else ""))
        if isinstance(self.server, EmbeddedCluster):
            self.say(f"  cluster        {self.cluster} nats-servers, every stream at R{CLUSTER_REPLICAS}: " + ", ".join(
                f"{name} {node.url} (pid {node.proc.pid if node.proc else '?'})"
                for name, node in zip(self.server.names, self.server.nodes)))
            self.say("                 kill one (kill -9 PID): the others go on, and so does `aep-bridge tail`")
        if self.password is not None:
            self.say(f"  credential     user {LOCAL_USER}, password {self.password}   (generated for this run; "
                     f"also in {state_file(self.state_dir)}, mode 0600)")
        self.say(f"  mapper         http://127.0.0.1:{self.mapper_port}/metrics   /healthz   /readyz")
        self.say(f"  pairing        http://127.0.0.1:{self.pairing_port}/metrics   /healthz   /readyz")
        if self.gate:
            self.say(f"  gate           http://127.0.0.1:{self.gate_port}/metrics   /healthz (the hello document)   /readyz")
        if self.export:
            self.say(f"  exporter       http://127.0.0.1:{self.export_port}/metrics   /healthz   /readyz   -> "
                     + ", ".join(shown_url(u) for u in self.export))
        self.say(f"  relay (AEP)    {self.relay_url}   token {self.relay_token}   (generated for this run)")
        self.say("                 discovery /events, SSE /stream, WebSocket /socket, POST /events; /metrics")
        self.say(f"  logs           {self.state_dir / 'logs'}")
        # Every command is printed whole, with the settings it needs: it works pasted into any
        # shell (also one that cannot find up.json, e.g. after --state-dir, another XDG_STATE_HOME).
        self.say(f"  watch          {settings} {cli} tail   (--json: one event a line as JSON)")
        if self.fleet is not None:
            self.fleet_banner(command, cli)
            self.say("  stop           Ctrl-C")
            self.say("")
            return
        self.say(f"  replay a demo  {settings} {cli} demo")
        self.say(f"  wire Hermes    {shim_settings} {cli} hermes install")
        if self.password is not None:
            self.say(f"                 (user {SHIM_USER}: the shim's rights only, publish its raw events; "
                     f"user {LOCAL_USER} stays for your own commands)")
        self.say("                 (writes hooks like this into ~/.hermes/config.yaml and records consent:)")
        self.say("                   hooks:")
        self.say("                     pre_tool_call:")
        self.say(f"                       - command: \"{command}\"")
        self.say("                         timeout: 5")
        if self.gate:
            self.control_banner(command, settings, cli)
        self.say("  stop           Ctrl-C")
        self.say("")

    def fleet_banner(self, command: str, cli: str) -> None:
        d = self.fleet.dir
        self.say(f"  fleet          decentralized JWT auth; keys in {d} (0700): each instance its own credential")
        self.say(f"  issue          {cli} fleet issue --dir {d} --instance NAME --out NAME.env   (no server call)")
        self.say(f"  wire Hermes    (set -a; . ./NAME.env; {cli} hermes install)   (the settings carry the JWT)")
        self.say(f"  revoke         {cli} fleet revoke --dir {d} --instance NAME   (pushed to every server: "
                 "its live connections close, its next hook runs are refused and spooled)")
        self.say(f"  list           {cli} fleet list --dir {d}")
        if self.gate:
            self.say(f"  control plane  the gate runs: issue with --control for a shim it may hold and steer "
                     f"(`fleet issue --dir {d} --instance NAME --control`)")

    def control_banner(self, command: str, settings: str, cli: str) -> None:
        control = self.control() or {}
        shim = control.get("shim_env", {})
        accepts = ", ".join(control.get("accepts") or []) or "nothing (AEP_HERMES_CONTROL and AEP_INSTRUCT are off)"
        timeout = gate_timeout_s(int(shim.get("AEP_HERMES_HOLD_MS", 55000)), self.settings.deadline_ms)
        self.say(f"  control plane  the gate accepts {accepts}")
        self.say("                 a shim opts in (hold pre_tool_call for an answer; pull instructions before a turn):")
        self.say("                   " + " ".join(f"{k}={v}" for k, v in shim.items()) + f" {cli} hermes install")
        self.say(f"                 (the pre_tool_call hook then gets timeout: {timeout}, above the hold window)")
        self.say(f"                 held calls:  {settings} {cli} control pending")
        self.say(f"                 the hello:   {settings} {cli} control hello")
        self.say("                 then, with the same settings: `control respond REQUEST_ID allow` (or `deny`),"
                 " `control instruct --session SESSION TEXT`")

    def shutdown(self) -> None:
        # Every worker is told at once, then each is waited for: one at a time, a stop took the
        # sum of the workers' stops (3-9 s for a `up --demo --gate` under load), now their longest.
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in self.workers:
            w.stop()
        if self.server is not None:
            self.server.stop()
        try:
            state_file(self.state_dir).unlink()
        except OSError:
            pass

    async def run(self, demo: bool = False, follow: bool = True, color: bool = False) -> int:
        loop = asyncio.get_running_loop()
        self.stop_event = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop_event.set)
        try:
            self.url = self.start_server()
            if self.fleet is not None:
                await self.push_fleet()
            await self.bootstrap()
            self.start_workers()
            self.write_state()
            self.banner()
            side: asyncio.Task | None = None
            if demo:
                side = asyncio.create_task(self._demo_then_tail(follow, color))
            while not self.stop_event.is_set():
                self.check_servers()
                self.supervise_once()
                self.write_state()
                try:
                    await asyncio.wait_for(self.stop_event.wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    pass
            if side is not None:
                side.cancel()
                await asyncio.gather(side, return_exceptions=True)
            self.say("\naep-bridge up: stopping workers and the server ...")
            return EXIT_SETTINGS if self.refused is not None else 0
        finally:
            await asyncio.to_thread(self.shutdown)
            self.say("aep-bridge up: stopped")

    async def _demo_then_tail(self, follow: bool, color: bool) -> None:
        try:
            await run_demo(self._settings(), out=self.out, color=color)
        except Exception as exc:  # the demo is a convenience: report, keep the bridge up
            self.say(f"aep-bridge demo: failed: {type(exc).__name__}: {exc}")
            return
        if not follow:
            return
        self.say("aep-bridge up: following AEP_EVENTS (Ctrl-C to stop) ...")
        nc = await connect(self._settings("consumer"), name="aep-bridge-up-tail", role="consumer")
        try:
            await tail(nc, color=color, out=self.out, stop=self.stop_event)
        finally:
            await nc.close()
