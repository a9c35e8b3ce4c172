"""AMQP routing rules: which binding keys a routing key matches, by exchange type.

Used where pgbroker routes by itself: the topic exchange (``pgbroker.transport``) and the
delivery of broadcasts to this process's queues (``pgbroker._consumer``).
"""

from __future__ import annotations

import functools

__all__ = ["matches", "topic_matches"]


def topic_matches(binding_key: str, routing_key: str) -> bool:
    """AMQP topic matching, word by word: ``*`` is exactly one word, ``#`` zero or more
    (kombu's regex makes ``#`` need at least one, so ``stock.#`` missed ``stock``)."""
    pattern, words = binding_key.split("."), routing_key.split(".")

    @functools.cache
    def match(i: int, j: int) -> bool:
        if i == len(pattern):
            return j == len(words)
        if pattern[i] == "#":
            return match(i + 1, j) or (j < len(words) and match(i, j + 1))
        return j < len(words) and pattern[i] in ("*", words[j]) and match(i + 1, j + 1)

    return match(0, 0)


def matches(exchange_type: str, binding_key: str, routing_key: str) -> bool:
    """AMQP routing: fanout takes all, topic matches ``*``/``#`` patterns, direct is equality."""
    if exchange_type == "fanout":
        return True
    if exchange_type == "topic":
        return topic_matches(binding_key, routing_key)
    return binding_key == routing_key
