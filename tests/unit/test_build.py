"""Unit tests of pgbroker._produce.build's fast paths, against what they stand in for: Celery's
``saferepr`` and ``uuid4`` (no database)."""

from __future__ import annotations

import random
import uuid
from collections import namedtuple
from decimal import Decimal
from typing import Any

from celery.utils.saferepr import saferepr

from pgbroker._produce.build import _plain_repr, _task_id

Point = namedtuple("Point", "x y")


def test_plain_repr_is_saferepr() -> None:
    """_plain_repr gives saferepr's string, or None (then saferepr is called): for every value
    and limit, including random nested ones."""
    rng = random.Random(9)
    scalars = [0, 1, -17, 2**64, True, False, None, 1.5, -0.0, float("inf"), float("nan"),
               "", "a", "it's", '"', "\\", "\n", "é☃\U0001F600", "two words", "'quoted'"]

    def value(depth: int) -> Any:
        if depth > 5 or rng.random() < 0.45:
            return rng.choice(scalars + ["s" * rng.randint(0, 60), rng.randint(-10**6, 10**6)])
        kind = rng.choice([tuple, list, dict])
        items = [value(depth + 1) for _ in range(rng.randint(0, 4))]
        if kind is dict:
            return {rng.choice(["k", "it's", "é", str(n)]) + str(n): v for n, v in enumerate(items)}
        return kind(items)

    values = [value(0) for _ in range(3000)] + [
        (), [], {}, (1,), ("x" * 2000,), {"a": {"b": {"c": {"d": {}}}}}, [[[[[]]]]],
        (b"bytes",), (Decimal("1"),), ({1, 2},), (Point(1, 2),), ({1: 2},), (range(3),)]
    made = 0
    for maxsize in (None, 0, 1, 2, 5, 20, 64, 1024):
        for maxlevels in (0, 1, 2, 3, 6, -1):
            for v in values:
                plain = _plain_repr(v, maxsize, maxlevels)
                if plain is not None:
                    made += 1
                    assert plain == saferepr(v, maxsize, maxlevels=maxlevels), (v, maxsize,
                                                                                maxlevels)
    assert made > 50_000  # the fast way is the common one
    assert _plain_repr(("it's", 1, None, [2.5]), 1024, 3) == "('it\\'s', 1, None, [2.5])"
    assert _plain_repr((b"x",), 1024, 3) is None and _plain_repr(("x" * 1030,), 1024, 3) is None


def test_task_ids_are_uuid4_strings() -> None:
    made = {_task_id() for _ in range(2000)}
    assert len(made) == 2000
    for text in made:
        parsed = uuid.UUID(text)
        assert str(parsed) == text and parsed.version == 4 and parsed.variant == uuid.RFC_4122
