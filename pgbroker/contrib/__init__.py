"""Integrations with other libraries that a user names: Django's app and user API (``django``:
``INSTALLED_APPS``). The connectors under a caller's connection are
:mod:`pgbroker._produce.connectors`."""
