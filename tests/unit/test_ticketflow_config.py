"""ticketflow without a database: its Celery configuration, beat schedule, fake gateway, the
demo's plan and command line."""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Iterator
from types import ModuleType

import pytest

import ticketflow
from ticketflow import gateway, schedule
from ticketflow.__main__ import build_parser
from billiard import pool

from ticketflow.demo import GOOD_CARD, SHORT, STOP_TIMEOUT, customers


@pytest.fixture
def config(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``celeryconfig`` re-imported under the environment the test sets (restored after)."""
    import celeryconfig

    yield celeryconfig
    monkeypatch.undo()
    importlib.reload(celeryconfig)


def test_the_config_takes_the_database_from_the_environment(
        config: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGBROKER_DATABASE_URL", "postgres://app:secret@db.internal:6543/tickets")
    importlib.reload(config)
    assert config.broker_url == "pgbroker+postgresql://app:secret@db.internal:6543/tickets"
    monkeypatch.delenv("PGBROKER_DATABASE_URL")
    importlib.reload(config)  # no embedded server is started here: the local default
    assert config.broker_url == "pgbroker+postgresql://postgres@127.0.0.1:5432/postgres"


def test_the_config_refuses_a_bad_database_url_or_interval(
        config: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGBROKER_DATABASE_URL", "mysql://somewhere/db")
    with pytest.raises(ValueError, match="mysql"):
        importlib.reload(config)
    monkeypatch.delenv("PGBROKER_DATABASE_URL")
    monkeypatch.setenv(schedule.ENV_EXPIRE_INTERVAL, "soon")
    with pytest.raises(ValueError, match="TICKETFLOW_EXPIRE_INTERVAL='soon'"):
        importlib.reload(config)


def test_the_production_settings() -> None:
    conf = ticketflow.app.conf
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.task_acks_on_failure and conf.task_acks_on_timeout
    assert conf.task_time_limit == 120 and conf.worker_prefetch_multiplier == 1
    assert conf.accept_content == ["json"] and conf.task_serializer == "json"
    assert conf.beat_scheduler == "pgbroker.beat:Scheduler"
    assert conf.broker_transport_options["require_idempotency_key"] == [
        "ticketflow.tasks.charge_payment"]
    router = ticketflow.app.amqp.router
    assert router.route({}, "ticketflow.tasks.send_confirmation_email")["queue"].name == "email"
    assert router.route({}, "ticketflow.tasks.charge_payment")["queue"].name == "default"
    # the pools (seed 001): short system work, heavy work, waiting work
    assert router.route({}, "ticketflow.tasks.expire_reservations")["queue"].name == "system"
    assert router.route({}, "ticketflow.tasks.render_ticket_pdf")["queue"].name == "heavy"
    assert "ticketflow.alerts" in conf.include  # pgbroker's signals connected in every worker
    [entry] = conf.beat_schedule.values()
    assert entry["task"] == "ticketflow.tasks.expire_reservations"
    assert entry["task"] in ticketflow.app.tasks  # the name beat sends is a registered task


@pytest.mark.parametrize("raw, expected", [("", 60.0), ("2", 2.0), (" 0.5 ", 0.5)])
def test_the_expiry_interval(raw: str, expected: float) -> None:
    assert schedule.expire_interval({schedule.ENV_EXPIRE_INTERVAL: raw}) == expected
    assert schedule.beat_schedule(expected)["expire-reservations"]["schedule"] == expected


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "1e9", "a minute"])
def test_a_bad_expiry_interval_is_refused_with_the_variable_named(raw: str) -> None:
    with pytest.raises(ValueError, match=f"TICKETFLOW_EXPIRE_INTERVAL={raw!r}"):
        schedule.expire_interval({schedule.ENV_EXPIRE_INTERVAL: raw})


def test_the_fake_gateway_follows_the_card() -> None:
    key = "payment:1"
    ref = gateway.charge(GOOD_CARD, 100, key, call=1)
    assert ref.startswith("ch_") and gateway.charge(GOOD_CARD, 100, key, call=2) == ref
    for call in (1, 2):
        with pytest.raises(gateway.TransientPaymentError, match=f"call {call}"):
            gateway.charge("transient-2", 100, key, call)
    assert gateway.charge("transient-2", 100, key, call=3) == ref
    for call in (1, 5):
        with pytest.raises(gateway.PaymentDeclined):
            gateway.charge("declined", 100, key, call)


@pytest.mark.parametrize("card", ["", "  ", None, 4242, "transient", "transient-", "transient-x"])
def test_the_gateway_refuses_malformed_cards(card: object) -> None:
    with pytest.raises(ValueError, match="card"):
        gateway.check_card(card)


def test_the_short_demo_plan() -> None:
    people = customers(SHORT)
    assert people == customers(SHORT)  # deterministic
    assert len(people) == 200 and len({p.email for p in people}) == 200
    assert sum(not p.confirm for p in people) == 40
    assert all(p.confirm for p in people if p.card)  # only confirmed reservations are paid
    assert Counter(p.card for p in people if p.card) == {
        GOOD_CARD: 57, "transient-1": 3, "transient-2": 3, "declined": 1}


def test_the_demo_waits_longer_for_a_warm_shutdown_than_a_pool_process_may_take() -> None:
    # A task handed to a pool process in the instant of the SIGTERM runs, but Celery's pool has
    # already dropped it, never reads its result, and the process waits this long before it
    # exits (seen in CI: the demo killed the worker after 20 s, status -9).
    pool_wait = (pool.GUARANTEE_MESSAGE_CONSUMPTION_RETRY_LIMIT
                 * pool.GUARANTEE_MESSAGE_CONSUMPTION_RETRY_INTERVAL)
    assert STOP_TIMEOUT >= pool_wait + 10


@pytest.mark.parametrize("argv", [["demo", "--reservations", "0"],
                                  ["demo", "--reservations", "many"],
                                  ["demo", "--bogus"], []])
def test_the_command_line_refuses_bad_arguments(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert "usage: python -m ticketflow" in capsys.readouterr().err
