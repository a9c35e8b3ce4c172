"""pgbroker's Django app: migrations, ``manage.py pgbroker``, system checks, ``atomic()``."""
