"""A broadcast subscriber that joins a run's publisher and then never reads again.

    python bench/stuck_subscriber.py ENDPOINT NAME RUN_ID

It joins ``ENDPOINT`` (a run's broadcast endpoint) for the version and stop topics under
``NAME``, prints ``joined`` once welcomed, and stops itself (``SIGSTOP``): neither it nor its
ZeroMQ I/O thread takes another message, as a hung process would. Whoever started it ends it
(``SIGKILL``), or its parent's death does. ``RUN_ID`` only marks the process as the run's, so
that a search for what a run left behind finds it.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowrl import messages as m
from transport.pubsub import Subscriber

JOIN_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1


def die_with_parent_stopped() -> None:
    """Ask Linux to SIGKILL this process when its parent dies: stopped, it would leave the
    SIGTERM that flowrl's child processes ask for pending forever."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


async def join_and_stop(endpoint: str, name: str) -> None:
    die_with_parent_stopped()
    sub = Subscriber(endpoint, [m.TOPIC_VERSION, m.TOPIC_STOP], name=name)
    await sub.join(JOIN_TIMEOUT_S)
    print("joined", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    # Only reached if someone resumes it: still never reads, until ended.
    await asyncio.Event().wait()


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    asyncio.run(join_and_stop(sys.argv[1], sys.argv[2]))


if __name__ == "__main__":
    main()
