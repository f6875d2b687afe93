"""Subcommand groups of the aep-bridge CLI (thin: parse, then call into the package).

Their imports of the rest of the bridge are inside each command's function, so that
``aep-bridge --help`` does not load every service (the figure is in ``bridge/cli.py``).
"""

from typing import Any, Callable, Coroutine


def run_client(command: str, main: Callable[[], Coroutine[Any, Any, Any]], hint: str = "", interrupted: int = 0) -> Any:
    """Run a client command's coroutine the one way (issue 38): its result; a NATS that cannot
    be reached (`NatsConnectError`: what, where and what to do) or any other failure is one line
    on stderr and exit code 1 (``hint`` added to an unexpected failure); Ctrl-C ``interrupted``;
    a closed stdout (`| head`) left to bridge/cli.py, which exits quietly."""
    import asyncio
    import sys

    from bridge.nats.connection import NatsConnectError

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        return interrupted
    except BrokenPipeError:
        raise
    except NatsConnectError as exc:
        print(f"aep-bridge {command}: {exc}", file=sys.stderr)
    except Exception as exc:
        text = " ".join(str(exc).split()) or "no answer in time"
        print(f"aep-bridge {command}: {type(exc).__name__}: {text}{hint}", file=sys.stderr)
    return 1
