"""Chaos soak: the chaos scenario again and again (seed, seed + 1, ...) for N minutes, each run on
a fresh cluster (3 real workers, a real redis-server); prints every run's report and the counts
summed over all runs.

    python -m tests.bench.chaos --minutes 10 [--seed 1] [--workers 3] [--run-s 60] [--ttl 3]
    python -m tests.bench.chaos --runs 20 --seed 5 [--store postgres]   # a fixed number of runs
    python -m tests.bench.chaos --runs 5 --store postgres --wipe   # Redis also comes back empty
    python -m tests.bench.chaos --runs 2 --api-sessions 200   # 200 HTTP API sessions at once
    python -m tests.bench.chaos --recheck chaos-1.json   # the checker again, on a run's saved records

Exit status 1 if any run found a violation. Each run's records and report are kept under
--out (default: a temporary directory, printed at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from tests.chaos import faults
from tests.chaos.checker import check
from tests.chaos.scenario import Settings, load, run_scenario, save


async def soak(minutes: float, seed: int, workers: int, run_s: float, ttl_s: float, out: Path,
               runs_wanted: int | None = None, store: str = "redis", wipe: bool = False, api_sessions: int = 4,
               api_balance: str = "random") -> int:
    deadline = time.monotonic() + minutes * 60
    totals: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    failing: list[int] = []
    runs = 0
    kinds_allowed = faults.WIPE_KINDS if wipe else faults.PG_KINDS if store == "postgres" else faults.KINDS
    while (runs < runs_wanted if runs_wanted is not None
           else runs == 0 or time.monotonic() + run_s + 30 < deadline):
        run_seed = seed + runs
        runs += 1
        started = time.monotonic()
        settings = Settings(seed=run_seed, workers=workers, ttl_s=ttl_s, chaos_s=run_s,
                            settle_max_s=2 * ttl_s + 10, store=store,
                            kinds=kinds_allowed, api_sessions=api_sessions, api_balance=api_balance)
        records, report = await run_scenario(settings, out / f"run-{run_seed}")
        save(records, report, out, store)
        totals.update(report.counts)
        kinds.update(report.by_kind())
        if not report.ok:
            failing.append(run_seed)
        print(f"\n=== run {runs}, seed {run_seed}, {time.monotonic() - started:.0f} s ===", flush=True)
        print(report.text(limit=40), flush=True)
    print(f"\n=== soak: {runs} run(s), seeds {seed}..{seed + runs - 1}, workers {workers}, TTL {ttl_s:g} s,"
          f" history in {store}, {api_sessions} API session(s) ({api_balance}) ===")
    print("counts: " + ", ".join(f"{k} {v}" for k, v in totals.items()))
    print("violations: " + (", ".join(f"{k} {n}" for k, n in kinds.most_common()) or "none"))
    print(f"runs with violations: {failing or 'none'}")
    print(f"records and reports: {out}")
    return 1 if failing else 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # asyncio.run then unwinds the run: its servers and workers are ended


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)  # a soak stopped with kill ends what it started, as with Ctrl-C
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--run-s", type=float, default=60.0, help="traffic and faults per run (seconds)")
    parser.add_argument("--ttl", type=float, default=3.0, help="lease TTL (seconds, at least 3)")
    parser.add_argument("--runs", type=int, default=None, help="run exactly this many seeds (overrides --minutes)")
    parser.add_argument("--store", choices=("redis", "postgres"), default="redis", help="where the history lives")
    parser.add_argument("--wipe", action="store_true",
                        help="Redis may also come back empty (a restart without persistence; needs --store postgres)")
    parser.add_argument("--api-sessions", type=int, default=4,
                        help="HTTP API sessions (hundreds are fine: their users think longer in proportion)")
    parser.add_argument("--api-balance", choices=("random", "pinned"), default="random",
                        help="each API request to a random live worker, or each session to one worker")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--recheck", type=Path, default=None, help="check a run's saved records (chaos-<seed>.json)")
    args = parser.parse_args()
    if args.recheck:
        report = check(load(args.recheck))
        print(report.text(limit=10_000))
        sys.exit(0 if report.ok else 1)
    if args.wipe and args.store != "postgres":
        parser.error("--wipe needs --store postgres (with the history in Redis an empty Redis loses it by design)")
    out = args.out or Path(tempfile.mkdtemp(prefix="switchboard-chaos-"))
    sys.exit(asyncio.run(soak(args.minutes, args.seed, args.workers, args.run_s, args.ttl, out,
                              runs_wanted=args.runs, store=args.store, wipe=args.wipe,
                              api_sessions=args.api_sessions, api_balance=args.api_balance)))


if __name__ == "__main__":
    main()
