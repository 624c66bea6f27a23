"""What the shell tool's sandbox costs per start: `true` run through the reaper (its own process
group, PDEATHSIG by setpriv), bare and under bubblewrap, without and with the network namespace.

    python -m tests.bench.sandbox_start [--runs 50]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from gateway.agents.processes import ProcessReaper, run_in_process_group
from gateway.agents.sandbox import Sandbox, bwrap_problem


async def _one(reaper: ProcessReaper, sandbox: Sandbox | None) -> float:
    argv, env = (["/bin/sh", "-c", "true"], None) if sandbox is None else sandbox.wrap(["/bin/sh", "-c", "true"], "s")
    started = time.perf_counter()
    result = await run_in_process_group(argv, reaper=reaper, timeout_s=30, max_output=1024, env=env)
    assert result.returncode == 0, result.output
    return time.perf_counter() - started


async def main(runs: int) -> None:
    problem = bwrap_problem()
    if problem is not None:
        raise SystemExit(problem)
    reaper = ProcessReaper(0.5)
    with tempfile.TemporaryDirectory() as root:
        cases = {"bare": None, "sandbox, no network": Sandbox(Path(root)),
                 "sandbox, host network": Sandbox(Path(root), network=True)}
        for name, sandbox in cases.items():
            await _one(reaper, sandbox)  # warm
            times = sorted([await _one(reaper, sandbox) for _ in range(runs)])
            print(f"{name:24} median {statistics.median(times) * 1000:6.1f} ms   "
                  f"p90 {times[int(len(times) * 0.9)] * 1000:6.1f} ms")
    await reaper.drain()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=50)
    asyncio.run(main(parser.parse_args().runs))
