"""Network partitions between the nodes of the test cluster, on one machine (issues 39 and 42).

Each ``nats-server`` of a ``tests.clusterfixture.Cluster`` runs in a cgroup v2 of its own
(a wrapper script writes its pid into ``cgroup.procs`` and execs the server, so every socket
it opens belongs to that cgroup); nftables rules matching ``socket cgroupv2`` drop the route
(cluster port) traffic of a cut link, both ways. Clients still reach every node: a cut-off
node accepts connections, sends INFO and answers PINGs, but cannot reach its peers (what
Jepsen's partitions look like to a client). Needs root, a cgroup2 mount under
``/sys/fs/cgroup`` and the ``nft`` binary (Debian's ``nftables``; ``.ci/run`` installs it).

    with partitioned_cluster() as (cluster, cuts):
        cuts.isolate("n2")        # n2 cut from n1 and n3
        cuts.cut("n1", "n3")      # one link
        cuts.heal()               # every rule removed

A link (a, b) is four rules: a's packets to b's cluster port and b's to a's (output, by the
sending socket's cgroup: the connections each side dialed), and, on input, packets from b's
cluster port to a socket of a and from a's to a socket of b (the answers on the connections
the other side accepted). ``tc netem`` is not available in the CI kernel, so loss or delay is
not offered here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

from tests.clusterfixture import Cluster

NFT_ROOT = Path("/sys/fs/cgroup")  # nft resolves a cgroupv2 path relative to this


def cgroup2_mount() -> Path | None:
    """Where the cgroup2 hierarchy is mounted (``/sys/fs/cgroup`` or, hybrid, ``/sys/fs/cgroup/unified``)."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "cgroup2":
            return Path(parts[1])
    return None


def unavailable() -> str | None:
    """Why partitions cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (cgroups and nftables)"
    if shutil.which("nft") is None:
        return "no nft binary (apt-get install nftables)"
    mount = cgroup2_mount()
    if mount is None:
        return "no cgroup2 mount"
    if mount != NFT_ROOT and NFT_ROOT not in mount.parents:
        return f"cgroup2 is mounted at {mount}, not under {NFT_ROOT} where nft looks"
    return None


def nft(*args: str, stdin: str | None = None) -> str:
    out = subprocess.run(["nft", *args], input=stdin, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"nft {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


class Partitions:
    """The cgroups and the nftables table of one cluster (see the module docstring)."""

    def __init__(self, cluster: Cluster) -> None:
        why = unavailable()
        if why:
            raise RuntimeError(f"cannot partition the cluster: {why}")
        mount = cgroup2_mount()
        assert mount is not None
        self.cluster = cluster
        self.tag = f"aep-part-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.table = self.tag.replace("-", "_")
        self.cgroups: dict[str, Path] = {}
        self.nft_paths: dict[str, str] = {}
        self.links: set[frozenset[str]] = set()
        for node in cluster.nodes:
            cg = mount / f"{self.tag}-{node.name}"
            cg.mkdir()
            self.cgroups[node.name] = cg
            self.nft_paths[node.name] = str(cg.relative_to(NFT_ROOT))
            wrapper = node.dir / "in-cgroup.sh"
            wrapper.write_text(f"#!/bin/sh\necho $$ > {cg / 'cgroup.procs'} || exit 97\nexec {node.binary} \"$@\"\n")
            wrapper.chmod(0o755)
            node.binary = str(wrapper)
        nft("-f", "-", stdin=(
            f"table inet {self.table} {{\n"
            "  chain output { type filter hook output priority -10; policy accept; }\n"
            "  chain input { type filter hook input priority -10; policy accept; }\n"
            "}\n"))

    def _rules(self, a: str, b: str) -> list[tuple[str, str]]:
        na, nb = self.cluster.node(a), self.cluster.node(b)
        pa, pb = self.nft_paths[a], self.nft_paths[b]
        return [
            ("output", f'socket cgroupv2 level 1 "{pa}" tcp dport {nb.cluster_port} drop'),
            ("output", f'socket cgroupv2 level 1 "{pb}" tcp dport {na.cluster_port} drop'),
            ("input", f'socket cgroupv2 level 1 "{pb}" tcp sport {na.cluster_port} drop'),
            ("input", f'socket cgroupv2 level 1 "{pa}" tcp sport {nb.cluster_port} drop'),
        ]

    def cut(self, a: str, b: str) -> None:
        """Drop every route packet between nodes ``a`` and ``b`` (both ways)."""
        link = frozenset((a, b))
        if link in self.links or a == b:
            return
        script = "".join(f"add rule inet {self.table} {chain} {rule}\n" for chain, rule in self._rules(a, b))
        nft("-f", "-", stdin=script)
        self.links.add(link)

    def isolate(self, name: str) -> None:
        """Cut ``name`` from every other node; its clients still reach it."""
        for other in self.cluster.nodes:
            if other.name != name:
                self.cut(name, other.name)

    def heal(self) -> None:
        nft("flush", "table", "inet", self.table)
        self.links.clear()

    def close(self) -> None:
        """Remove the table and the cgroups (call after the cluster's processes exited)."""
        with contextlib.suppress(RuntimeError):
            nft("delete", "table", "inet", self.table)
        for cg in self.cgroups.values():
            with contextlib.suppress(OSError):
                cg.rmdir()


@contextlib.contextmanager
def partitioned_cluster(size: int = 3, extra_config: str = "") -> Iterator[tuple[Cluster, Partitions]]:
    """A started cluster whose nodes run in cgroups of their own, and its ``Partitions``."""
    cluster = Cluster(size, extra_config)
    cuts: Partitions | None = None
    try:
        cuts = Partitions(cluster)
        cluster.start()
        yield cluster, cuts
    finally:
        cluster.close()
        if cuts is not None:
            cuts.close()
