"""A fleet's own identities: NATS decentralized JWT auth (`aep-bridge fleet`, issue 41).

``init`` makes, in a 0700 directory of 0600 files (``keys.json``: every seed):

* an operator, and a system account ``SYS`` with a user ``sys`` (pushes account updates);
* the account ``AEP``: the streams and buckets (JetStream on) and one user per role
  (``creds/aep-<role>.creds``) with the permissions of deploy/nats/nats.conf
  (``bridge/data/role_permissions.json``, kept equal to it by a test);
* the account ``FLEET``: the Hermes instances, each a user signed by a **scoped signing
  key** whose template binds it to its own instance (the user's ``name`` is its instance
  token): publish ``hermes.raw.{{name()}}.>`` only, subscribe ``_INBOX.hermes.{{name()}}.>``
  only; ``bearer_token`` (the shim sends the JWT with no nonce signature; see
  docs/THREAT_MODEL.md); the ``instance-control`` key adds the instruction pull and one
  reply to the gate's requests;
* between the two accounts, services: AEP exports ``hermes.raw.>`` (and
  ``aep.gate.instruct.*``) and FLEET imports them, so a shim's publish lands in HERMES_RAW
  and JetStream's PubAck travels back to the shim's inbox; FLEET exports ``_INBOX.hermes.>``
  to AEP (the gate's requests to a held call's shim);
* ``resolver.conf``: the block a nats-server includes (operator, system account, a ``full``
  resolver, the system account preloaded). AEP and FLEET are pushed once the servers run
  (``push``) and kept in each resolver's directory: a preloaded account JWT would replace a newer
  pushed one at every restart, undoing revocations.

``issue`` signs an instance's user JWT offline (no server call) and returns the shim's
settings; ``revoke`` adds the user keys of an instance to FLEET's revocations and ``push``
sends the account to every server (``$SYS.REQ.CLAIMS.UPDATE`` as ``sys``), which drops the
instance's live connections. ``registry.json`` records what was issued, revoked, expired.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.nats import jwt as J
from bridge.shim.hook import token

ROLE_PERMISSIONS_FILE = Path(__file__).resolve().parent.parent / "data" / "role_permissions.json"
FLEET_ACCOUNT, BRIDGE_ACCOUNT, SYSTEM_ACCOUNT = "FLEET", "AEP", "SYS"
SCOPES = ("instance", "instance-control")
DEFAULT_EXPIRES_S = 30 * 86400
#: Roles that answer requests from FLEET: across accounts the reply subject is a ``_R_.…`` the
#: server made, not the shim's inbox, so the gate (the instruction pull's answers) needs
#: ``allow_responses`` (one reply per request it received) in this mode.
ANSWERS_ACROSS_ACCOUNTS = ("aep-gate",)
NO_USER_LIMITS = {"subs": -1, "data": -1, "payload": -1}


class FleetError(RuntimeError):
    """A fleet directory that is missing, unreadable or asked something it cannot do."""


def parse_duration(text: str) -> int:
    """``30d``, ``12h``, ``90m``, ``45s`` (or plain seconds) -> seconds; ``0``/``never`` -> 0."""
    text = text.strip().lower()
    if text in ("0", "never", "none"):
        return 0
    m = re.fullmatch(r"(\d+)\s*([smhdw]?)", text)
    if not m:
        raise FleetError(f"not a duration: {text!r} (e.g. 30d, 12h, 90m, 45s)")
    return int(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2)]


def role_permissions() -> dict[str, dict[str, Any]]:
    """{user: {"pub": [...], "sub": [...], "resp": bool}} of the bridge's roles."""
    return json.loads(ROLE_PERMISSIONS_FILE.read_text())


def write_role_permissions(conf: str | Path) -> None:
    """Regenerate ``bridge/data/role_permissions.json`` from a nats.conf (deploy/nats/nats.conf)
    after its roles' rules change: ``python -c 'from bridge.nats.fleet import *;
    write_role_permissions("deploy/nats/nats.conf")'``."""
    rules = permissions_from_conf(Path(conf).read_text())
    ROLE_PERMISSIONS_FILE.write_text(json.dumps(rules, indent=1, sort_keys=True) + "\n")


def permissions_from_conf(text: str) -> dict[str, dict[str, Any]]:
    """The ``aep-*`` users of a nats.conf written like deploy/nats/nats.conf (a ``NAME_PERMISSIONS``
    block per role, referenced as ``permissions: $NAME_PERMISSIONS``)."""
    text = re.sub(r"#[^\n]*", "", text)
    named = dict(re.findall(r"^(\w+_PERMISSIONS) = \{(.*?)^\}", text, flags=re.M | re.S))

    def allowed(body: str, kind: str) -> list[str]:
        m = re.search(kind + r":\s*\{\s*allow:\s*\[(.*?)\]", body, flags=re.S)
        return sorted(re.findall(r'"([^"]+)"', m.group(1))) if m else []

    out = {}
    for user, ref in re.findall(r"user:\s*(aep-[\w-]+).*?permissions:\s*\$(\w+)", text):
        body = named[ref]
        resp = re.search(r"allow_responses:\s*(\w+)", body)
        out[user] = {"pub": allowed(body, "publish"), "sub": allowed(body, "subscribe"),
                     "resp": bool(resp) and resp.group(1) == "true"}
    return out


@contextmanager
def locked(directory: str | Path) -> Iterator[None]:
    """One `fleet` command at a time changes a keys directory (``.lock``, flock)."""
    import fcntl

    directory = Path(directory)
    if not directory.is_dir():
        yield
        return
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)


def write_private(path: Path, text: str) -> None:
    """Atomically write ``text`` to ``path``, mode 0600."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _user_limits(pub: list[str], sub: list[str], resp: bool = False, bearer: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"pub": {"allow": pub}, "sub": {"allow": sub}, **NO_USER_LIMITS}
    if resp:
        out["resp"] = {"max": 1, "ttl": 0}
    if bearer:
        out["bearer_token"] = True
    return out


def instance_template(control: bool) -> dict[str, Any]:
    """The permissions a scoped key puts in each of its users (``{{name()}}``: the user's name,
    its instance token)."""
    pub = ["hermes.raw.{{name()}}.>"] + (["aep.gate.instruct.*"] if control else [])
    return _user_limits(pub, ["_INBOX.hermes.{{name()}}.>"], resp=control, bearer=True)


@dataclass
class Issued:
    instance: str
    user: str  # the user's public nkey
    issued: int
    expires: int  # 0: never
    scope: str
    revoked: int = 0
    signer: str = ""  # the scoped signing key's public key

    def state(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        if self.revoked:
            return "revoked"
        if self.expires and self.expires <= now:
            return "expired"
        return "issued"


@dataclass
class Fleet:
    """The keys directory (see the module docstring)."""

    dir: Path
    keys: dict[str, Any]
    issued: list[Issued] = field(default_factory=list)

    # ------------------------------------------------------------ create / load

    @classmethod
    def init(cls, directory: str | Path, urls: str = "", resolver_dir: str = "jwt") -> "Fleet":
        directory = Path(directory)
        if (directory / "keys.json").exists():
            raise FleetError(f"{directory} already holds a fleet (keys.json); use another --dir")
        _private_dir(directory)
        now = int(time.time())
        op = J.Key.new("operator")
        keys: dict[str, Any] = {"operator": {"public": op.public, "seed": op.seed}, "accounts": {},
                                "urls": urls, "resolver_dir": resolver_dir, "created": now}
        for name in (SYSTEM_ACCOUNT, BRIDGE_ACCOUNT, FLEET_ACCOUNT):
            k = J.Key.new("account")
            keys["accounts"][name] = {"public": k.public, "seed": k.seed, "revocations": {}}
        for scope in SCOPES:
            k = J.Key.new("account")
            keys["accounts"][FLEET_ACCOUNT].setdefault("scoped", {})[scope] = {"public": k.public, "seed": k.seed}
        fleet = cls(directory, keys)
        fleet.save()
        _private_dir(directory / "creds")
        sys_user = fleet.sign_user(SYSTEM_ACCOUNT, "sys", dict(NO_USER_LIMITS))
        write_private(directory / "creds" / "sys.creds", sys_user)
        fleet.reissue_roles()
        fleet.write_resolver_conf()
        return fleet

    def reissue_roles(self, roles: list[str] | None = None) -> list[str]:
        """New ``creds/<role>.creds`` for ``roles`` (default: every role); the users they replace
        are revoked in AEP (``push`` it: their connections close, and the services, restarted with
        the new files, connect again). Returns the roles re-issued."""
        perms = role_permissions()
        unknown = sorted(set(roles or []) - set(perms))
        if unknown:
            raise FleetError(f"unknown role(s) {', '.join(unknown)} (one of {', '.join(sorted(perms))})")
        acc = self.keys["accounts"][BRIDGE_ACCOUNT]
        users = self.keys.setdefault("roles", {})
        now = int(time.time())
        done = []
        for user in roles or sorted(perms):
            perm = perms[user]
            resp = perm["resp"] or user in ANSWERS_ACROSS_ACCOUNTS
            creds = self.sign_user(BRIDGE_ACCOUNT, user, _user_limits(perm["pub"], perm["sub"], resp))
            if users.get(user):
                acc.setdefault("revocations", {})[users[user]] = now
            users[user] = J.decode(J.creds_jwt(creds), verify=False)["sub"]
            write_private(self.creds_path(user), creds)
            done.append(user)
        if any(v == now for v in acc.get("revocations", {}).values()):
            acc["updated"] = max(now, acc.get("updated", 0) + 1)
        self.save()
        return done

    @classmethod
    def load(cls, directory: str | Path) -> "Fleet":
        directory = Path(directory)
        try:
            keys = json.loads((directory / "keys.json").read_text())
        except FileNotFoundError:
            raise FleetError(f"no fleet in {directory} (run `aep-bridge fleet init --dir {directory}`)") from None
        except (OSError, ValueError) as exc:
            raise FleetError(f"{directory / 'keys.json'}: {exc}") from None
        issued = []
        try:
            reg = json.loads((directory / "registry.json").read_text())
            issued = [Issued(**r) for r in reg.get("issued", [])]
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError) as exc:
            raise FleetError(f"{directory / 'registry.json'}: {exc}") from None
        return cls(directory, keys, issued)

    def save(self) -> None:
        write_private(self.dir / "keys.json", json.dumps(self.keys, indent=1))
        write_private(self.dir / "registry.json",
                      json.dumps({"issued": [vars(i) for i in self.issued]}, separators=(",", ":")))

    # ------------------------------------------------------------ JWTs

    def key(self, account: str, scope: str | None = None) -> J.Key:
        acc = self.keys["accounts"][account]
        k = acc["scoped"][scope] if scope else acc
        return J.Key(k["public"], k["seed"])

    @property
    def operator(self) -> J.Key:
        return J.Key(self.keys["operator"]["public"], self.keys["operator"]["seed"])

    def operator_jwt(self) -> str:
        op = self.operator
        return J.encode(J.claims("operator", op.public, "aep-fleet",
                                 {"system_account": self.key(SYSTEM_ACCOUNT).public},
                                 issued=self.keys["created"]), op)

    def account_jwt(self, name: str) -> str:
        """The account's JWT as it stands (revocations included), signed by the operator."""
        acc = self.keys["accounts"][name]
        pub = acc["public"]
        nats: dict[str, Any] = {"limits": dict(J.NO_LIMITS)}
        bridge, fleet = self.key(BRIDGE_ACCOUNT).public, self.key(FLEET_ACCOUNT).public
        if name == BRIDGE_ACCOUNT:
            nats["limits"].update(J.JETSTREAM_UNLIMITED)
            nats["exports"] = [
                {"name": "hermes-raw", "subject": "hermes.raw.>", "type": "service", "response_type": "Singleton"},
                {"name": "gate-instruct", "subject": "aep.gate.instruct.*", "type": "service",
                 "response_type": "Singleton"},
            ]
            nats["imports"] = [{"name": "shim-inboxes", "subject": "_INBOX.hermes.>", "account": fleet,
                                "type": "service"}]
        elif name == FLEET_ACCOUNT:
            nats["imports"] = [
                {"name": "hermes-raw", "subject": "hermes.raw.>", "account": bridge, "type": "service"},
                {"name": "gate-instruct", "subject": "aep.gate.instruct.*", "account": bridge, "type": "service"},
            ]
            nats["exports"] = [{"name": "shim-inboxes", "subject": "_INBOX.hermes.>", "type": "service",
                                "response_type": "Singleton"}]
            scoped = [(scope, k) for scope, k in acc["scoped"].items()]
            scoped += [(k["scope"], k) for k in acc.get("retiring", [])]  # `rotate`: still valid until --retire
            nats["signing_keys"] = [
                {"kind": "user_scope", "key": k["public"], "role": scope, "template": instance_template(scope != "instance")}
                for scope, k in scoped]
            # Nobody else in this account: a user signed by the account's own key gets nothing.
            nats["default_permissions"] = {"pub": {"deny": [">"]}, "sub": {"deny": [">"]}}
        if acc.get("revocations"):
            # A revocation matters only until the credential's own expiry: past it, the server
            # refuses it anyway, so the account JWT (pushed in one message) does not grow forever.
            now = time.time()
            ended = {r.user for r in self.issued if r.expires and r.expires < now} if name == FLEET_ACCOUNT else set()
            kept = {u: t for u, t in acc["revocations"].items() if u not in ended}
            if kept:
                nats["revocations"] = kept
        issued = max([self.keys["created"], acc.get("updated", 0), *acc.get("revocations", {}).values()])
        return J.encode(J.claims("account", pub, name, nats, issued=issued), self.operator)

    def sign_user(self, account: str, name: str, limits: dict[str, Any], expires: int = 0,
                  scope: str | None = None) -> str:
        """A ``.creds`` file for a new user of ``account``."""
        user = J.Key.new("user")
        nats: dict[str, Any] = {"issuer_account": self.key(account).public} if scope else {}
        nats.update(limits)
        jwt = J.encode(J.claims("user", user.public, name, nats, expires=expires), self.key(account, scope))
        return J.creds(jwt, user.seed)

    # ------------------------------------------------------------ the servers' side

    def resolver_conf(self, resolver_dir: str | None = None) -> str:
        """What a nats-server's config includes to trust this fleet (no users, no passwords)."""
        dir_ = resolver_dir or self.keys.get("resolver_dir") or "jwt"
        sys_pub = self.key(SYSTEM_ACCOUNT).public
        return ("# written by `aep-bridge fleet init`: the operator, its system account and a full resolver.\n"
                "# Issuing and revoking instances never changes this file: the accounts AEP and FLEET are\n"
                "# pushed (`aep-bridge fleet push` once after the first start, `fleet revoke` after that) and\n"
                "# kept in the resolver's dir. (Preloaded, they would replace a newer pushed JWT at each restart:\n"
                "# a revocation would be undone.)\n"
                f"operator: {json.dumps(self.operator_jwt())}\n"
                f"system_account: {self.key(SYSTEM_ACCOUNT).public}\n"
                f"resolver {{\n  type: full\n  dir: {json.dumps(str(dir_))}\n  allow_delete: false\n"
                f"  interval: \"2m\"\n  timeout: \"5s\"\n}}\n"
                f"resolver_preload {{\n  {sys_pub}: {json.dumps(self.account_jwt(SYSTEM_ACCOUNT))}\n}}\n")

    def write_resolver_conf(self) -> Path:
        path = self.dir / "resolver.conf"
        write_private(path, self.resolver_conf())
        write_private(self.dir / "helm-values.yaml", "# written by `aep-bridge fleet init`: the bundled NATS "
                      "server's operator, system account and resolver (then `aep-bridge fleet push`)\n# (with deploy/helm/aep-bridge/"
                      "values-fleet.yaml; public JWTs, no secret).\n" + json.dumps(self.helm_values(), indent=1) + "\n")
        return path

    def helm_values(self) -> dict[str, Any]:
        """Chart values (the official NATS chart's ``config.merge``) that make the bundled server trust
        this fleet: JSON is YAML, so ``helm -f`` takes it as is."""
        return {"nats": {"config": {"merge": {
            "operator": self.operator_jwt(),
            "system_account": self.key(SYSTEM_ACCOUNT).public,
            "resolver_preload": {self.key(SYSTEM_ACCOUNT).public: self.account_jwt(SYSTEM_ACCOUNT)},
        }}}}

    def creds_path(self, user: str) -> Path:
        """``creds/<user>.creds``: ``sys``, ``aep-mapper``, ``aep-bootstrap``, ..."""
        return self.dir / "creds" / f"{user}.creds"

    # ------------------------------------------------------------ instances

    def issue(self, instance: str, expires_s: int = DEFAULT_EXPIRES_S, control: bool = False,
              urls: str | None = None, save: bool = True) -> tuple[str, Issued]:
        """The shim settings of ``instance`` (KEY=VALUE lines, the JWT inside) and its record."""
        if not instance or instance != instance.strip():
            raise FleetError("--instance must be a non-empty name without surrounding spaces")
        now = int(time.time())
        scope = "instance-control" if control else "instance"
        expires = now + expires_s if expires_s else 0
        user = J.Key.new("user")
        nats = {"issuer_account": self.key(FLEET_ACCOUNT).public}
        jwt = J.encode(J.claims("user", user.public, token(instance), nats, expires=expires, issued=now),
                       self.key(FLEET_ACCOUNT, scope))
        rec = Issued(instance, user.public, now, expires, scope, signer=self.key(FLEET_ACCOUNT, scope).public)
        self.issued.append(rec)
        if save:
            self.save()
        url = urls if urls is not None else self.keys.get("urls") or ""
        until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires)) if expires else "never"
        lines = [
            f"# aep-bridge shim settings for instance {instance} (`aep-bridge fleet issue`, "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(now))}); expires {until}.",
            "# AEP_BRIDGE_NATS_JWT is a bearer credential: whoever holds this file can publish as this",
            "# instance until it expires or `aep-bridge fleet revoke` names it. Keep it mode 0600.",
        ]
        if url:
            lines.append(f"AEP_BRIDGE_NATS_URL={url}")
        lines += [f"AEP_BRIDGE_INSTANCE={instance}", f"AEP_BRIDGE_NATS_JWT={jwt}"]
        if control:
            lines.append("AEP_HERMES_CONTROL=1")
        return "\n".join(lines) + "\n", rec

    def revoke(self, instance: str, save: bool = True) -> list[Issued]:
        """Revoke every credential of ``instance`` not yet revoked (FLEET's revocations; ``push``
        tells the servers). Returns those revoked now."""
        now = int(time.time())
        acc = self.keys["accounts"][FLEET_ACCOUNT]
        done = []
        for rec in self.issued:
            if rec.instance == instance and not rec.revoked:
                rec.revoked = now
                acc.setdefault("revocations", {})[rec.user] = now
                done.append(rec)
        if not done:
            raise FleetError(f"no credential of instance {instance!r} to revoke (see `aep-bridge fleet list`)")
        self._bump()
        if save:
            self.save()
        return done

    def rotate(self) -> list[str]:
        """New scoped signing keys for the instances; the current ones keep signing nothing but
        stay valid (``retiring``) until ``retire``: re-issue the fleet meanwhile. Returns the new keys.
        ``push`` tells the servers."""
        acc = self.keys["accounts"][FLEET_ACCOUNT]
        retiring = acc.setdefault("retiring", [])
        new = []
        for scope, k in acc["scoped"].items():
            retiring.append({"scope": scope, **k})
            fresh = J.Key.new("account")
            acc["scoped"][scope] = {"public": fresh.public, "seed": fresh.seed}
            new.append(fresh.public)
        self._bump()
        self.save()
        return new

    def retire(self) -> list[Issued]:
        """Drop the signing keys ``rotate`` set aside: every credential they signed stops working
        (``push``: the servers close those connections). Returns the credentials retired."""
        acc = self.keys["accounts"][FLEET_ACCOUNT]
        old = {k["public"] for k in acc.pop("retiring", [])}
        if not old:
            raise FleetError("no signing key to retire (run `aep-bridge fleet rotate` first)")
        now = int(time.time())
        done = [r for r in self.issued if r.signer in old and not r.revoked]
        for r in done:
            r.revoked = now
        self._bump()
        self.save()
        return done

    def _bump(self) -> None:
        """A new ``iat`` for FLEET's JWT (a server keeps the newest of an account's JWTs)."""
        acc = self.keys["accounts"][FLEET_ACCOUNT]
        acc["updated"] = max(int(time.time()), acc.get("updated", 0) + 1)

    def listing(self, now: float | None = None) -> list[dict[str, Any]]:
        return [{"instance": r.instance, "state": r.state(now), "user": r.user, "scope": r.scope,
                 "issued": r.issued, "expires": r.expires, "revoked": r.revoked} for r in self.issued]


async def push(fleet: Fleet, urls: str, accounts: tuple[str, ...] = (FLEET_ACCOUNT,), expect: int | None = None,
               timeout: float = 5.0) -> dict[str, list[str]]:
    """Send ``accounts``' JWTs to every server behind ``urls`` (``$SYS.REQ.CLAIMS.UPDATE``, as the
    system user). Returns {account: [the names of the servers that took it]}; raises FleetError
    when fewer than ``expect`` servers (default: one per URL) answered or one refused."""
    import nats

    servers = [u.strip() for u in urls.split(",") if u.strip()]
    if not servers:
        raise FleetError("no server to push to: give --nats URL[,URL...] (or set it at `fleet init --nats`)")
    want = len(servers) if expect is None else expect

    async def quiet(exc: Exception) -> None:  # nats-py logs a traceback per failed server otherwise
        pass

    nc = await nats.connect(servers=servers, user_credentials=str(fleet.creds_path("sys")), name="aep-bridge-fleet",
                            connect_timeout=timeout, max_reconnect_attempts=1, allow_reconnect=False,
                            error_cb=quiet)
    out: dict[str, list[str]] = {}
    try:
        for name in accounts:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            await nc.publish("$SYS.REQ.CLAIMS.UPDATE", fleet.account_jwt(name).encode(), reply=inbox)
            took: list[str] = []
            errors: list[str] = []
            deadline = time.monotonic() + timeout
            while len(took) + len(errors) < want and time.monotonic() < deadline:
                try:
                    msg = await sub.next_msg(timeout=max(0.01, deadline - time.monotonic()))
                except Exception:  # nats-py's TimeoutError
                    break
                answer = json.loads(msg.data or b"{}")
                server = (answer.get("server") or {}).get("name", "?")
                data = answer.get("data") or {}
                if answer.get("error") or data.get("code", 200) >= 400:
                    errors.append(f"{server}: {answer.get('error') or data}")
                elif server not in took:
                    took.append(server)
            await sub.unsubscribe()
            if errors or len(took) < want:
                raise FleetError(f"account {name}: {len(took)} of {want} servers took the update"
                                 + (f"; refused: {'; '.join(errors)}" if errors else ""))
            out[name] = took
    finally:
        await nc.close()
    return out


AUTH_ERRORS = "$SYS.SERVER.*.CLIENT.AUTH.ERR"


def classify_refusal(fleet: Fleet, event: dict[str, Any]) -> tuple[str, str] | None:
    """(instance, reason) of a server's ``CLIENT.AUTH.ERR`` advisory when the refused client
    presented one of this fleet's instance JWTs: ``expired`` (its ``exp`` had passed), ``revoked``
    (in FLEET's revocations or signed by a retired key), else ``refused``. None for anything else."""
    client = event.get("client") or {}
    token = client.get("jwt")
    if not token:
        return None
    try:
        claims = J.decode(token, verify=False)
    except J.JwtError:
        return None
    if (claims.get("nats") or {}).get("issuer_account") != fleet.key(FLEET_ACCOUNT).public:
        return None
    by_user = {r.user: r for r in fleet.issued}
    rec = by_user.get(claims.get("sub", ""))
    instance = rec.instance if rec else str(claims.get("name", "?"))
    exp = claims.get("exp")
    if exp and exp <= time.time():
        return instance, "expired"
    if claims.get("sub") in fleet.keys["accounts"][FLEET_ACCOUNT].get("revocations", {}) or (rec and rec.revoked):
        return instance, "revoked"
    return instance, "refused"


async def watch_refusals(fleet: Fleet, urls: str, on_refusal: Any, stop: asyncio.Event,
                         ready: asyncio.Event | None = None) -> None:
    """Call ``on_refusal(instance, reason, server)`` for every connection of this fleet's instances
    that a server refuses (the system account's auth-error advisories: only the system user sees
    them; the bridge's services, in account AEP, cannot)."""
    import nats

    async def quiet(exc: Exception) -> None:
        pass

    nc = await nats.connect(servers=[u.strip() for u in urls.split(",") if u.strip()],
                            user_credentials=str(fleet.creds_path("sys")), name="aep-bridge-fleet-watch",
                            error_cb=quiet)

    async def handle(msg: Any) -> None:
        try:
            event = json.loads(msg.data)
        except ValueError:
            return
        got = classify_refusal(fleet, event)
        if got:
            on_refusal(got[0], got[1], (event.get("server") or {}).get("name", "?"))

    try:
        await nc.subscribe(AUTH_ERRORS, cb=handle)
        await nc.flush()
        if ready is not None:
            ready.set()
        await stop.wait()
    finally:
        await nc.close()
