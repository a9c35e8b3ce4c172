"""The operator page's URLs: ``path("ops/pgbroker/", include("pgbroker.contrib.django.urls"))``
(see :mod:`pgbroker.contrib.django.operator`)."""

from __future__ import annotations

from django.urls import path, re_path

from .operator import operator_page

app_name = "pgbroker"
urlpatterns = [
    path("", operator_page, name="operator"),
    re_path(r"^(?P<path>.+)$", operator_page),
]
