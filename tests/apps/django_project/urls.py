"""The test project's URLs: pgbroker's operator page under /ops/pgbroker/."""

from django.urls import include, path

urlpatterns = [path("ops/pgbroker/", include("pgbroker.contrib.django.urls"))]
