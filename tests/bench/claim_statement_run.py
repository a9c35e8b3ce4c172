"""One run of the claim-statement bench (tests/bench/test_claim_statement_bench.py), with the
pgbroker of the working directory's tree: ``python claim_statement_run.py URL N BATCH`` migrates
the (fresh) database at URL, queues N unkeyed jobs and claims them all through ``Store.claim`` in
claims of BATCH, each carrying the acks of the previous one (as the worker's event loop does);
prints the claimed jobs per second."""

from __future__ import annotations

import sys
import time
import uuid

from pgbroker._pg.store import Store
from pgbroker.migrate import migrate
from pgbroker.settings import Settings


def main() -> None:
    url, n, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    migrate(url)
    store = Store(url, Settings())
    store.conn.execute(f"""
        INSERT INTO pgbroker.jobs (id, queue, body, state)
        SELECT gen_random_uuid(), 'q', '\\x00', 'pending' FROM generate_series(1, {n})""")
    store.conn.execute("ANALYZE pgbroker.jobs")
    consumer = uuid.uuid4()
    acks: list[tuple[uuid.UUID, int]] = []
    claimed = 0
    start = time.perf_counter()
    while True:
        rows = store.claim("q", batch, consumer, acks)
        if not rows:
            break
        claimed += len(rows)
        acks = [(r.id, r.attempt) for r in rows]
    store.ack(acks)
    seconds = time.perf_counter() - start
    assert claimed == n, claimed
    print(n / seconds)


if __name__ == "__main__":
    main()
