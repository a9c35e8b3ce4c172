"""``python -m ticketflow demo``: ticketflow on pgbroker, live in the terminal.

What it does, in order:

1. finds PostgreSQL (``PGBROKER_DATABASE_URL``, else 127.0.0.1:5432, else an embedded server it
   starts and stops), creates a database of its own there (``--database``, default
   ``ticketflow_demo``) and migrates pgbroker's schema and ticketflow's into it;
2. starts ``celery -A ticketflow worker -Q default,email,system,heavy`` (every pool's queues)
   and ``celery -A ticketflow beat`` as
   child processes, handing them the database URL (their logs go to files);
3. creates an event and a few hundred reservations, in waves: most are confirmed (an e-mail job
   each), some of those paid (a charge job each; a few cards fail transiently and are retried
   with backoff, one is declined and ends in the dead letters), and the rest are left to expire
   (short holds; beat's ``expire_reservations`` ends them and frees their seats);
4. shows the counts live (jobs by state, e-mails sent, reservations expired, dead letters),
   refreshed every second, and prints where to look (``pgbroker stats``, the admin page and its
   ``/metrics``);
5. stops everything cleanly on Ctrl-C (or SIGTERM): SIGTERM to the worker and beat -- Celery's
   warm shutdown, where running tasks finish (SIGINT would do the same, but the worker then exits
   with status 1) --, a wait, then SIGKILL for whatever is left; then drops its database, unless
   ``--keep`` (the next run replaces a kept one).

``--short`` shortens holds, the expiry interval and the PDF renders, and exits by itself (status
0) once every reservation reached a final state, after printing the final counts; the tests run
it. Status 1: a child process died, or ``--short`` did not finish within ``--timeout``.

Limit: if the demo itself is killed with SIGKILL, its children get SIGTERM from the kernel
(Linux ``PR_SET_PDEATHSIG``; elsewhere they keep running), and an embedded server is left behind.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import importlib.util
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from sqlalchemy import text
from sqlalchemy.orm import Session

from pgbroker._pg.driver import mask_password
from pgbroker._pg.local_server import DEFAULT_LOCAL_URL, ENV_DATABASE_URL
from pgbroker.errors import ConfigurationError
from pgbroker.migrate import migrate as migrate_pgbroker
from pgbroker.settings import Settings

from . import app, db, services
from .schedule import ENV_EXPIRE_INTERVAL
from .tasks import ENV_CHARGE_BACKOFF, ENV_PDF_SECONDS

__all__ = ["Plan", "SHORT", "FULL", "main", "add_arguments"]

#: Seconds a child gets to finish its warm shutdown before it is killed. More than the 30 s a
#: pool process of Celery's prefork pool may wait at exit: a task handed to it in the instant
#: of the SIGTERM runs, but the pool has already dropped it from its cache ("redelivered by the
#: broker anyway", ``AsynPool.flush``), never reads its result, and the process waits for that
#: read (billiard's ``_ensure_messages_consumed``, 300 x 0.1 s) before it exits.
STOP_TIMEOUT = 45.0
#: The test card that always succeeds.
GOOD_CARD = "4242 4242 4242 4242"


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much the demo creates, and how fast things happen."""

    reservations: int
    hold_seconds: float        # the holds left to expire
    expire_interval: float     # beat's expire_reservations interval (TICKETFLOW_EXPIRE_INTERVAL)
    pdf_seconds: float         # one PDF render (TICKETFLOW_PDF_SECONDS)
    wave_size: int             # reservations created together ...
    wave_pause: float          # ... and the pause between two waves
    expire_share: float = 0.2  # of the reservations, left to expire
    pay_share: float = 0.4     # of the confirmed ones, paid
    transient_cards: int = 6   # paid with a card that fails once or twice, then succeeds
    declined_cards: int = 1    # paid with a card that is declined (a dead letter)


SHORT = Plan(reservations=200, hold_seconds=3, expire_interval=2, pdf_seconds=0.02,
             wave_size=50, wave_pause=0.2)
FULL = Plan(reservations=400, hold_seconds=20, expire_interval=10, pdf_seconds=0.3,
            wave_size=20, wave_pause=1.0)


@dataclasses.dataclass(frozen=True)
class Customer:
    """What one reservation of the demo will go through."""

    email: str
    seats: int
    confirm: bool
    card: str | None  # None: not paid


def customers(plan: Plan, seed: int = 7) -> list[Customer]:
    """The reservations of ``plan``, deterministic for a seed."""
    rng = random.Random(seed)
    n = plan.reservations
    expiring = set(rng.sample(range(n), round(n * plan.expire_share)))
    confirmed = [i for i in range(n) if i not in expiring]
    payers = rng.sample(confirmed, min(len(confirmed), round(len(confirmed) * plan.pay_share)))
    specials = payers[:plan.transient_cards + plan.declined_cards]
    cards = {i: GOOD_CARD for i in payers}
    for k, i in enumerate(specials[:plan.transient_cards]):
        cards[i] = f"transient-{1 + k % 2}"
    for i in specials[plan.transient_cards:]:
        cards[i] = "declined"
    return [Customer(email=f"fan{i:04d}@example.com", seats=rng.randint(1, 3),
                     confirm=i not in expiring, card=cards.get(i)) for i in range(n)]


# -- child processes -----------------------------------------------------------------------------

def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the demo dies, even by SIGKILL (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


class Child:
    """A ``celery`` child process in a session of its own (so the terminal's Ctrl-C reaches
    only the demo, which then stops its children in order), logging to a file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: Path,
                 log_path: Path):
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def interrupt(self) -> None:
        """SIGTERM: a warm shutdown for a worker (running tasks finish), an exit for beat."""
        if self.alive():
            os.kill(self.pid, signal.SIGTERM)

    def stop(self, deadline: float) -> int | None:
        """Wait until ``deadline`` (monotonic) for the exit, then SIGKILL the process group
        (the worker's pool children included); return the exit code."""
        try:
            self.popen.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.pid, signal.SIGKILL)  # leftovers: pool children, or a stuck parent
        except (ProcessLookupError, PermissionError):
            pass
        self.popen.wait()
        self._log.close()
        return self.popen.returncode

    def tail(self, lines: int = 30) -> str:
        text_ = self.log_path.read_text(errors="replace")
        return "\n".join(text_.splitlines()[-lines:])


def _config_dir() -> Path:
    """The directory of the Celery config module (``celeryconfig.py`` at the repository root),
    made importable here too; the children get it in PYTHONPATH."""
    name = os.environ.get("TICKETFLOW_CONFIG_MODULE", "celeryconfig")
    spec = importlib.util.find_spec(name.split(".")[0])
    if spec is None or spec.origin is None:
        repo = Path(__file__).resolve().parent.parent
        if (repo / (name.split(".")[0] + ".py")).exists():
            sys.path.insert(0, str(repo))
            return repo
        raise ConfigurationError(f"the Celery config module {name!r} cannot be imported: run "
                                 "the demo from the repository root (where celeryconfig.py is)")
    origin = Path(spec.origin).resolve()
    return origin.parent.parent if origin.name == "__init__.py" else origin.parent


def start_children(url: str, plan: Plan, log_dir: Path) -> list[Child]:
    """Start the worker and beat with ``url`` and the plan's intervals in their environment."""
    cwd = _config_dir()
    env = dict(os.environ)
    env.update({
        ENV_DATABASE_URL: url,
        ENV_EXPIRE_INTERVAL: str(plan.expire_interval),
        ENV_PDF_SECONDS: str(plan.pdf_seconds),
        # a demo's gateway timeouts are retried within seconds, not seed 000's minutes
        ENV_CHARGE_BACKOFF: env.get(ENV_CHARGE_BACKOFF) or "1,2,4,8",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(cwd), env.get("PYTHONPATH")) if p),
    })
    celery = [sys.executable, "-m", "celery", "-A", "ticketflow"]
    children = [Child("worker", celery + [
        "worker", "-Q", "default,email,system,heavy", "-c", "2", "-l", "INFO",
        "-n", f"ticketflow-demo-{os.getpid()}@%h"], env, cwd, log_dir / "worker.log")]
    try:
        children.append(Child("beat", celery + [
            "beat", "-l", "INFO", "-s", str(log_dir / "celerybeat-schedule")],
            env, cwd, log_dir / "beat.log"))
    except BaseException:
        stop_children(children, out=sys.stderr)
        raise
    return children


def stop_children(children: list[Child], out: TextIO, timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM to every child, wait up to ``timeout`` s in all, then SIGKILL what is left.
    A second Ctrl-C during the wait kills at once."""
    for child in children:
        child.interrupt()
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            code = child.stop(deadline)
        except KeyboardInterrupt:
            deadline = time.monotonic()  # the impatient second Ctrl-C: kill the rest now
            code = child.stop(deadline)
        print(f"  {child.name} (pid {child.pid}) exited with status {code}", file=out, flush=True)


# -- counting ------------------------------------------------------------------------------------

_COUNTS = """
SELECT
    -- jobs made since the demo started (a database may hold older ones), by state
    (SELECT coalesce(json_object_agg(state, n), '{{}}')
     FROM (SELECT state, count(*) AS n FROM {jobs} WHERE created_at >= :since
           GROUP BY state) AS j) AS jobs,
    (SELECT count(*) FROM {jobs}
     WHERE created_at >= :since AND state = 'dead') AS dead,
    (SELECT count(*) FROM {jobs}
     WHERE created_at >= :since AND retries > 0) AS retries,
    -- this event's reservations and payments, by state
    (SELECT coalesce(json_object_agg(state, n), '{{}}')
     FROM (SELECT state, count(*) AS n FROM ticketflow.reservations WHERE event_id = :event
           GROUP BY state) AS r) AS reservations,
    (SELECT coalesce(json_object_agg(state, n), '{{}}')
     FROM (SELECT p.state, count(*) AS n FROM ticketflow.payments AS p
           JOIN ticketflow.reservations AS r ON r.id = p.reservation_id
           WHERE r.event_id = :event GROUP BY p.state) AS p) AS payments,
    (SELECT coalesce(sum(p.gateway_calls), 0) FROM ticketflow.payments AS p
     JOIN ticketflow.reservations AS r ON r.id = p.reservation_id
     WHERE r.event_id = :event) AS gateway_calls,
    (SELECT count(*) FROM ticketflow.sent_emails AS e
     JOIN ticketflow.reservations AS r ON r.id = e.reservation_id
     WHERE r.event_id = :event) AS emails,
    (SELECT count(*) FROM ticketflow.tickets AS t
     JOIN ticketflow.reservations AS r ON r.id = t.reservation_id
     WHERE r.event_id = :event) AS tickets,
    -- the seats held or confirmed reservations take (expired ones gave theirs back)
    (SELECT seats_taken FROM ticketflow.events WHERE id = :event) AS seats_taken,
    (SELECT capacity FROM ticketflow.events WHERE id = :event) AS capacity
"""

_DEAD = """
SELECT task, last_error FROM {jobs}
WHERE created_at >= :since AND state = 'dead' ORDER BY updated_at LIMIT 10
"""

JOB_STATES = ("scheduled", "pending", "running", "completed", "dead", "expired", "cancelled")


@dataclasses.dataclass(frozen=True)
class Counts:
    created: int
    jobs: dict[str, int]
    dead: int
    retries: int
    reservations: dict[str, int]
    payments: dict[str, int]
    gateway_calls: int
    emails: int
    tickets: int
    seats_taken: int
    capacity: int

    def done(self, plan: Plan) -> bool:
        """Every reservation of the plan exists and is final, with all its side effects."""
        r, p = self.reservations, self.payments
        return (self.created == plan.reservations and not r.get("held")
                and not p.get("pending") and self.emails == r.get("confirmed", 0)
                and self.tickets == p.get("succeeded", 0))

    def lines(self) -> list[str]:
        r, p = self.reservations, self.payments
        jobs = "  ".join(f"{s} {self.jobs[s]}" for s in JOB_STATES if self.jobs.get(s))
        return [
            (f"  reservations  {sum(r.values()):>4}   held {r.get('held', 0)}  "
             f"confirmed {r.get('confirmed', 0)}  expired {r.get('expired', 0)}"),
            (f"  seats         {self.seats_taken:>4}   of {self.capacity} taken, 1 to 3 per "
             "held or confirmed reservation; expired holds gave theirs back"),
            f"  e-mails sent  {self.emails:>4}",
            (f"  payments      {sum(p.values()):>4}   pending {p.get('pending', 0)}  "
             f"succeeded {p.get('succeeded', 0)}  failed {p.get('failed', 0)}  "
             f"(gateway calls {self.gateway_calls})"),
            f"  tickets       {self.tickets:>4}",
            (f"  jobs          {sum(self.jobs.values()):>4}   {jobs or '-'}  "
             f"(retries {self.retries})"),
            f"  dead letters  {self.dead:>4}",
        ]


class Monitor:
    """Reads the counts of one demo run (its event, its jobs) in one statement."""

    def __init__(self, session: Session, event_id: int, since: Any, schema: str):
        jobs = f'"{schema}".jobs'
        self.session = session
        self.params = {"event": event_id, "since": since}
        self.counts_sql = text(_COUNTS.format(jobs=jobs))
        self.dead_sql = text(_DEAD.format(jobs=jobs))
        self.created = 0

    def counts(self) -> Counts:
        with self.session.begin():
            row = self.session.execute(self.counts_sql, self.params).one()
        return Counts(self.created, *row)

    def dead_letters(self) -> list[tuple[str, str]]:
        with self.session.begin():
            return [tuple(r) for r in self.session.execute(self.dead_sql, self.params)]


class Display:
    """Redraws the counts in place on a terminal; elsewhere prints them when they change."""

    def __init__(self, out: TextIO, started: float):
        self.out = out
        self.tty = out.isatty()
        self.started = started
        self._drawn = 0
        self._last: list[str] | None = None

    def show(self, counts: Counts, status: str) -> None:
        lines = counts.lines()
        if self.tty:
            head = f"[{time.monotonic() - self.started:5.0f} s] {status}"
            if self._drawn:
                self.out.write(f"\x1b[{self._drawn}F\x1b[J")
            self.out.write("\n".join([head, *lines]) + "\n")
            self._drawn = len(lines) + 1
        elif lines != self._last:
            self.out.write(f"[{time.monotonic() - self.started:5.1f} s] {status}\n"
                           + "\n".join(lines) + "\n")
        self._last = lines
        self.out.flush()

    def release(self, erase: bool = False) -> None:
        """Later output goes below the live block instead of over it (``erase``: in its place,
        on a terminal)."""
        if erase and self._drawn:
            self.out.write(f"\x1b[{self._drawn}F\x1b[J")
        self._drawn = 0


# -- the run -------------------------------------------------------------------------------------

def _look_here(url: str) -> list[str]:
    cmd = pgbroker_command()
    flag = f"--database-url {shlex.quote(url)}"
    lines = [
        "Where to look while it runs (in another terminal, in this directory):",
        f"  {cmd} stats {flag}   queues: pending, running, dead, oldest age",
        f"  {cmd} dead list {flag}   the dead letters and their errors",
        (f"  {cmd} serve {flag}   admin page on http://127.0.0.1:8025/ (log in with the "
         "one-time token it prints; Prometheus metrics: /metrics)"),
    ]
    if cmd != "pgbroker":
        lines.append(f"  ({cmd} because pgbroker is not on PATH: "
                     f"'source {shlex.quote(_relative(Path(sys.executable).parent))}/activate' "
                     "makes it so)")
    return lines


def pgbroker_command() -> str:
    """How to run this environment's ``pgbroker`` from the current directory: ``pgbroker`` when
    it is the one on PATH (an activated venv), else its path (``.venv/bin/pgbroker``: the
    README's commands never activate the venv), else ``python -m pgbroker``."""
    script = Path(sys.executable).parent / "pgbroker"  # not resolved: the venv's bin
    found = shutil.which("pgbroker")
    if found and script.exists() and Path(found).resolve() == script.resolve():
        return "pgbroker"
    if script.exists():
        return shlex.quote(_relative(script))
    return f"{shlex.quote(sys.executable)} -m pgbroker"


def _relative(path: Path) -> str:
    """``path`` relative to the current directory when it is below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _create(session: Session, event_id: int, plan: Plan, people: list[Customer],
            tick: Callable[[], None]) -> Iterator[int]:
    """Create the reservations wave by wave, calling ``tick`` between waves; yields the number
    created so far."""
    for start in range(0, len(people), plan.wave_size):
        for person in people[start:start + plan.wave_size]:
            hold = services.DEFAULT_HOLD_SECONDS if person.confirm else plan.hold_seconds
            reservation = services.reserve(session, event_id, person.email, person.seats,
                                           hold_seconds=hold)
            if person.confirm:
                services.confirm(session, reservation.id)
            if person.card is not None:
                services.pay(session, reservation.id, person.card)
        yield min(start + plan.wave_size, len(people))
        tick()
        time.sleep(plan.wave_pause)


def run(plan: Plan, *, short: bool, timeout: float, log_dir: Path | None, out: TextIO,
        database: str = "ticketflow_demo", keep: bool = False) -> int:
    """The demo; returns the exit status."""
    from_env = bool(os.environ.get(ENV_DATABASE_URL, "").strip())
    server = db.resolve_url(None, "demo")  # may start an embedded server, owned by this process
    url = db.create_database(server, database)
    try:
        os.environ[ENV_DATABASE_URL] = url  # read by celeryconfig (here and in the children)
        _config_dir()
        if db.database_url() != url:
            raise ConfigurationError(f"the Celery config's broker_url is not {ENV_DATABASE_URL};"
                                     " the demo needs both to name one database")
        print(f"ticketflow demo{' (short)' if short else ''}: database {database} on "
              f"{_describe(server, from_env)}, dropped at the end unless --keep", file=out)
        migrate_pgbroker(url)
        db.migrate(url)
        return _run(plan, url, short=short, timeout=timeout, log_dir=log_dir, out=out)
    finally:
        db.dispose()
        if keep:
            print(f"kept database {database}: {pgbroker_command()} stats --database-url "
                  f"{shlex.quote(url)}", file=out, flush=True)
        else:
            db.drop_database(server, database)
            print(f"dropped database {database}", file=out, flush=True)


def _run(plan: Plan, url: str, *, short: bool, timeout: float, log_dir: Path | None,
         out: TextIO) -> int:
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="ticketflow-demo-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    children = start_children(url, plan, log_dir)
    try:
        print(f"Started worker (pid {children[0].pid}) and beat (pid {children[1].pid}); "
              f"logs in {log_dir}", file=out)
        print(f"expire_reservations runs every {plan.expire_interval:g} s; holds left to "
              f"expire last {plan.hold_seconds:g} s", file=out)
        print("\n".join(_look_here(url)), file=out)
        print("Press Ctrl-C to stop." if not short else
              "--short: stops by itself once every reservation is final.", file=out)
        print(file=out, flush=True)
        with db.session(url) as session:
            return _watch(session, plan, children, short, timeout, started, out)
    except KeyboardInterrupt:
        print("\nCtrl-C: stopping the worker and beat (Ctrl-C again to kill them)", file=out,
              flush=True)
        return 0
    finally:
        stop_children(children, out)


def _watch(session: Session, plan: Plan, children: list[Child], short: bool, timeout: float,
           started: float, out: TextIO) -> int:
    with session.begin():  # the database clock: jobs made from now on are this run's
        since = session.execute(text("SELECT now()")).scalar_one()
    event = services.create_event(session, f"pgbroker live {time.strftime('%Y-%m-%d %H:%M')}",
                                  capacity=plan.reservations * 3)
    monitor = Monitor(session, event.id, since, _schema_of())
    display = Display(out, started)
    last_draw = 0.0

    def tick(status: str = "creating reservations") -> None:
        nonlocal last_draw
        _check_alive(children)
        if time.monotonic() - last_draw >= 1.0:
            display.show(monitor.counts(), status)
            last_draw = time.monotonic()

    for created in _create(session, event.id, plan, customers(plan), tick):
        monitor.created = created
    announced = False
    while True:
        counts = monitor.counts()
        finished = counts.done(plan)
        display.show(counts, "all reservations final" if finished else "working")
        if finished and short:
            display.release(erase=True)  # the final counts replace the live ones
            _summary(counts, monitor.dead_letters(), time.monotonic() - started, out)
            return 0
        if finished and not announced:
            display.release()
            print(f"All {plan.reservations} reservations reached a final state. "
                  "Ctrl-C to stop.\n", file=out, flush=True)
            announced = True
        if short and time.monotonic() - started > timeout:
            display.release()
            print(f"ticketflow demo: not finished after {timeout:g} s", file=out)
            _summary(counts, monitor.dead_letters(), time.monotonic() - started, out)
            return 1
        _check_alive(children)
        time.sleep(1.0)


def _schema_of() -> str:
    return Settings.from_options(app.conf.broker_transport_options).schema


def _check_alive(children: list[Child]) -> None:
    for child in children:
        if not child.alive():
            raise ChildDied(f"the {child.name} exited with status {child.popen.returncode}; "
                            f"the end of {child.log_path}:\n{child.tail()}")


class ChildDied(RuntimeError):
    """The worker or beat exited on its own."""


def _summary(counts: Counts, dead: list[tuple[str, str]], elapsed: float, out: TextIO) -> None:
    print(f"Final counts after {elapsed:.0f} s:", file=out)
    print("\n".join(counts.lines()), file=out)
    for task, error in dead:
        print(f"  dead letter: {task}: {(error or '').splitlines()[0][:120]}", file=out)
    out.flush()


def _describe(server: str, from_env: bool) -> str:
    if from_env:
        return f"the server of {ENV_DATABASE_URL} ({mask_password(server)})"
    if server == DEFAULT_LOCAL_URL:
        return f"the local server ({server})"
    return f"an embedded PostgreSQL server ({server}), stopped when the demo ends"


# -- command line --------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--short", action="store_true",
                        help="short holds and intervals; exit once every reservation is final")
    parser.add_argument("--reservations", type=_count, metavar="N",
                        help=f"how many (default: {FULL.reservations}, "
                             f"short: {SHORT.reservations})")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="--short gives up (status 1) after this long (default: 300)")
    parser.add_argument("--log-dir", type=Path, metavar="DIR",
                        help="where the worker and beat logs go (default: a new temporary "
                             "directory, kept)")
    parser.add_argument("--database", default="ticketflow_demo", metavar="NAME",
                        help="the demo's own database, created on the server and dropped at "
                             "the end (default: ticketflow_demo)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the database at the end, to look at it (the next run "
                             "replaces it)")


def _count(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if not 1 <= number <= 100_000:
        raise argparse.ArgumentTypeError(f"expected a number of reservations from 1 to 100000, "
                                         f"not {value!r}")
    return number


def main(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    plan = SHORT if args.short else FULL
    if args.reservations:
        plan = dataclasses.replace(plan, reservations=args.reservations)

    def terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM stops the demo the way Ctrl-C does

    signal.signal(signal.SIGTERM, terminate)
    try:
        return run(plan, short=args.short, timeout=args.timeout, log_dir=args.log_dir, out=out,
                   database=args.database, keep=args.keep)
    except ChildDied as exc:
        print(f"\nticketflow demo: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # before the children started (e.g. while migrating)
        return 130
