"""AMQP routing: which binding keys a routing key matches, and the exchange types that use it.

Used where pgbroker routes by itself: the channel's direct and topic exchanges
(``pgbroker.transport``) and the delivery of broadcasts to this process's queues
(``pgbroker._consume.consumer``).
"""

from __future__ import annotations

import functools
from typing import Any

from kombu.transport.virtual.exchange import DirectExchange, TopicExchange

from .message import TRANSIENT

__all__ = ["matches", "topic_matches", "RoutingDirectExchange", "RoutingTopicExchange"]


class RoutingDirectExchange(DirectExchange):
    """Direct routing; a message no binding matches is the channel's to decide (``_unroutable``)
    rather than dropped without a word."""

    def deliver(self, message: dict[str, Any], exchange: str, routing_key: str,
                **kwargs: Any) -> None:
        self.channel.route(message, exchange, routing_key, **kwargs)


class RoutingTopicExchange(TopicExchange):
    """Topic routing like AMQP; a transient message (worker events) goes to the live consumers
    as a broadcast instead of a row per bound queue, so events never pile up in ``jobs``."""

    def lookup(self, table: Any, exchange: str, routing_key: str, default: Any) -> set[str]:
        return {queue for key, _, queue in table if topic_matches(key, routing_key)}

    def deliver(self, message: dict[str, Any], exchange: str, routing_key: str,
                **kwargs: Any) -> None:
        if message["properties"].get("delivery_mode") == TRANSIENT:
            self.channel.broadcast(exchange, message)
        else:
            self.channel.route(message, exchange, routing_key, **kwargs)


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
