"""The management commands of pgbroker's Django app (``manage.py pgbroker ...``)."""
