"""The ``pgbroker`` commands' help and a database they cannot reach, in-process, no database
(the commands against a real one: tests/integration/test_cli.py)."""

from __future__ import annotations

import pytest

from pgbroker.cli import main


COMMANDS = [["migrate"], ["stats"], ["jobs", "list"], ["jobs", "show"], ["dead", "list"],
            ["dead", "retry"], ["dead", "discard"], ["cancel"], ["revoke"], ["purge"], ["pause"],
            ["resume"], ["audit"], ["sweep"], ["serve"], ["health", "worker"],
            ["health", "queue"], ["health", "beat"]]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_explains_each_command(command: list[str], capsys: pytest.CaptureFixture[str]
                                    ) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: pgbroker {' '.join(command)}" in out
    assert "--database-url" in out and len(out.splitlines()) > 5


def test_unreachable_database_is_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--database-url", "postgresql://nobody@127.0.0.1:1/none", "stats"]) == 1
    assert "cannot connect to PostgreSQL" in capsys.readouterr().err
