"""The example's URLs: one endpoint that confirms a reservation."""

from django.urls import path

from reservations.views import confirm_view

urlpatterns = [path("reservations/<str:ref>/confirm", confirm_view)]
