"""Network partitions between the nodes of the cluster fixture (tests/clusterfixture.py), on one
machine, as root, without Docker (issue 42).

Each nats-server is moved into a cgroup v2 of its own (``aep-part-<id>-<node>`` under the
cgroup2 mount: ``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified`` on a hybrid host), and one
nftables table of ours (``inet aep_part_<id>``) does the rest:

* ``output``: a packet sent by a socket of node X's cgroup (``socket cgroupv2``) gets X's mark
  (``meta mark``; on loopback the mark stays with the packet into ``input``);
* ``input``: a packet marked X whose receiving socket is in node Y's cgroup is dropped when
  the link X-Y is cut, or dropped at random (``numgen random mod 100 < P``) when it is lossy.

Only packets from one node's process to another's match: the routes between the servers.
Clients (the services, the test itself, a shim) are in no node's cgroup and reach every
node all along: what a partition between the nodes of a real cluster looks like to a client
whose own network is fine. ``tc`` qdiscs (netem) are not needed (nor in every kernel).

A socket belongs to the cgroup its process was in when it was made: a server must be in its
cgroup before it opens its routes. So ``Partitioner(cluster)`` takes a cluster not started
yet and starts each node through a wrapper that enters the node's cgroup, then execs
nats-server (a restart, ``node.start()``, goes through it again). Then ``cut(a, b)``,
``lossy(a, b, percent)``, ``isolate(a)`` (cut from every other node), ``heal(a=None, b=None)``
(one link, or all), ``close()`` (the table deleted, the cgroups removed once the nodes are
gone). `unavailable()` says why it cannot run here (not root, no ``nft``, no cgroup2);
`.ci/run` installs ``nftables``. `partitioned_cluster()`: a started cluster and its
partitioner, closed together.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

MARK_BASE = 0x4A420000  # the marks of our nodes: MARK_BASE + index
#: the servers' scheduling priority (nice) on the shared test machine: each stands for a machine of
#: its own. At the default one, with the bridge and other test runs on the same 2 cores (load
#: average 15-22), raft followers fell behind their leaders, and a follower catching up does not
#: stand for election (nats-server raft.go `runAsFollower`: `isCatchingUp`, given up only after 2 s
#: without progress, then another election timeout): in a 20 s cut the majority elected no leader
#: for most of the cut node's streams (issue 42, docs/BENCHMARKS.md "Network partitions").
#: AEP_PARTITION_SERVER_NICE=0 runs them as before.
SERVER_NICE = int(os.environ.get("AEP_PARTITION_SERVER_NICE", "-10"))


def cgroup2_mount() -> Path | None:
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "cgroup2":
                return Path(parts[1])
    except OSError:
        return None
    return None


def unavailable() -> str | None:
    """Why partitions cannot be made here, or None."""
    if os.geteuid() != 0:
        return "not root (cgroups and nftables need it)"
    if shutil.which("nft") is None:
        return "no nft (apt-get install -y nftables; .ci/run does)"
    if cgroup2_mount() is None:
        return "no cgroup2 mount"
    return None


class Partitioner:
    def __init__(self, cluster: Any) -> None:
        why = unavailable()
        if why:
            raise RuntimeError(f"cannot partition the cluster: {why}")
        self.cluster = cluster
        self.tag = f"{os.getpid()}-{id(self) % 10000}"
        self.table = f"aep_part_{self.tag.replace('-', '_')}"
        self.mount = cgroup2_mount()
        assert self.mount is not None
        # nft resolves a cgroupv2 path below /sys/fs/cgroup; level: the depth in the cgroup2 tree
        self.rel = os.path.relpath(self.mount, "/sys/fs/cgroup")
        self.names = [n.name for n in cluster.nodes]
        self.links: dict[frozenset[str], int] = {}  # cut: 100; lossy: its percent
        self._nft(f"add table inet {self.table}\n"
                  f"add chain inet {self.table} output {{ type filter hook output priority -150; }}\n"
                  f"add chain inet {self.table} input {{ type filter hook input priority -150; }}\n")
        for i, node in enumerate(cluster.nodes):
            if node.running:
                raise RuntimeError("Partitioner takes a cluster not started yet (its routes would be outside the cgroups)")
            self.cgroup(node.name).mkdir(exist_ok=True)
            self._nft(f"add rule inet {self.table} output socket cgroupv2 level 1 \"{self.nft_path(node.name)}\" "
                      f"meta mark set {MARK_BASE + i:#x}\n")
            wrapper = node.dir / "nats-server-in-cgroup"
            nice = f"nice -n {SERVER_NICE} " if SERVER_NICE and shutil.which("nice") else ""
            wrapper.write_text(f"#!/bin/sh\necho $$ > {self.cgroup(node.name) / 'cgroup.procs'}\nexec {nice}{node.binary} \"$@\"\n")
            wrapper.chmod(0o755)
            node.binary = str(wrapper)

    # ------------------------------------------------------------ plumbing

    def __enter__(self) -> "Partitioner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def cgroup(self, name: str) -> Path:
        return self.mount / f"aep-part-{self.tag}-{name}"

    def nft_path(self, name: str) -> str:
        base = f"aep-part-{self.tag}-{name}"
        return base if self.rel == "." else f"{self.rel}/{base}"

    def _nft(self, script: str) -> None:
        r = subprocess.run(["nft", "-f", "-"], input=script, text=True, capture_output=True)
        if r.returncode != 0:
            raise RuntimeError(f"nft failed: {r.stderr.strip()}\n{script}")

    def _apply(self) -> None:
        lines = [f"flush chain inet {self.table} input"]
        for link, percent in sorted(self.links.items(), key=lambda kv: sorted(kv[0])):
            a, b = sorted(link)
            for x, y in ((a, b), (b, a)):
                mark = MARK_BASE + self.names.index(x)
                rule = f"add rule inet {self.table} input meta mark {mark:#x} socket cgroupv2 level 1 \"{self.nft_path(y)}\""
                lines.append(rule + (" drop" if percent >= 100 else f" numgen random mod 100 < {percent} drop"))
        self._nft("\n".join(lines) + "\n")

    # ------------------------------------------------------------ what a test does

    def cut(self, a: str, b: str) -> None:
        self.links[frozenset((a, b))] = 100
        self._apply()

    def lossy(self, a: str, b: str, percent: int) -> None:
        self.links[frozenset((a, b))] = max(0, min(100, int(percent)))
        self._apply()

    def isolate(self, a: str) -> None:
        for b in self.names:
            if b != a:
                self.links[frozenset((a, b))] = 100
        self._apply()

    def heal(self, a: str | None = None, b: str | None = None) -> None:
        if a is None:
            self.links.clear()
        elif b is None:
            self.links = {k: v for k, v in self.links.items() if a not in k}
        else:
            self.links.pop(frozenset((a, b)), None)
        self._apply()

    def close(self) -> None:
        """The table deleted; each cgroup moved out of (what is left in it) and removed."""
        subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True)
        root = self.mount / "cgroup.procs"
        for name in self.names:
            cg = self.cgroup(name)
            try:
                for pid in (cg / "cgroup.procs").read_text().split():
                    try:
                        root.write_text(pid)
                    except OSError:
                        pass
                cg.rmdir()
            except OSError:
                pass


@contextlib.contextmanager
def partitioned_cluster(extra_config: str = "") -> Iterator[tuple[Any, Partitioner]]:
    """A three-node cluster started inside a `Partitioner`'s cgroups; both closed after."""
    from tests.clusterfixture import Cluster

    cluster = Cluster(extra_config=extra_config)
    part: Partitioner | None = None
    try:
        part = Partitioner(cluster)
        cluster.start()
        yield cluster, part
    finally:
        cluster.close()
        if part is not None:
            part.close()
