-- 0016 reserved: this number belongs to a migration of another branch of issue 27 (0016: each
-- consumer's own lease). load() wants the migrations numbered 1..n, so that 0017 loads on this
-- branch alone; delete this file when that branch's 0016 is merged beside it (two files of one
-- number make load() refuse to start, loudly).
--
-- Operational caveats: none; it changes nothing.

SELECT 1;
