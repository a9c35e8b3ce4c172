from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "tests.apps.django_project.shop"
    label = "shop"
