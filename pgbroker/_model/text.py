"""Text that PostgreSQL cannot store as it is, stored escaped and given back exactly.

PostgreSQL's ``text`` and ``jsonb`` hold no NUL (U+0000), and its UTF-8 holds no surrogates
(U+D800-U+DFFF); Python strings hold both: a NUL from binary data, lone surrogates in every name
``os.listdir`` decodes with ``surrogateescape`` (a file name that is not UTF-8). Such a string is
stored as :data:`ESCAPED` followed by the string with each backslash doubled, each NUL written
``\\x00`` and each surrogate ``\\udXXX``; a string that itself begins with :data:`ESCAPED` is
escaped too, so every stored form decodes back to exactly the string it came from. Everything
else is stored as it is: the escape costs nothing to the messages that do not need it.

Escaped: a message's headers and properties (decoded again on delivery, so a task sees what its
producer sent), the errors and tracebacks of jobs, the text columns and the queryable JSON copy
of the result backend. Refused instead (they are identities, compared and indexed): names, task
ids, idempotency keys, content types (``pgbroker._model.message``).

JSON nesting is bounded by :data:`MAX_NESTING`: Celery pickles a task's headers for its prefork
pool and Python's ``json`` and ``pickle`` recurse once per level, so headers nested about 900
deep made every delivery crash the worker (``RecursionError`` while pickling), and 3,000 deep
crashed the claim itself; PostgreSQL accepts 10,000.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from psycopg.adapt import Loader
from psycopg.pq import Format

from ..errors import MessageError

__all__ = ["ESCAPED", "MAX_NESTING", "JsonError", "Unreadable", "storable", "checked_name",
           "escape", "unescape", "escape_json", "unescape_json", "jsonb_dumps", "nesting",
           "register_jsonb_loaders"]

#: What begins a stored string that was escaped.
ESCAPED = "pgbroker-escaped:"

#: Deepest JSON nesting accepted in a message's headers or properties (the headers object itself
#: is level 1): Ruby's JSON default, far below the ~900 levels where pickling for the prefork
#: pool fails.
MAX_NESTING = 100

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_TO_ESCAPE = re.compile("[\\\\\x00\ud800-\udfff]")
_ESCAPE_SEQUENCE = re.compile(r"\\(\\|x00|u[0-9a-f]{4})")
_ESCAPED_BYTES = ESCAPED.encode()


def _escape_char(match: re.Match[str]) -> str:
    char = match.group()
    return "\\\\" if char == "\\" else "\\x00" if char == "\x00" else f"\\u{ord(char):04x}"


def _unescape_sequence(match: re.Match[str]) -> str:
    code = match.group(1)
    return "\\" if code == "\\" else "\x00" if code == "x00" else chr(int(code[1:], 16))


def storable(text: str) -> bool:
    """Whether PostgreSQL text can hold ``text`` as it is (no NUL, no surrogate)."""
    return _UNSTORABLE.search(text) is None


def checked_name(text: str, what: str, limit: int) -> str:
    """``text`` if PostgreSQL text and its btree indexes can hold it (no NUL or lone surrogate,
    at most ``limit`` bytes of UTF-8), else a MessageError naming ``what``."""
    if not storable(text):
        raise MessageError(f"{what} {text[:80]!r} contains a NUL or a lone surrogate, which "
                           "PostgreSQL text cannot hold")
    size = len(text.encode())
    if size > limit:
        raise MessageError(f"{what} is {size} bytes in UTF-8; the limit is {limit} bytes")
    return text


def _needs_escape(text: str) -> bool:
    return text.startswith(ESCAPED) or not storable(text)


def escape(text: str) -> str:
    """``text`` as PostgreSQL can store it: itself, or its escaped form."""
    if not _needs_escape(text):
        return text
    return ESCAPED + _TO_ESCAPE.sub(_escape_char, text)


def unescape(text: str) -> str:
    """The string :func:`escape` was given."""
    if not text.startswith(ESCAPED):
        return text
    return _ESCAPE_SEQUENCE.sub(_unescape_sequence, text[len(ESCAPED):])


def escape_json(value: Any) -> Any:
    """``value`` with every string in it (keys too) escaped where needed; the same objects where
    nothing needed it. Call it on values nested at most :data:`MAX_NESTING` deep."""
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, dict):
        items = [(escape_json(k), escape_json(v)) for k, v in value.items()]
        changed = any(k is not k0 or v is not v0 for (k, v), (k0, v0) in zip(items,
                                                                               value.items()))
        return dict(items) if changed else value
    if isinstance(value, (list, tuple)):
        items = [escape_json(v) for v in value]
        return items if any(v is not v0 for v, v0 in zip(items, value)) else value
    return value


def unescape_json(value: Any) -> Any:
    """The inverse of :func:`escape_json` (on JSON-decoded values)."""
    if isinstance(value, str):
        return unescape(value)
    if isinstance(value, dict):
        return {unescape_json(k): unescape_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unescape_json(v) for v in value]
    return value


def nesting(value: Any, limit: int = MAX_NESTING) -> int:
    """How deep ``value`` nests (a scalar: 0, ``{}``: 1), counted without recursion and no
    further than ``limit + 1``."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        children: Iterable[Any]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if level > limit:
            return level
        stack.extend((child, level + 1) for child in children)
    return deepest


def _may_nest_deeper(text: str | bytes, limit: int) -> bool:
    """False when the JSON text cannot nest deeper than ``limit`` (it opens fewer containers)."""
    if isinstance(text, str):
        return text.count("{") + text.count("[") > limit
    return text.count(b"{") + text.count(b"[") > limit


class JsonError(ValueError):
    """A value that cannot be stored as jsonb (the message says why)."""


def jsonb_dumps(value: Any, limit: int = MAX_NESTING) -> str:
    """``value`` as JSON text that jsonb accepts and that decodes back to ``value``, strings
    escaped where needed.

    Raises:
        JsonError: nested deeper than ``limit``, or not JSON (NaN, bytes, ...).
    """
    try:
        text = json.dumps(value, allow_nan=False)
    except RecursionError:
        raise JsonError(f"it is nested deeper than {limit} levels") from None
    except (TypeError, ValueError) as exc:
        raise JsonError(f"it is not JSON: {exc}") from None
    if _may_nest_deeper(text, limit) and nesting(value, limit) > limit:
        raise JsonError(f"it is nested deeper than {limit} levels")
    # json.dumps writes NUL as \u0000 and every character beyond ASCII as \uXXXX, so these
    # find every string that may need escaping (and some that do not: escape_json decides).
    if "\\u0000" in text or "\\ud" in text or ESCAPED in text:
        text = json.dumps(escape_json(value), allow_nan=False)
    return text


class Unreadable:
    """A stored JSON value that could not be given back as Python; ``reason`` says why."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self) -> str:
        return f"Unreadable({self.reason!r})"


def load_jsonb(data: bytes) -> Any:
    """JSON text read from jsonb: decoded, unescaped; :class:`Unreadable` instead of raising,
    so that one bad row never takes the others read with it."""
    try:
        value = json.loads(data)
    except RecursionError:
        return Unreadable(f"JSON nested too deep to decode (pgbroker accepts {MAX_NESTING} "
                          "levels at publish)")
    except ValueError as exc:
        return Unreadable(f"invalid JSON: {exc}")
    if _may_nest_deeper(data, MAX_NESTING) and nesting(value) > MAX_NESTING:
        # decodable here, but Celery would pickle it for its pool, which recurses deeper
        return Unreadable(f"JSON nested deeper than {MAX_NESTING} levels, the limit at "
                          "publish")
    if _ESCAPED_BYTES in data:
        value = unescape_json(value)
    return value


class _JsonbLoader(Loader):
    def load(self, data: Any) -> Any:
        return load_jsonb(bytes(data))


class _JsonbBinaryLoader(Loader):
    format = Format.BINARY

    def load(self, data: Any) -> Any:
        return load_jsonb(bytes(data[1:]))  # a version byte, then the text


def register_jsonb_loaders(context: Any) -> None:
    """Read jsonb through :func:`load_jsonb` on ``context`` (a connection or cursor)."""
    context.adapters.register_loader("jsonb", _JsonbLoader)
    context.adapters.register_loader("jsonb", _JsonbBinaryLoader)
