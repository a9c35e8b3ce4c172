"""A published message becomes a job: kombu's publish, ``enqueue``'s protocol-2 messages, the
writes on a caller's connection inside ``transaction()``, the connectors, durable revokes."""
