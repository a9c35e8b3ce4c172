-- 0014 reserved: the number of the claim path's migration, made on another branch at the same
-- time as 0015 (issue 26). This file only keeps the versions 1..n on the branch that made 0015
-- (pgbroker.migrate.load refuses a gap). DELETE IT when the claim path's 0014 is merged: two
-- files numbered 0014 stop every import of pgbroker.migrate with "migrations are not numbered
-- 1..n" -- loudly, on purpose. Do not migrate a database you keep with this file in place: it
-- would record version 14 as applied, and the real 0014 would never run there.
--
-- Operational caveats: none; it changes nothing.

SELECT 1;
