"""Reservations that expire, are confirmed with an e-mail, and are paid for."""
