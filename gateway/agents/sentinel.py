"""The tool sentinel: kills a daemon's tool process groups once the daemon is gone.

Started by `GroupLedger` as `python -m gateway.agents.sentinel DIR`, in a session of its own, with
stdin the read end of a pipe whose only writer is the daemon. End of file on it means the daemon
has exited — cleanly (it closes the pipe at its stop, after draining its tools) or not (`kill -9`,
a crash, the OOM killer) — and the groups still recorded in DIR are killed (see
`gateway.agents.processes.kill_recorded_group`). Signals that would stop it early (a terminal's
SIGINT, a SIGTERM sent to everything) are ignored: it exits when its work is done.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    if len(argv) != 2:
        print("usage: python -m gateway.agents.sentinel DIR", file=sys.stderr)
        return 2
    from gateway.agents.processes import sweep_records  # after the signals: the import takes a while

    directory = Path(argv[1])
    while True:
        try:
            if not os.read(0, 4096):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    killed = sweep_records(directory)
    if killed:
        print(json.dumps({"ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "level": "warning",
                          "logger": "gateway.agents.sentinel",
                          "msg": f"the daemon is gone; killed its tool process group(s) {killed}"}),
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
