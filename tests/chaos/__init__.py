"""Chaos testing for cluster mode: real workers, real Redis, faults on a seeded schedule, and a
checker that judges the run only from what the fakes, the store and the traffic generator recorded.

    records.py   plain data: what happened (the checker's only input)
    cluster.py   redis-server + fake provider + fake Telegram + worker processes (incarnations)
    faults.py    the seeded fault schedule and its execution
    traffic.py   Telegram chats by webhook and HTTP API sessions, with client-side retries
    checker.py   the invariants, and the report
    scenario.py  one run end to end: start, traffic + faults, settle, collect, check
"""
