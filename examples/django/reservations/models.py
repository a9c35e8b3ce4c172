"""A reservation holds seats until it expires or is confirmed; a charge and an e-mail follow."""

from django.db import models


class Reservation(models.Model):
    HELD, CONFIRMED, EXPIRED = "held", "confirmed", "expired"

    ref = models.CharField(max_length=40, unique=True)
    email = models.EmailField()
    amount_cents = models.PositiveIntegerField()
    status = models.CharField(max_length=10, default=HELD)
    expires_at = models.DateTimeField()


class Charge(models.Model):
    """One charge per reservation: the unique reference is the gateway's idempotency key."""

    reservation = models.OneToOneField(Reservation, on_delete=models.CASCADE)
    amount_cents = models.PositiveIntegerField()
    charged_at = models.DateTimeField(auto_now_add=True)


class SentEmail(models.Model):
    """The e-mails sent: a redelivered task finds its row and sends nothing twice."""

    ref = models.CharField(max_length=40)
    kind = models.CharField(max_length=20)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["ref", "kind"], name="one_email_per_kind")]
