"""Integrations with other libraries: the connectors for their connections
(``sqlalchemy_connector``, ``django_connector``: see :mod:`pgbroker._connector`), imported only
for a connection of theirs, and Django's app and user API (``django``: ``INSTALLED_APPS``)."""
