"""How the admin pages show values: the template filters (durations, sizes, times), the jobs
browser's filter read from a form and written back as a query string, and a job's parts made
readable (indented JSON, a Celery body's arguments).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from flask import Flask, request

from ..metrics import is_internal_queue
from ..ops import JobFilter, OperationError, is_poison
from . import charts

__all__ = ["PAGE_LIMIT", "call_args", "filter_args", "format_duration", "format_size",
           "install_filters", "job_filter", "pretty", "when"]

#: Characters of headers, properties and body shown on a job's page (the rest: download).
PAGE_LIMIT = 65536


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{s} s"
    size, unit, sub_size, sub = ((60, "min", 1, "s") if s < 3600 else
                                 (3600, "h", 60, "min") if s < 86400 else (86400, "d", 3600, "h"))
    rest = s % size // sub_size
    return f"{s // size} {unit}" + (f" {rest} {sub}" if rest else "")


def format_size(n: int | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("MB", 1 << 20), ("kB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def install_filters(app: Flask) -> None:
    """Register the filters and globals the templates use."""
    app.add_template_filter(format_duration, "duration")
    app.add_template_filter(format_size, "size")
    app.add_template_filter(lambda v: v.strftime("%Y-%m-%d %H:%M:%S") if v else "–", "when")
    app.add_template_filter(
        lambda t: (t or "").strip().splitlines()[0] if (t or "").strip() else "", "first_line")
    app.add_template_filter(charts.format_ms, "ms")
    app.add_template_filter(lambda d, *keys: {k: v for k, v in d.items() if k not in keys},
                            "dict_without")
    app.add_template_filter(charts.format_count, "count")
    app.add_template_global(is_poison, "is_poison")
    app.add_template_global(is_internal_queue, "is_internal_queue")


def when(name: str, source: Any = None) -> datetime | None:
    """A ``datetime-local`` field (of the query string by default), read as UTC."""
    text = ((request.args if source is None else source).get(name) or "").strip()
    if not text:
        return None
    try:
        return datetime.fromisoformat(text).replace(tzinfo=timezone.utc)
    except ValueError:
        raise OperationError(f"{name}: {text!r} is not a date and time (YYYY-MM-DDTHH:MM)") \
            from None


def job_filter(source: Any) -> JobFilter:
    """The jobs browser's filter from its form fields (a query string or a POSTed form)."""
    def field(name: str) -> str | None:
        return (source.get(name) or "").strip() or None

    return JobFilter(queue=field("queue"), task=field("task"), state=field("state"),
                     created_from=when("from", source), created_to=when("to", source),
                     text=source.get("text") or None)


def filter_args(match: JobFilter) -> dict[str, str]:
    """The query string of a filter (the browser's form fields)."""
    return {k: v for k, v in {
        "queue": match.queue, "task": match.task, "state": match.state, "text": match.text,
        "from": match.created_from.strftime("%Y-%m-%dT%H:%M") if match.created_from else None,
        "to": match.created_to.strftime("%Y-%m-%dT%H:%M") if match.created_to else None,
    }.items() if v}


def pretty(text: str | None, size: int | None) -> dict[str, Any]:
    """Headers or properties for the page: indented JSON when whole, else the cut text."""
    text = text or ""
    cut = size is not None and size > len(text)
    if not cut:
        try:
            text = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
        except ValueError:
            pass
    return {"text": text, "cut": cut, "size": size}


def call_args(body: bytes, content_type: str | None) -> dict[str, Any] | None:
    """A Celery (protocol 2) JSON body's args and kwargs, for the page; None otherwise."""
    if not content_type or "json" not in content_type:
        return None
    try:
        decoded = json.loads(body)
    except ValueError:
        return None
    if (isinstance(decoded, list) and len(decoded) == 3 and isinstance(decoded[0], list)
            and isinstance(decoded[1], dict)):
        return {"args": json.dumps(decoded[0], indent=2, ensure_ascii=False),
                "kwargs": json.dumps(decoded[1], indent=2, ensure_ascii=False)}
    return None
