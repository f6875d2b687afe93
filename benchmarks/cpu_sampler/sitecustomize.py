"""A CPU-time sampler for the services under `cost.py` (issue 24: docs/BENCHMARKS.md "Cost").

py-spy counts a thread as busy while it is runnable, waiting for a core too: on 2 loaded cores
it put pairing at 59 % of a core at 2,000 events/s when /proc said 21 %, and at 7 % at 250/s
against 4 %, so its per-event figures favoured the quiet rate. This samples by CPU time instead:
``ITIMER_PROF`` (the process's CPU time; the kernel checks it at each scheduler tick, so one
sample per ~4 ms of CPU at most, whatever the interval) and the Python stack of the main thread
when the signal is handled (C code is charged to the next Python frame that runs).

Use (every Python process of the run imports it; only those sent SIGUSR1 record)::

    AEP_CPUPROF=/tmp/prof PYTHONPATH=benchmarks/cpu_sampler python benchmarks/cost.py --rates 250 ...
    kill -USR1 <mapper pid> <pairing pid>   # start (counts cleared)
    kill -USR1 <mapper pid> <pairing pid>   # stop: /tmp/prof/<role>-<pid>.txt, collapsed stacks

``cost.py --cpu-profile DIR`` does this for the mapper and pairing over each rate's window and
prints the samples' buckets (`benchmarks/profile_buckets.py`).

A line is ``frame;frame;... count`` (flamegraph.pl reads it); a count is ~4 ms of CPU. A frame is
``qualname (the file's last three path components)``.
"""

import os

_OUT = os.environ.get("AEP_CPUPROF")

if _OUT:
    import atexit
    import collections
    import signal
    import sys

    _counts: collections.Counter = collections.Counter()
    _names: dict = {}
    _on = [False]

    def _name(code) -> str:  # type: ignore[no-untyped-def]
        name = _names.get(code)
        if name is None:
            # the file's last three path components (nats/aio/client.py, bridge/services/mapper.py):
            # what benchmarks/profile_buckets.py sorts by
            path = "/".join(code.co_filename.split(os.sep)[-3:])
            name = _names[code] = f"{getattr(code, 'co_qualname', code.co_name)} ({path})"
        return name

    def _sample(signum, frame) -> None:  # type: ignore[no-untyped-def]
        if not _on[0]:
            return
        stack = []
        while frame is not None:
            stack.append(frame.f_code)
            frame = frame.f_back
        _counts[tuple(stack)] += 1

    def _dump() -> None:
        role = sys.argv[1] if len(sys.argv) > 1 else "python"
        path = os.path.join(_OUT, f"{os.path.basename(role)}-{os.getpid()}.txt")
        try:  # raised here, an error would surface in whatever the service was running
            with open(path, "w") as out:
                for stack, n in _counts.items():
                    out.write(";".join(_name(c) for c in reversed(stack)) + f" {n}\n")
        except OSError as exc:
            print(f"cpu_sampler: cannot write {path}: {exc}", file=sys.stderr)

    def _toggle(signum, frame) -> None:  # type: ignore[no-untyped-def]
        if _on[0]:
            _on[0] = False
            _dump()
        else:
            _counts.clear()
            _on[0] = True

    def _off() -> None:  # the timer outlives the handlers at exit: SIGPROF would then kill the process
        signal.setitimer(signal.ITIMER_PROF, 0)

    signal.signal(signal.SIGPROF, _sample)
    signal.signal(signal.SIGUSR1, _toggle)
    signal.setitimer(signal.ITIMER_PROF, 0.001, 0.001)
    atexit.register(_off)
