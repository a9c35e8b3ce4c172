"""The statements sent are the named blocks of sql/*.sql without their comment lines."""

from __future__ import annotations

from pgbroker._pg.catalogue import queries, without_comment_lines


def test_comment_lines_go_and_quoted_text_stays() -> None:
    text = ("-- why\nSELECT 'a\n-- in a literal\nb',  -- it's a comment after the code\n"
            "    -- an indented comment\n  \"x--y\" AS \"it's\"  -- 'odd\n-- gone\nFROM t")
    assert without_comment_lines(text) == (
        "SELECT 'a\n-- in a literal\nb',  -- it's a comment after the code\n"
        "  \"x--y\" AS \"it's\"  -- 'odd\nFROM t")


def test_the_hot_statements_fit_psycopgs_query_cache() -> None:
    """psycopg converts a query of at most 4,096 bytes once and caches it; a longer one is
    parsed again at every execution."""
    q = queries("pgbroker")
    for name in ("job_insert", "job_insert_many", "job_claim", "job_ack", "job_fanout"):
        assert len(q[name].encode()) <= 4096, name
        assert "\n--" not in q[name] and not q[name].startswith("--"), name
