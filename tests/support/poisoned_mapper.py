"""``python -m tests.support.poisoned_mapper mapper --nats URL ...``: the mapper service with a
test hook injected, for the fault test of a poisoned message (tests/sim/test_faults.py).

It runs what ``aep-bridge mapper`` runs, with ``Mapper(before_map=...)`` failing every delivery
of a raw message that contains ``AEP_BRIDGE_TEST_POISON`` (set by the test), so the message must
end in the DLQ after max_deliver while the rest flows. The bridge itself reads no such variable.
"""

from __future__ import annotations

import os
import sys

from bridge.cli import build_parser
from bridge.commands.mapping import policy_from_args
from bridge.commands.services import settings_from_args
from bridge.runtime import run_service
from bridge.services.mapper import Mapper


def main(argv: list[str]) -> int:
    poison = os.environ["AEP_BRIDGE_TEST_POISON"].encode()

    def fail_on_poison(data: bytes) -> None:
        if poison in data:
            raise RuntimeError("AEP_BRIDGE_TEST_POISON matched this message (test hook)")

    args = build_parser().parse_args(argv)
    if args.command != "mapper":
        raise SystemExit("usage: python -m tests.support.poisoned_mapper mapper [mapper options]")
    settings = settings_from_args(args, "mapper")
    return run_service(Mapper(settings, policy_from_args(args, settings), batch=args.batch, before_map=fail_on_poison))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
