"""Probing NATS permissions as each role (issue 44): a test-only admin user added to a
configuration (`with_admin`), and `Prober`, which tries every JetStream operation on a
consumer as one role and says which the server took. Used by
tests/deploy/test_nats_permissions_matrix.py and the tests of single cases."""

from __future__ import annotations

import asyncio
import json
import re
import time

import nats

from tests.support.nats_roles import INBOX, USERS

ADMIN = ("aep-test-admin", "admin-pw")
FILTERS = {"HERMES_RAW": "hermes.raw.>", "AEP_EVENTS": "aep.hermes.>", "BRIDGE_MAPPED": "bridge.mapped.3.>",
           "AEP_EXPORT": "export.>"}


def with_admin(text: str, kind: str) -> str:
    """The configuration with one more user of the account, without permissions (setup only)."""
    if kind == "sample":
        new, n = re.subn(r"(\n\s*users: \[\n)", r'\1      { user: %s, password: %s }\n' % ADMIN, text, count=1)
    else:
        new, n = re.subn(r'("users": \[)', r'\1 {"user": "%s", "password": "%s"},' % ADMIN, text, count=1)
    assert n == 1
    return new


class Prober:
    """One role's connection: an operation's outcome is ``True`` when the server took it
    (answered, or, for an ack, did not refuse it) and ``False`` when it reported a permissions
    violation for it."""

    def __init__(self, nc, errors: list[str], role: str) -> None:  # type: ignore[no-untyped-def]
        self.nc, self.errors, self.role = nc, errors, role

    @classmethod
    async def connect(cls, url: str, role: str) -> "Prober":
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc).lower())

        user, password = USERS[role]
        nc = await nats.connect(url, user=user, password=password, inbox_prefix=INBOX[role], error_cb=on_error,
                                allow_reconnect=False)
        return cls(nc, errors, role)

    def _refused(self, subject: str, since: int) -> bool:
        return any("permissions violation" in e and f'"{subject.lower()}"' in e for e in self.errors[since:])

    async def publish(self, subject: str) -> bool:
        since = len(self.errors)
        await self.nc.publish(subject, b"+ACK")
        await self.nc.flush()
        await asyncio.sleep(0.02)  # the -ERR is read before the PONG; its callback runs after
        return not self._refused(subject, since)

    async def request(self, subject: str, body: dict) -> bool:
        since = len(self.errors)
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, max_msgs=1)
        try:
            await self.nc.publish(subject, json.dumps(body).encode(), reply=inbox)
            await self.nc.flush()
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                if self._refused(subject, since):
                    return False
                try:
                    await sub.next_msg(timeout=0.05)
                    return True
                except nats.errors.TimeoutError:
                    continue
            raise AssertionError(f"{self.role}: {subject} neither answered nor refused")
        finally:
            await sub.unsubscribe()

    async def try_ops(self, stream: str, name: str) -> set[str]:
        create = {"stream_name": stream, "action": "", "config": {
            "name": name, "durable_name": name, "ack_policy": "explicit", "ack_wait": 30_000_000_000,
            "filter_subject": FILTERS[stream], "description": "taken over"}}
        nameless = {"stream_name": stream, "config": {**create["config"], "durable_name": None}}
        done = set()
        if await self.request(f"$JS.API.CONSUMER.INFO.{stream}.{name}", {}):
            done.add("info")
        if await self.request(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}", {"batch": 1, "no_wait": True}):
            done.add("pull")
        if await self.publish(f"$JS.ACK.{stream}.{name}.1.1.1.{time.time_ns()}.0"):
            done.add("ack")
        # create over it: by name, with a filter token, the legacy durable form, the nameless form
        for subject, body in ((f"$JS.API.CONSUMER.CREATE.{stream}.{name}", create),
                              (f"$JS.API.CONSUMER.CREATE.{stream}.{name}.{FILTERS[stream]}", create),
                              (f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{name}", create),
                              (f"$JS.API.CONSUMER.CREATE.{stream}", nameless)):
            if await self.request(subject, body):
                done.add("create")
        if await self.request(f"$JS.API.CONSUMER.DELETE.{stream}.{name}", {}):
            done.add("delete")
        return done

    async def can_read(self, stream: str) -> bool:
        """A consumer of its own: an ordered-style push consumer to its inbox, created by name."""
        name = f"probe-{self.role}"
        body = {"stream_name": stream, "config": {"name": name, "deliver_subject": self.nc.new_inbox(),
                                                  "ack_policy": "none", "inactive_threshold": 1_000_000_000}}
        return await self.request(f"$JS.API.CONSUMER.CREATE.{stream}.{name}", body)

    async def close(self) -> None:
        await self.nc.close()
