"""``manage.py pgbroker``: see :mod:`.pgbroker`."""
