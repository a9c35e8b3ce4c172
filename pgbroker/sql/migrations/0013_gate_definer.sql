-- 0013 a keyed insert gates its queue as the schema's owner.
--
-- jobs_gate_queue (0010) adds a queue to gated_queues when its first job with a concurrency key
-- arrives, in the inserting transaction; it ran with the inserting role's privileges, so every
-- role that publishes needed SELECT and INSERT on gated_queues -- and any producer credential
-- could gate any queue, or every queue at once ('' stands for "a rate limit exists"), moving
-- all claims to the costlier job_claim_gated. As SECURITY DEFINER (the role that ran this
-- migration: run `pgbroker migrate` as the schema's owner) with a fixed search_path, the
-- trigger needs no privilege of the producer's, and a producer can gate a queue only by
-- publishing a keyed job to it. The function's body is unchanged. A trigger function cannot be
-- called on its own.
--
-- Operational caveats: none (ALTER FUNCTION is a catalog change; no lock on jobs).

ALTER FUNCTION {schema}.jobs_gate_queue() SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
REVOKE ALL ON FUNCTION {schema}.jobs_gate_queue() FROM PUBLIC;
