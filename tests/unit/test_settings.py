"""Unit tests of pgbroker.settings: transport options -> one frozen, validated Settings."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from pgbroker._model import foreign_options as _foreign_options
from pgbroker._model.foreign_options import INSTEAD, KOMBU_OPTIONS, MAPPED
from pgbroker.errors import ConfigurationError
from pgbroker.settings import Settings

INTEGER_OPTIONS = ("max_attempts", "claim_batch_max", "prune_batch_size", "max_message_size")
SECONDS_OPTIONS = ("retention", "lease_timeout", "heartbeat_interval", "sweep_interval",
                   "poll_interval", "connect_timeout", "xmin_warn_after")


@pytest.fixture(autouse=True)
def _warnings_not_given_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the process before its first warning about another transport's option."""
    monkeypatch.setattr(_foreign_options, "_warned", set())


def test_defaults_are_valid_and_documented_values() -> None:
    s = Settings.from_options(None)
    assert s == Settings() == Settings.from_options({})
    assert s.schema == "pgbroker"
    assert s.auto_migrate is True
    assert s.max_attempts == 5
    assert s.lease_timeout >= 2 * s.heartbeat_interval
    assert s.require_idempotency_key == frozenset()
    assert s.channel == "pgbroker.jobs"
    assert s.xmin_warn_after == 300.0 and Settings(xmin_warn_after=0).xmin_warn_after == 0


def test_options_are_applied() -> None:
    s = Settings.from_options({"schema": "app_queue", "max_attempts": 3, "retention": 0,
                               "lease_timeout": 4, "heartbeat_interval": 2})
    assert (s.schema, s.max_attempts, s.retention) == ("app_queue", 3, 0)
    assert s.channel == "app_queue.jobs"


def test_settings_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().max_attempts = 9  # type: ignore[misc]


def test_unknown_option_names_the_closest_known_one() -> None:
    with pytest.raises(ConfigurationError, match="'max_attempt'.*did you mean 'max_attempts'"):
        Settings.from_options({"max_attempt": 3})


def test_unknown_option_without_a_close_match() -> None:
    with pytest.raises(ConfigurationError, match="unknown pgbroker transport option 'zzz'") as info:
        Settings.from_options({"zzz": 1})
    assert "did you mean" not in str(info.value)


def test_configuration_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        Settings.from_options({"nope": 1})


@pytest.mark.parametrize("option", sorted(KOMBU_OPTIONS))
def test_options_kombu_reads_for_every_transport_are_accepted_quietly(
        option: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "pgbroker"):
        assert Settings.from_options({option: 1}) == Settings()
    assert caplog.records == []


@pytest.mark.parametrize(("option", "own"), sorted(MAPPED.items()))
def test_another_transports_option_with_a_pgbroker_meaning_is_read_as_it(
        option: str, own: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "pgbroker"):
        assert getattr(Settings.from_options({option: 2.5}), own) == 2.5
        assert getattr(Settings.from_options({option: 2.5, own: 2.5}), own) == 2.5
    assert [r.getMessage() for r in caplog.records] == [
        f"transport option {option!r} is read as pgbroker's {own!r}"]  # once per process
    with pytest.raises(ConfigurationError, match=f"mean the same: give '{own}' only"):
        Settings.from_options({option: 1, own: 2})


@pytest.mark.parametrize("option", sorted(INSTEAD))
def test_another_transports_option_is_accepted_with_one_warning_saying_what_pgbroker_does(
        option: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "pgbroker"):
        assert Settings.from_options({option: 1}) == Settings()
        assert Settings.from_options({option: 1}) == Settings()
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, f"transport option {option!r} does nothing here: {INSTEAD[option]}")]


def test_visibility_timeout_warning_names_the_lease() -> None:
    assert INSTEAD["visibility_timeout"] == (
        "pgbroker has no visibility timeout: a running job is redelivered only when its "
        "worker's lease (lease_timeout) expires, never while the worker lives")


def test_the_readme_names_every_option_of_another_transport() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text("utf-8")
    table = readme[readme.index("## Transport options"):readme.index("## Operations")]
    missing = [name for name in [*KOMBU_OPTIONS, *MAPPED, *INSTEAD] if f"`{name}`" not in table
               and not (name.startswith("unacked_") and "`unacked_*`" in table)]
    assert missing == []


def test_the_transports_option_lists_do_not_overlap() -> None:
    known = {f.name for f in dataclasses.fields(Settings)}
    groups = [known, set(KOMBU_OPTIONS), set(MAPPED), set(INSTEAD)]
    assert sum(map(len, groups)) == len(set().union(*groups))
    assert set(MAPPED.values()) <= known


@pytest.mark.parametrize("schema", ["a", "_x", "app_queue_2", "a" * 48])
def test_valid_schema_names(schema: str) -> None:
    assert Settings(schema=schema).schema == schema


@pytest.mark.parametrize("schema", ["", "Public", "1abc", 'a"b', "a b", "a-b", "a;drop",
                                    "a" * 49, "é", None, 3])
def test_invalid_schema_names_are_refused(schema: object) -> None:
    with pytest.raises(ConfigurationError, match="not a valid pgbroker schema name"):
        Settings(schema=schema)  # type: ignore[arg-type]


@pytest.mark.parametrize("option", INTEGER_OPTIONS)
@pytest.mark.parametrize("value", [0, -1, True, 1.5, "3", None])
def test_integer_options_must_be_positive_integers(option: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=f"{option} must be a positive integer"):
        Settings.from_options({option: value})


@pytest.mark.parametrize("option", SECONDS_OPTIONS)
@pytest.mark.parametrize("value", [-1, -0.5, True, "5", None])
def test_seconds_options_must_be_non_negative_numbers(option: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=f"{option} must be a number of seconds"):
        Settings.from_options({option: value})


def test_seconds_options_accept_floats_and_zero_where_meaningful() -> None:
    s = Settings.from_options({"retention": 0, "sweep_interval": 0, "poll_interval": 0.25,
                               "lease_timeout": 1.5, "heartbeat_interval": 0.5})
    assert (s.retention, s.sweep_interval, s.poll_interval) == (0, 0, 0.25)


@pytest.mark.parametrize(("lease", "heartbeat"), [(9.9, 5), (1, 1), (10, 0)])
def test_lease_must_outlast_two_heartbeats(lease: float, heartbeat: float) -> None:
    with pytest.raises(ConfigurationError, match="lease_timeout"):
        Settings.from_options({"lease_timeout": lease, "heartbeat_interval": heartbeat})


def test_lease_of_exactly_two_heartbeats_is_accepted() -> None:
    assert Settings(lease_timeout=10, heartbeat_interval=5).lease_timeout == 10


@pytest.mark.parametrize(("given", "expected"), [
    ("tasks.charge", frozenset({"tasks.charge"})),
    (["a", "b", "a"], frozenset({"a", "b"})),
    (("a",), frozenset({"a"})),
    ([], frozenset()),
])
def test_require_idempotency_key_becomes_a_frozenset(given: object,
                                                     expected: frozenset[str]) -> None:
    assert Settings.from_options({"require_idempotency_key": given}).require_idempotency_key \
        == expected


@pytest.mark.parametrize("option", ["auto_migrate", "use_advisory_locks", "durable_publish",
                                    "durable_acks", "transaction_pooling"])
@pytest.mark.parametrize("value", ["false", 0, 1, None])
def test_boolean_options_refuse_non_booleans(option: str, value: object) -> None:
    # the string 'false' from an environment variable must not silently mean True
    with pytest.raises(ConfigurationError, match=f"{option} must be true or false"):
        Settings.from_options({option: value})


def test_pause_task_after_is_checked() -> None:
    assert Settings().pause_task_after == 5
    assert Settings.from_options({"pause_task_after": 0}).pause_task_after == 0
    for bad in (-1, "5", 2.5, True):
        with pytest.raises(ConfigurationError, match="pause_task_after"):
            Settings(pause_task_after=bad)
