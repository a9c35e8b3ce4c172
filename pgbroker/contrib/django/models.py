"""pgbroker's Django models: none with a table. :class:`Operator` only carries the permission
``pgbroker.operate`` (act on the operator page) for Django's users and groups."""

from __future__ import annotations

from django.db import models


class Operator(models.Model):
    """Holder of ``pgbroker.operate``: staff users see the operator page, those with this
    permission may also act there (retry, discard, cancel, pause...). No table."""

    class Meta:
        managed = False
        default_permissions = ()
        permissions = [("operate", "Can act on pgbroker's operator page")]
