"""What each server of the cluster fixture thinks, once a second, written as JSON lines (issue
42's partition runs: what blocks the pipeline while the services are on a healthy node).

Per node and tick (``ServerTrace``, a thread of its own, started and stopped by the test):

* ``jsz``: the node's own view from its monitoring port (``/jsz?streams=true&consumers=true``,
  HTTP: the partition does not touch it): the meta leader, and for each stream of ``STREAMS``
  the leader it knows, its last sequence, and the consumers' leaders, ack floors, pending
  and ack-pending counts;
* ``probe``: what a client pinned to that node sees, the mapper's own requests: a lane-fact
  create (``$KV.aep_lane_facts.zz.trace.<node>.<n>`` published with
  ``Nats-Expected-Last-Subject-Sequence: 0``, as `KvLanes.send_lane`), a direct get of it
  (``$JS.API.DIRECT.GET.KV_aep_lane_facts``, as nats-py's KV get) and a leader's message get
  (``STREAM.MSG.GET``), each with its outcome and milliseconds; and every answer to a
  ``STREAM.INFO`` of the bucket's stream gathered for 0.5 s (a stale leader answers too).

Opt-in (``AEP_PARTITION_TRACE=1``): the HTTP polls cost the servers some CPU.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

STREAMS = ("HERMES_RAW", "KV_aep_lane_facts", "KV_aep_lanes", "BRIDGE_MAPPED", "AEP_EVENTS", "KV_aep_leases")
FACTS = "KV_aep_lane_facts"


def jsz_view(node: Any) -> dict[str, Any]:
    url = f"http://{node.host}:{node.monitor_port}/jsz?streams=true&consumers=true"
    with urllib.request.urlopen(url, timeout=1.5) as r:
        body = json.loads(r.read())
    out: dict[str, Any] = {"meta": (body.get("meta_cluster") or {}).get("leader")}
    for account in body.get("account_details") or []:
        for s in account.get("stream_detail") or []:
            if s.get("name") not in STREAMS:
                continue
            cl = s.get("cluster") or {}
            view: dict[str, Any] = {"leader": cl.get("leader"), "group": cl.get("raft_group"), "last": (s.get("state") or {}).get("last_seq"),
                                    "peers": {p.get("name"): [p.get("current"), p.get("active")]
                                              for p in cl.get("replicas") or []}}
            cons = {}
            for c in s.get("consumer_detail") or []:
                if str(c.get("name", "")).startswith("_"):
                    continue
                cons[c.get("name")] = {"leader": (c.get("cluster") or {}).get("leader"),
                                       "floor": (c.get("ack_floor") or {}).get("stream_seq"),
                                       "pend": c.get("num_pending"), "ackp": c.get("num_ack_pending"),
                                       "redel": c.get("num_redelivered"), "wait": c.get("num_waiting")}
            if cons and s.get("name") in ("HERMES_RAW",):
                view["consumers"] = cons
            out[s["name"]] = view
    return out


class ServerTrace:
    def __init__(self, cluster: Any, path: Path, period: float = 1.0) -> None:
        self.cluster = cluster
        self.path = path
        self.period = period
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="server-trace", daemon=True)

    def start(self) -> "ServerTrace":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=15)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as exc:  # a trace never fails the run
            with open(self.path, "a") as f:
                f.write(json.dumps({"t": time.time(), "trace_failed": repr(exc)}) + "\n")

    async def _main(self) -> None:
        import nats

        conns: dict[str, Any] = {}
        n = 0
        with open(self.path, "a") as out:
            while not self.stopping.is_set():
                started = time.time()
                n += 1
                for node in self.cluster.nodes:
                    if node.name not in conns or conns[node.name].is_closed:
                        try:
                            conns[node.name] = await nats.connect(servers=[node.url], allow_reconnect=False,
                                                                  connect_timeout=1.0, name=f"trace-{node.name}")
                        except Exception:
                            conns.pop(node.name, None)
                results = await asyncio.gather(*(self._tick(node, conns.get(node.name), n) for node in self.cluster.nodes),
                                               return_exceptions=True)
                for node, res in zip(self.cluster.nodes, results):
                    rec = res if isinstance(res, dict) else {"error": repr(res)}
                    out.write(json.dumps({"t": round(started, 3), "node": node.name, **rec}) + "\n")
                out.flush()
                await asyncio.sleep(max(0.0, self.period - (time.time() - started)))
        for nc in conns.values():
            try:
                await nc.close()
            except Exception:
                pass

    async def _tick(self, node: Any, nc: Any, n: int) -> dict[str, Any]:
        rec: dict[str, Any] = {}
        loop = asyncio.get_running_loop()
        try:
            rec["jsz"] = await loop.run_in_executor(None, jsz_view, node)
        except Exception as exc:
            rec["jsz"] = {"error": repr(exc)[:200]}
        if nc is None:
            rec["probe"] = "no connection"
            return rec
        key = f"zz.trace.{node.name}.{n}"
        rec["probe"] = {
            "create": await self._ask(nc, f"$KV.aep_lane_facts.{key}", b"1",
                                      headers={"Nats-Expected-Last-Subject-Sequence": "0"}),
            "direct": await self._ask(nc, f"$JS.API.DIRECT.GET.{FACTS}",
                                      json.dumps({"last_by_subj": f"$KV.aep_lane_facts.{key}"}).encode()),
            "msgget": await self._ask(nc, f"$JS.API.STREAM.MSG.GET.{FACTS}",
                                      json.dumps({"last_by_subj": f"$KV.aep_lane_facts.{key}"}).encode()),
            "info": await self._gather(nc, f"$JS.API.STREAM.INFO.{FACTS}"),
        }
        return rec

    @staticmethod
    async def _ask(nc: Any, subject: str, payload: bytes, headers: dict[str, str] | None = None,
                   timeout: float = 2.0) -> str:
        t = time.monotonic()
        try:
            reply = await nc.request(subject, payload, timeout=timeout, headers=headers)
        except Exception as exc:
            return f"{type(exc).__name__} {1000 * (time.monotonic() - t):.0f}ms"
        ms = f"{1000 * (time.monotonic() - t):.0f}ms"
        status = (reply.headers or {}).get("Status")
        if status:
            return f"status {status} {(reply.headers or {}).get('Description', '')} {ms}"
        data = reply.data or b""
        if data[:1] == b"{":
            try:
                body = json.loads(data)
            except ValueError:
                return f"unreadable {ms}"
            if "error" in body:
                return f"error {body['error'].get('err_code')} {body['error'].get('description', '')[:60]} {ms}"
            if "seq" in body:
                return f"ok seq {body['seq']} {ms}"
            if "message" in body:
                return f"ok msg {body['message'].get('seq')} {ms}"
        return f"ok {ms}"

    @staticmethod
    async def _gather(nc: Any, subject: str, wait: float = 0.5) -> list[str]:
        inbox = nc.new_inbox()
        answers: list[str] = []
        sub = await nc.subscribe(inbox)
        try:
            await nc.publish(subject, b"", reply=inbox)
            end = time.monotonic() + wait
            while True:
                left = end - time.monotonic()
                if left <= 0:
                    break
                try:
                    m = await sub.next_msg(timeout=left)
                except Exception:
                    break
                try:
                    body = json.loads(m.data or b"{}")
                except ValueError:
                    answers.append("unreadable")
                    continue
                if "error" in body:
                    answers.append(f"error {body['error'].get('err_code')}")
                else:
                    cl = body.get("cluster") or {}
                    answers.append(f"leader {cl.get('leader')} last {(body.get('state') or {}).get('last_seq')}")
        finally:
            await sub.unsubscribe()
        return answers
