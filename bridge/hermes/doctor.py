"""``aep-bridge hermes doctor``: is what ``install`` wrote still what Hermes will run?

It checks the recorded install against Hermes's own reading of ``config.yaml`` and the
allowlist (hermes-agent's parser when importable), the interpreter and the compiled shim,
the gate's ``pre_tool_call`` timeout, then connects to NATS as the shim would (HERMES_RAW
must exist) and looks at the shim's spool.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats.js.errors

from bridge.config import Settings, read_env_file
from bridge.hermes.install import (ENV_FILENAME, SHIM_SETTINGS, InstallError, Manifest, check_gate_timeout, hold_ms_of,
                                   is_approved, load_config_yaml, pyc_is_current, read_allowlist,
                                   shim_number)
from bridge.nats import streams as S
from bridge.nats.connection import NatsConnectError, quick_connect
from bridge.shim.hook import Config, spool_for


@dataclass
class Check:
    ok: bool
    what: str
    warning: bool = False  # reported, not fatal


def doctor(home: Path, nats_timeout: float = 2.0) -> list[Check]:
    """Is the shim registered for Hermes (checked with Hermes's own code when importable),
    is its compiled copy current, does NATS answer and does HERMES_RAW exist?"""
    checks: list[Check] = []
    manifest = Manifest.load(home)
    if manifest is None:
        checks.append(Check(False, f"no aep-bridge install recorded in {home} (run `aep-bridge hermes install`)"))
        return checks
    command = manifest.command
    checks.append(Check(True, f"command: {command}"))
    if os.environ.get("HERMES_SAFE_MODE", "").strip().lower() in {"1", "true", "yes", "on"}:
        checks.append(Check(False, "HERMES_SAFE_MODE is set in this environment: Hermes registers no hooks"))

    doc, _ = load_config_yaml(home / "config.yaml") if (home / "config.yaml").exists() else ({}, None)
    plain = json.loads(json.dumps(doc, default=str))  # ruamel types -> plain dicts for Hermes's parser
    registered = _registered_events(home, plain, command)
    missing = [e for e in manifest.events if e not in registered]
    if missing:
        checks.append(Check(False, f"not registered for: {', '.join(missing)}"))
    else:
        checks.append(Check(True, f"registered for {len(registered)} event(s) ({_hermes_note()})"))

    script = Path(manifest.script)
    if not os.access(manifest.python, os.X_OK):
        checks.append(Check(False, f"interpreter missing or not executable: {manifest.python}"))
    if not script.exists():
        checks.append(Check(False, f"shim missing: {script} (run `aep-bridge hermes install` again)"))
    elif manifest.mode == "compiled":
        ok, why = pyc_is_current(script)
        checks.append(Check(ok, f"compiled shim {script}: {why}" + ("" if ok else " (run `aep-bridge hermes install`)")))

    checks.extend(_gate_checks(home, plain, command))
    checks.extend(_nats_checks(home, nats_timeout))
    return checks


def _gate_checks(home: Path, cfg: dict[str, Any], command: str) -> list[Check]:
    """With the gate on (in the shim's env file, overlaid by this environment, as the shim reads
    them): is every pre_tool_call timeout of ours above the hold window plus the deadline?"""
    values = read_env_file(home / ENV_FILENAME)
    values.update({k: v for k, v in os.environ.items() if k in SHIM_SETTINGS})
    try:
        hold = hold_ms_of(values)
        if hold is None:
            return []
        deadline = shim_number(values, "AEP_BRIDGE_DEADLINE_MS")
    except InstallError as exc:
        return [Check(False, f"{exc} (the shim uses its default meanwhile)")]
    entries = ((cfg.get("hooks") or {}).get("pre_tool_call") or [])
    ours = [e for e in entries if isinstance(e, dict) and e.get("command") == command]
    if not ours:
        return [Check(False, "AEP_HERMES_CONTROL is on but the shim is not hooked to pre_tool_call", warning=True)]
    out = []
    for e in ours:
        t = e.get("timeout", 60)
        try:
            check_gate_timeout(int(t), hold, deadline)
            out.append(Check(True, f"gate: pre_tool_call timeout {t} s > hold {hold} ms + deadline {deadline} ms"))
        except (InstallError, TypeError, ValueError) as exc:
            out.append(Check(False, f"gate: {exc} (run `aep-bridge hermes install` again)"))
    return out


def _hermes_note() -> str:
    try:
        import agent.shell_hooks  # noqa: F401

        return "checked with hermes-agent's own parser and allowlist"
    except ImportError:
        return "hermes-agent not importable here; checked with aep-bridge's reading of its format"


def _registered_events(home: Path, cfg: dict[str, Any], command: str) -> list[str]:
    """Events for which Hermes would register ``command``: configured AND consented."""
    try:
        from agent import shell_hooks
        from hermes_constants import reset_hermes_home_override, set_hermes_home_override
    except ImportError:
        hooks = cfg.get("hooks") or {}
        data = read_allowlist(home)
        accept = cfg.get("hooks_auto_accept") is True or os.environ.get("HERMES_ACCEPT_HOOKS", "").lower() in {
            "1", "true", "yes", "on"}
        return [
            ev for ev, entries in hooks.items() if isinstance(entries, list)
            and any(isinstance(e, dict) and e.get("command") == command for e in entries)
            and (accept or is_approved(data, ev, command))
        ]
    token = set_hermes_home_override(home)
    try:
        accept = shell_hooks._resolve_effective_accept(cfg, False)
        return [
            spec.event for spec in shell_hooks.iter_configured_hooks(cfg)
            if spec.command == command and (accept or shell_hooks.allowlist_entry_for(spec.event, command))
        ]
    finally:
        reset_hermes_home_override(token)


def credential_checks(cfg: Config, timeout: float = 2.0, now: float | None = None) -> list[Check]:
    """A fleet instance's JWT (`aep-bridge fleet issue`): expired (read from the JWT itself), or
    refused by the servers (revoked, or an account they do not know), probed the way the shim
    connects (CONNECT + PING); and the refusals the shim recorded (``<token>.refused``)."""
    import time

    from bridge.nats.jwt import JwtError, decode
    from bridge.shim.hook import NatsConnection, NatsError

    checks: list[Check] = []
    now = time.time() if now is None else now
    try:
        claims = decode(cfg.jwt or "", verify=False)
    except JwtError as exc:
        return [Check(False, f"AEP_BRIDGE_NATS_JWT is not a NATS JWT ({exc})")]
    who = f"instance credential {claims.get('name', '?')!r} (user {str(claims.get('sub', '?'))[:12]}…)"
    again = f"`aep-bridge fleet issue --instance {cfg.instance}` again"
    exp = claims.get("exp")
    if exp and exp <= now:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(exp))
        checks.append(Check(False, f"NATS {who} EXPIRED at {when}: the shim is refused and spools; {again}"))
    else:
        left = f"expires in {(exp - now) / 86400:.1f} days" if exp else "never expires"
        refusals = []
        for server in cfg.servers:
            deadline = time.monotonic() + timeout
            try:
                conn = NatsConnection.connect(server, cfg, deadline)
                try:
                    conn.send(conn.pending + b"PING\r\n", deadline)
                    while conn._read_msg(deadline) is not None:
                        pass
                finally:
                    conn.close()
            except NatsError as exc:
                if "Violation" in str(exc) or "Authentication" in str(exc):
                    refusals.append(str(exc))
            except OSError:
                pass  # unreachable: the NATS check below says so
        if refusals:
            checks.append(Check(False, f"NATS {who} REFUSED ({'; '.join(refusals)}): revoked (`aep-bridge fleet "
                                       f"list`) or not of this server's operator; {again}"))
        else:
            checks.append(Check(True, f"NATS {who}: accepted, {left}"))
    count, last = spool_for(cfg).refused()
    if count:
        checks.append(Check(False, f"the shim was refused {count} time(s); last: {last}", warning=True))
    return checks


def _nats_checks(home: Path, timeout: float) -> list[Check]:
    cfg = Config(os.environ, config_path=str(home / ENV_FILENAME))
    if cfg.jwt:  # a fleet instance credential: nats-py's shim role does not carry it
        return credential_checks(cfg, timeout) + _spool_checks(cfg)
    environ = dict(os.environ)
    environ["AEP_BRIDGE_CONFIG"] = str(home / ENV_FILENAME)
    settings = Settings.from_env(environ)
    checks: list[Check] = []

    async def probe() -> None:
        nc = await quick_connect(settings, name="aep-bridge-doctor", timeout=timeout, role="shim")
        try:
            checks.append(Check(True, f"NATS answers at {nc.connected_url.netloc if nc.connected_url else '?'}"))
            try:
                info = await nc.jetstream(timeout=max(timeout, 1.0)).stream_info(S.HERMES_RAW)
                checks.append(Check(True, f"{S.HERMES_RAW} exists ({info.state.messages} messages)"))
            except nats.js.errors.NotFoundError as exc:
                checks.append(Check(False, f"{S.HERMES_RAW} missing ({exc}): run `aep-bridge bootstrap`"))
            except Exception as exc:  # no answer: a shim's user may only publish (deploy/nats/nats.conf, `up`'s aep-shim)
                checks.append(Check(False, f"{S.HERMES_RAW} not visible to this user ({exc}): a shim's own user may only "
                                    "publish, which the shim does; events it could not publish wait in the spool (below)",
                                    warning=True))
        finally:
            await nc.close()

    try:
        asyncio.run(probe())
    except NatsConnectError as exc:
        checks.append(Check(False, str(exc) + " (events are spooled meanwhile)"))
    return checks + _spool_checks(cfg)


def _spool_checks(cfg: Config) -> list[Check]:
    checks: list[Check] = []
    st = spool_for(cfg).status()  # the shim's own view
    pending = st["pending_records"] + st.get("fallback", {}).get("pending_records", 0)
    if pending or st["dropped_records"]:
        where = st["path"] + (f" (and {st['fallback']['path']})" if st.get("fallback", {}).get("pending_records") else "")
        checks.append(Check(
            False,
            f"spool {where}: {pending} pending, {st['dropped_records']} dropped "
            "(`aep-bridge spool drain` / `status`)",
            warning=not st["dropped_records"],
        ))
    else:
        checks.append(Check(True, f"spool {st['path']}: empty"))
    return checks
