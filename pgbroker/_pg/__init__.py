"""The database: the driver and its connections, libpq without blocking, the statement catalogue
of ``sql/*.sql``, the store that runs them, VACUUM's side of the hot tables."""
