#!/usr/bin/env python
"""TicketFlow's reservations on Django, with pgbroker as Celery's broker: manage.py."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ticketsite.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
