"""``python -m tests.bench``: run the side-by-side benchmark and print one table.

Examples::

    python -m tests.bench           # compare, pgbench, transport, scale, bulk
    python -m tests.bench --n 1000 --rounds 1 --sections compare
    python -m tests.bench --sections memory                # the slow RSS bench (100k tasks)
    python -m tests.bench --sections profile               # py-spy on a pgbroker worker's drain
    python -m tests.bench --sections ceiling --rounds 6    # against a bare jobs table
    python -m tests.bench --sections durable,capacity --rounds 6   # issue 20: confirms, cost
    python -m tests.bench --plot docs/drain_vs_table_size.png

RabbitMQ (127.0.0.1:5672) and Redis (127.0.0.1:6379) are measured when they answer; PostgreSQL
is PGBROKER_BENCH_DATABASE_URL or postgresql://postgres@127.0.0.1:5432/postgres (a database is
created and dropped for each part). Needs ``pip install -e '.[dev,bench]'`` and pgbench.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from tests.bench import capacity, harness
from tests.bench.harness import CONFIGS, LABELS

# -- the table -----------------------------------------------------------------------------------

def best_median(values: Sequence[float | None], higher_is_better: bool = True
                ) -> tuple[float, float] | None:
    found = [v for v in values if v is not None]
    if not found:
        return None
    return (max(found) if higher_is_better else min(found)), statistics.median(found)


def _num(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}"


def _cell(pair: tuple[float, float] | None) -> str:
    return "—" if pair is None else f"{_num(pair[0])} / {_num(pair[1])}"


Pair = tuple[float, float]  # (best, median)


def _ratio(a: Pair | None, b: Pair | None) -> tuple[str, float | None]:
    if a is None or b is None or not b[0] or not b[1]:
        return "—", None
    return f"{a[0] / b[0]:.2f} / {a[1] / b[1]:.2f}", a[1] / b[1]


def _verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("yes" if ok else "NO")


COMPARE_METRICS = (  # key, label, higher is better
    ("publish", "publish, tasks/s", True),
    ("drain", "drain, tasks/s", True),
    ("p50_ms", "latency p50, ms", False),
    ("p99_ms", "latency p99, ms", False),
)


def table(results: dict[str, Any]) -> str:
    """One markdown table: each cell is "best / median" over the rounds; ratios likewise; a goal
    is judged on the medians."""
    keys = list(LABELS)
    labels = LABELS
    compare = results.get("compare") or {}
    header = ["metric"] + [labels[k] for k in keys] + [
        "pg/RabbitMQ", "pg/Redis", "other ratio", "goal", "met"]
    rows: list[list[str]] = []

    def add(metric: str, cells: dict[str, tuple[float, float] | None], rmq: str = "—",
            redis: str = "—", other: str = "—", goal: str = "", ok: bool | None = None) -> None:
        rows.append([metric] + [_cell(cells.get(k)) if k in cells else "n/a" for k in keys]
                    + [rmq, redis, other, goal, _verdict(ok)])

    runs = compare.get("runs") or {}
    for config in CONFIGS if runs else ():
        for key, label, higher in COMPARE_METRICS:
            cells = {b: best_median([r.get(key) for r in runs[b][config.key]], higher)
                     for b in runs}
            rmq, rmq_value = _ratio(cells.get("pgbroker"), cells.get("rabbitmq"))
            red, red_value = _ratio(cells.get("pgbroker"), cells.get("redis"))
            pg = cells.get("pgbroker")
            goal, ok = "", None
            if key == "drain":
                goal, ok = "≥ 1.0× RabbitMQ", None if rmq_value is None else rmq_value >= 1.0
            elif key == "publish":
                goal, ok = "≥ 1.0× Redis", None if red_value is None else red_value >= 1.0
            elif key == "p50_ms":
                goal, ok = "≤ 2 ms", None if pg is None else pg[1] <= 2.0
            elif key == "p99_ms":
                goal, ok = "≤ 10 ms", None if pg is None else pg[1] <= 10.0
            add(f"{label} [{config.label}]", cells, rmq, red, goal=goal, ok=ok)

    ceiling: dict[str, tuple[float, float] | None] = {}
    bench = results.get("pgbench") or {}
    for key, label in (("insert_c1", "pgbench job_insert, 1 client, rows/s"),
                       ("insert_c4", "pgbench job_insert, 4 clients, rows/s"),
                       ("claim_c1", "pgbench job_claim+ack x10, 1 client, msg/s"),
                       ("claim_c4", "pgbench job_claim+ack x10, 4 clients, msg/s"),
                       ("claim100_c1", "pgbench job_claim+ack x100, 1 client, msg/s")):
        if key in bench:
            ceiling[key] = best_median(bench[key])
            add(label, {"pgbroker": ceiling[key]}, goal="the ceiling")

    transport = results.get("transport") or {}
    for key, label, base in (
            ("publish", "kombu publish (no Celery), msg/s", "insert_c1"),
            ("consume_sync_10", "kombu consume, drain_events, prefetch 10, msg/s", "claim_c1"),
            ("consume_sync_100", "kombu consume, drain_events, prefetch 100, msg/s",
             "claim100_c1"),
            ("consume_hub_10", "kombu consume, event loop, prefetch 10, msg/s", "claim_c1"),
            ("consume_hub_100", "kombu consume, event loop, prefetch 100, msg/s",
             "claim100_c1")):
        if key in transport:
            value = best_median(transport[key])
            text, ratio = _ratio(value, ceiling.get(base))
            add(label, {"pgbroker": value}, other=f"{text} of {base}",
                goal="≥ 0.50× pgbench", ok=None if ratio is None else ratio >= 0.5)

    for point in (results.get("scale") or {}).get("points", []):
        filled, empty = best_median(point["filled"]), best_median(point["empty"])
        text, ratio = _ratio(filled, empty)
        big = point["completed"] >= 1_000_000
        add(f"drain with {point['completed']:,} completed + {point['scheduled']:,} scheduled "
            f"rows ({point['table_mb']:.0f} MB), tasks/s", {"pgbroker": filled},
            other=f"{text} of empty ({_cell(empty)})",
            goal="≥ 0.90× empty" if big else "", ok=(ratio >= 0.9) if big and ratio else None)

    if "bulk" in results:
        value = best_median(results["bulk"]["enqueue_many"])
        add(f"enqueue_many of {results['options']['bulk_jobs']:,} in a transaction, jobs/s",
            {"pgbroker": value}, goal="≥ 20,000/s",
            ok=None if value is None else value[1] >= 20_000)

    memory = results.get("memory")
    if memory and "after" in memory:
        warm, after = memory["warm"], memory["after"]
        growth = after[0] - warm[0]
        add(f"worker RSS, main process, MB (after 5,000 -> {memory['tasks']:,} tasks)",
            {"pgbroker": (after[0], after[0])}, other=f"{growth:+.1f} MB; children "
            f"{_mb(warm[1])} -> {_mb(after[1])} MB", goal="no growth", ok=growth < 5 and all(
                b - a < 5 for a, b in zip(warm[1], after[1])))

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    notes = [f"- {labels.get(k, k)}: not measured: {why}" for k, why in
             (compare.get("skipped") or {}).items()]
    errors = [f"- {labels.get(b, b)} [{c}]: {r['error']}" for b, per in runs.items()
              for c, rs in per.items() for r in rs if "error" in r]
    faults = [f"- {labels.get(b, b)} [{c}]: {r['lost_or_duplicated']:+d} executions vs sent"
              for b, per in runs.items() for c, rs in per.items() for r in rs
              if r.get("lost_or_duplicated")]
    faults += [f"- section {name} failed: {why}" for name, why in
               (results.get("failed") or {}).items()]
    faults += [f"- pgbench {key.removesuffix('_deadlocks')}: {sum(counts)} claim(s) deadlocked "
               "against a concurrent claim and were retried" for key, counts in bench.items()
               if key.endswith("_deadlocks") and sum(counts)]
    if "skipped" in bench:
        faults.append(f"- pgbench not run: {bench['skipped']}")
    load = (f"Load average (1/5/15 min) {_load(results.get('load_before'))} at the start, "
            f"{_load(results.get('load_after'))} at the end; "
            f"{results.get('options', {}).get('rounds')} interleaved rounds, "
            f"N = {results.get('options', {}).get('n'):,}; cells are best / median.")
    if results.get("server"):
        version, autovacuum, synchronous_commit, fsync = results["server"]
        load += (f"\n{version.split(' on ')[0]}: autovacuum={autovacuum}, "
                 f"synchronous_commit={synchronous_commit}, fsync={fsync}.")
    return "\n".join([load, ""] + lines + ([""] + notes + errors + faults
                                           if notes or errors or faults else []))


def _mb(values: Sequence[float]) -> str:
    return "/".join(f"{v:.1f}" for v in values)


def _load(values: Any) -> str:
    return "/".join(f"{v:.2f}" for v in values) if values else "?"


def profile_report(profile: dict[str, Any], top: int = 15) -> str:
    if "skipped" in profile:
        return f"profile skipped: {profile['skipped']}"
    cpu = profile["cpu"]
    lines = [f"drain {cpu['drain_rate']:,.0f} tasks/s; CPU seconds over {cpu['wall']:.1f} s of "
             f"wall time: worker main {cpu['worker_main']:.1f}, pool children "
             f"{cpu['pool_children']:.1f}, its PostgreSQL sessions "
             f"{cpu['postgres_sessions']:.1f}; {cpu['commits_per_task']:.2f} commits per task",
             "", "statement costs, ms per call (median of 3): " + "; ".join(
                 f"{name} {ms:.3f}" for name, ms in profile["statements"].items()), "",
             f"py-spy --idle, the worker's event-loop thread, {profile['samples']} samples (wall "
             "clock); innermost frame by package: "
             + ", ".join(f"{name} {share}%" for name, share in profile["by_package"][:8]),
             "", "innermost frame (self):"]
    lines += [f"  {share:5.1f}%  {name}" for name, share in profile["self"][:top]]
    lines += ["", "inclusive (pgbroker, kombu, psycopg frames):"]
    lines += [f"  {share:5.1f}%  {name}" for name, share in profile["inclusive"]
              if any(p in name for p in ("pgbroker/", "kombu/", "psycopg/"))][:top]
    return "\n".join(lines)


def ceiling_report(ceiling: dict[str, Any]) -> str:
    """The ceiling section: best / median of each broker, and the median over the rounds of
    each round's own ratio (pgbroker and bare against RabbitMQ for the drain and the latency,
    against Redis for the publish, as the goals are set)."""
    runs = ceiling["runs"]
    labels = {**LABELS, "pgbroker_bare": harness.BARE_LABEL}
    columns = [(k, labels[k]) for k in ("pgbroker", "pgbroker_bare", "rabbitmq", "redis")
               if k in runs]
    peers = {"publish": "redis", "drain": "rabbitmq", "p50_ms": "rabbitmq", "p99_ms": "rabbitmq"}
    lines = ["| metric [acks_late, prefetch x1] | " + " | ".join(label for _, label in columns)
             + " | pgbroker / peer | bare / peer |", "|" + "---|" * (len(columns) + 3)]
    for key, label, higher in COMPARE_METRICS:
        cells = [_cell(best_median([r[key] for r in runs[k]], higher)) for k, _ in columns]
        peer = peers[key]
        ratios = [_round_ratio(runs, k, peer, key) for k in ("pgbroker", "pgbroker_bare")]
        lines.append(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(
            f"{r:.2f} ({LABELS[peer]})" if r is not None else "—" for r in ratios) + " |")
    rounds = len(runs["pgbroker"])
    return (f"Ceiling ({rounds} round(s); bare = UNLOGGED jobs, no CHECK constraints, only the "
            "indexes a consumer reads; the ratio columns are medians of each round's own "
            "ratio):\n\n" + "\n".join(lines))


def _round_ratio(runs: dict[str, list[dict[str, Any]]], key: str, peer: str,
                 metric: str) -> float | None:
    pairs = [(a[metric], b[metric]) for a, b in zip(runs.get(key, []), runs.get(peer, []))
             if a.get(metric) and b.get(metric)]
    return statistics.median(a / b for a, b in pairs) if pairs else None


def plot_scale(results: dict[str, Any], path: str) -> None:
    """Drain rate against table size (medians, with the best and worst round as the bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = results["scale"]["points"]
    x = [p["completed"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label, style in (("filled", "pgbroker, table filled", "o-"),
                              ("empty", "pgbroker, empty table (same moments)", "s--")):
        med = [statistics.median(p[key]) for p in points]
        err = [[m - min(p[key]) for m, p in zip(med, points)],
               [max(p[key]) - m for m, p in zip(med, points)]]
        ax.errorbar(x, med, yerr=err, fmt=style, capsize=3, label=label)
    runs = (results.get("compare") or {}).get("runs") or {}
    for key, label, color in (("rabbitmq", "Celery+RabbitMQ (empty)", "tab:green"),
                              ("redis", "Celery+Redis (empty)", "tab:red")):
        drains = [r["drain"] for r in runs.get(key, {}).get(CONFIGS[0].key, []) if "drain" in r]
        if drains:
            ax.axhline(statistics.median(drains), color=color, linestyle=":", label=label)
    ax.set_xlabel("completed rows in the retention window (+10% scheduled, future run_at)")
    ax.set_ylabel("drain rate, tasks/s (celery worker -c 2)")
    ax.set_title("Drain rate against table size (acks_late, prefetch x1)")
    ax.set_ylim(bottom=0)
    ax.ticklabel_format(axis="x", style="plain")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the command ---------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    defaults = harness.Options()
    parser = argparse.ArgumentParser(prog="python -m tests.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=defaults.n, help="tasks per measurement")
    parser.add_argument("--rounds", type=int, default=defaults.rounds,
                        help="interleaved repetitions (best and median are reported)")
    parser.add_argument("--latency-samples", type=int, default=defaults.latency_samples)
    parser.add_argument("--brokers", default=",".join(defaults.brokers),
                        help="comma-separated, from: " + ", ".join(defaults.brokers))
    parser.add_argument("--sections", default=",".join(defaults.sections),
                        help="comma-separated, from: compare, pgbench, transport, scale, bulk, "
                             "memory, profile, ceiling, durable, capacity")
    parser.add_argument("--scale-sizes", default=",".join(map(str, defaults.scale_sizes)),
                        help="completed rows at each point of the scale section")
    parser.add_argument("--memory-tasks", type=int, default=defaults.memory_tasks)
    parser.add_argument("--profile-tasks", type=int, default=defaults.profile_tasks)
    parser.add_argument("--out", help="directory for results.json, worker logs and profiles")
    parser.add_argument("--plot", help="write the drain-rate-against-table-size PNG here")
    args = parser.parse_args(argv)
    opts = harness.Options(
        n=args.n, rounds=args.rounds, latency_samples=args.latency_samples,
        brokers=_names(args.brokers, defaults.brokers),
        sections=_names(args.sections, ("compare", "pgbench", "transport", "scale", "bulk",
                                        "memory", "profile", "ceiling", *capacity.SECTIONS)),
        scale_sizes=tuple(int(s) for s in args.scale_sizes.split(",")),
        memory_tasks=args.memory_tasks, profile_tasks=args.profile_tasks)
    own = tuple(s for s in opts.sections if s in capacity.SECTIONS)
    results = harness.run(dataclasses.replace(
        opts, sections=tuple(s for s in opts.sections if s not in own)), args.out)
    if own:
        results.update(capacity.run(dataclasses.replace(opts, sections=own),
                                    results["out_dir"]))
    print(table(results))
    if "profile" in results:
        print()
        print(profile_report(results["profile"]))
    if "ceiling" in results:
        print()
        print(ceiling_report(results["ceiling"]))
    if "durable" in results:
        print()
        print(capacity.durable_report(results["durable"]))
    if "capacity" in results:
        print()
        print(capacity.capacity_report(results["capacity"]))
    if args.plot and "scale" in results:
        plot_scale(results, args.plot)
        print(f"\nplot: {args.plot}")
    print(f"\nresults: {results['out_dir']}/results.json ({results['elapsed']:.0f} s)")
    return 0


def _names(text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise SystemExit(f"unknown name(s) {unknown}; choose from {', '.join(allowed)}")
    return names


if __name__ == "__main__":
    sys.exit(main())
