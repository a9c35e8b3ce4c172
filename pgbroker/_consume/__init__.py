"""Claims, deliveries and acks: the consumer of one broker connection, its claim policy and
event-loop turn, the payloads handed to kombu, settling that is tried again, the lease."""
