"""The Django migrations of pgbroker's Django app: one, which runs pgbroker's own."""
