"""A fake payment gateway whose behaviour is chosen by the card, so runs are deterministic.

=====================  =======================================================================
card                   outcome of the n-th call for a payment
=====================  =======================================================================
``declined``           :class:`PaymentDeclined` every time (permanent: never retried)
``transient-<k>``      :class:`TransientPaymentError` for calls 1..k, then success
anything else          success (e.g. ``4242 4242 4242 4242``)
=====================  =======================================================================

A real gateway is an HTTP call that takes an idempotency key (Stripe's ``Idempotency-Key``
header): the key is the payment, so a charge retried after a lost answer is not taken twice.
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["PaymentError", "TransientPaymentError", "PaymentDeclined", "charge", "check_card"]

_TRANSIENT_RE = re.compile(r"^transient-(\d{1,3})$")


class PaymentError(Exception):
    """Base class of the gateway's errors."""


class TransientPaymentError(PaymentError):
    """The gateway timed out or is overloaded: the same charge may succeed later."""


class PaymentDeclined(PaymentError):
    """The card was declined: retrying cannot help."""


def check_card(card: object) -> str:
    """Return ``card`` if the gateway accepts its form; raise ``ValueError`` otherwise."""
    if not isinstance(card, str) or not card.strip():
        raise ValueError(f"card must be a non-empty string, not {card!r}")
    if card.startswith("transient") and not _TRANSIENT_RE.match(card):
        raise ValueError(f"card {card!r}: a transient test card is 'transient-<failures>'")
    return card


def charge(card: str, amount_cents: int, idempotency_key: str, call: int) -> str:
    """Charge ``amount_cents``; ``call`` is 1 for the first call for this payment.

    Returns the gateway's reference of the charge (the same for every call with the same key).

    Raises:
        TransientPaymentError: try again later.
        PaymentDeclined: permanent.
    """
    if card == "declined":
        raise PaymentDeclined(f"card declined for {amount_cents} cents ({idempotency_key})")
    match = _TRANSIENT_RE.match(card)
    if match and call <= int(match[1]):
        raise TransientPaymentError(
            f"gateway timeout on call {call} of {idempotency_key} (fails {match[1]} times)")
    return "ch_" + hashlib.sha256(idempotency_key.encode()).hexdigest()[:16]
