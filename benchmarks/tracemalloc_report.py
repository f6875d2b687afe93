#!/usr/bin/env python3
"""What grew, by allocation site, in the snapshots a service wrote with `AEP_BRIDGE_TRACEMALLOC`.

    .venv/bin/python benchmarks/tracemalloc_report.py DIR [--since UNIX_T] [--until UNIX_T] [--top 25]

For each service process (``<service>-<pid>.jsonl`` rows, ``<service>-<pid>-<t>.snap`` files):
a timeline of traced bytes against RSS and glibc's malloc figures (does it stop growing;
does RSS grow where the traced bytes do not: fragmentation), the census of large
containers (by owner attribute) and of gc objects by type at the end of the warm-up and
at the end of the traffic, then, when there are snapshots, the top growth sites between
the first snapshot at or after ``--since`` (the end of the warm-up) and the last one at or
before ``--until`` (the end of the traffic), by line and by traceback.
`benchmarks/soak.py --tracemalloc` runs it at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tracemalloc
from pathlib import Path

MIB = 1024 * 1024
_SNAP = re.compile(r"^(?P<service>.+)-(?P<pid>\d+)-(?P<t>\d+(?:\.\d+)?)\.snap$")
_IGNORE = (
    tracemalloc.Filter(False, tracemalloc.__file__),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>"),
    tracemalloc.Filter(False, "<unknown>"),
)


def _short(filename: str) -> str:
    for marker in ("/site-packages/", "/work/main/", "/lib/python3."):
        i = filename.find(marker)
        if i >= 0:
            return filename[i + len(marker):] if marker != "/lib/python3." else "stdlib" + filename[i + len(marker) + 2:]
    return filename


def processes(directory: Path) -> dict[tuple[str, str], list[tuple[float, Path]]]:
    out: dict[tuple[str, str], list[tuple[float, Path]]] = {}
    for path in directory.glob("*.jsonl"):
        service, _, pid = path.stem.rpartition("-")
        if service and pid.isdigit():
            out.setdefault((service, pid), [])
    for path in directory.glob("*.snap"):
        m = _SNAP.match(path.name)
        if m:
            out.setdefault((m["service"], m["pid"]), []).append((float(m["t"]), path))
    for snaps in out.values():
        snaps.sort()
    return out


def rows_of(directory: Path, service: str, pid: str) -> list[dict]:
    path = directory / f"{service}-{pid}.jsonl"
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def timeline(rows: list[dict], since: float | None, until: float | None) -> list[str]:
    lines = [f"    {'t(s)':>6} {'traced':>8} {'RSS':>8} {'RSS-traced':>10} {'malloc in use':>13} {'malloc free':>11} "
             f"{'mmapped':>8} {'pymalloc':>8} {'pym used':>8} {'tm overhead':>11}  state (MiB unless counted)"]
    t0 = rows[0]["t"] if rows else 0
    warm_marked = over_marked = False
    for r in rows:
        m = r.get("malloc") or {}
        mark = ""
        if since is not None and r["t"] >= since and not warm_marked:
            mark, warm_marked = " <- warm-up over", True
        if until is not None and r["t"] > until and not over_marked:
            mark, over_marked = mark + " <- traffic over", True
        info = r.get("info", {}).get("state")
        traced = r.get("traced", 0)
        lines.append(
            f"    {r['t'] - t0:>6.0f} {traced / MIB:>8.1f} {r['rss_kb'] / 1024:>8.1f} {r['rss_kb'] / 1024 - traced / MIB:>10.1f} "
            f"{m.get('in_use', 0) / MIB:>13.1f} {m.get('free', 0) / MIB:>11.1f} {m.get('mmapped', 0) / MIB:>8.1f} "
            f"{(r.get('pymalloc') or {}).get('arenas', 0) / MIB:>8.1f} {(r.get('pymalloc') or {}).get('used', 0) / MIB:>8.1f} "
            f"{r.get('tracemalloc_overhead', 0) / MIB:>11.1f}  {json.dumps(info) if info else ''}{mark}")
    return lines


def census_diff(rows: list[dict], since: float | None, until: float | None, top: int = 15) -> list[str]:
    """The census at the end of the warm-up, at the end of the traffic and at the very end."""
    rows = [r for r in rows if isinstance(r.get("census"), dict) and "named" in r["census"]]
    if not rows:
        return []
    base = next((r for r in rows if since is None or r["t"] >= since), rows[-1])
    inside = [r for r in rows if r["t"] >= base["t"] and (until is None or r["t"] <= until)]
    end = inside[-1] if inside else rows[-1]
    final = rows[-1]
    t0 = rows[0]["t"]
    lines = [f"    census (containers >= 1000 items; est = shallow + sampled keys/values, MiB) at "
             f"t={base['t'] - t0:.0f} s (warm-up over) / t={end['t'] - t0:.0f} s (traffic over) / t={final['t'] - t0:.0f} s (stopped):"]
    b, e, f = base["census"], end["census"], final["census"]
    for group in ("named", "anonymous"):
        names = list(dict.fromkeys([*e[group], *b[group], *f[group]]))
        for name in names[:top]:
            x, y, z = (c[group].get(name, {"len": 0, "est": 0, "n": 0}) for c in (b, e, f))
            many = f"  ({y['n']} instances)" if y.get("n", 1) > 1 else ""
            lines.append(f"      {name:<44} len {x['len']:>8} -> {y['len']:>8} -> {z['len']:>8}   "
                         f"est {x['est'] / MIB:6.1f} -> {y['est'] / MIB:6.1f} -> {z['est'] / MIB:6.1f} MiB{many}")
    for name in f.get("lru", {}):
        x, y, z = (c.get("lru", {}).get(name, [0, 0]) for c in (b, e, f))
        lines.append(f"      lru_cache {name:<34} len {x[0]:>8} -> {y[0]:>8} -> {z[0]:>8}   (maxsize {z[1]})")
    growth = sorted(((e["types"].get(k, 0) - b["types"].get(k, 0), k) for k in set(e["types"]) | set(b["types"])),
                    reverse=True)[:8]
    lines.append(f"      gc objects {b['objects']} -> {e['objects']} -> {f['objects']}; most grown types: "
                 + ", ".join(f"{k} {d:+d}" for d, k in growth if d))
    return lines


def pick(snaps: list[tuple[float, Path]], since: float | None, until: float | None) -> tuple[Path, Path] | None:
    after = [p for t, p in snaps if since is None or t >= since]
    before = [p for t, p in snaps if (since is None or t >= since) and (until is None or t <= until)]
    if not after:
        return None
    first = after[0]
    last = before[-1] if before else after[-1]
    return (first, last) if first != last else None


def compare(first: Path, last: Path, top: int, tracebacks: int) -> list[str]:
    a = tracemalloc.Snapshot.load(str(first)).filter_traces(_IGNORE)
    b = tracemalloc.Snapshot.load(str(last)).filter_traces(_IGNORE)
    ta = sum(s.size for s in a.statistics("filename"))
    tb = sum(s.size for s in b.statistics("filename"))
    lines = [f"    traced (filtered) {ta / MIB:.1f} -> {tb / MIB:.1f} MiB ({(tb - ta) / MIB:+.1f} MiB)",
             f"    top {top} growth sites by line (size diff, size at the end, blocks diff):"]
    for st in b.compare_to(a, "lineno")[:top]:
        frame = st.traceback[0]
        lines.append(f"      {st.size_diff / MIB:+8.2f} MiB {st.size / MIB:8.2f} MiB {st.count_diff:+9d}  "
                     f"{_short(frame.filename)}:{frame.lineno}")
    if tracebacks:
        lines.append(f"    top {tracebacks} growth sites by traceback (innermost frame last):")
        for st in b.compare_to(a, "traceback")[:tracebacks]:
            lines.append(f"      {st.size_diff / MIB:+8.2f} MiB {st.count_diff:+9d} blocks")
            for frame in st.traceback:
                lines.append(f"          {_short(frame.filename)}:{frame.lineno}")
    return lines


def report(directory: str | Path, since: float | None = None, until: float | None = None, top: int = 25,
           tracebacks: int = 10, out=sys.stdout) -> None:  # type: ignore[no-untyped-def]
    directory = Path(directory)
    for (service, pid), snaps in sorted(processes(directory).items()):
        rows = rows_of(directory, service, pid)
        print(f"tracemalloc: {service} (pid {pid}), {len(rows)} rows, {len(snaps)} snapshots in {directory}", file=out)
        for line in timeline(rows, since, until):
            print(line, file=out)
        for line in census_diff(rows, since, until):
            print(line, file=out)
        chosen = pick(snaps, since, until)
        if chosen is None:
            print("    (no two tracemalloc snapshots in the window: no allocation sites)", file=out)
            continue
        first, last = chosen
        print(f"    compare {first.name} -> {last.name}", file=out)
        for line in compare(first, last, top, tracebacks):
            print(line, file=out)
        out.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--since", type=float, default=None, help="unix time: the first snapshot at or after it is the base")
    ap.add_argument("--until", type=float, default=None, help="unix time: the last snapshot at or before it is compared")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--tracebacks", type=int, default=10)
    args = ap.parse_args()
    report(args.dir, args.since, args.until, args.top, args.tracebacks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
