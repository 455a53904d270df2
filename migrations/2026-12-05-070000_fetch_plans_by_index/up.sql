-- The fetch's plans read `jobs` by its indexes, whatever the statistics said
-- when they were made.
--
-- The fetch functions keep one generic plan per session
-- (`plan_cache_mode = force_generic_plan`), made on their first call. A worker
-- that starts on a new or emptied database makes it while `jobs` is (nearly)
-- empty and its statistics say so: a sequential scan is then the cheapest way
-- to a lane's first ready job, and the session kept that plan until the first
-- ANALYZE of the table invalidated it. Meanwhile every fetch read the whole
-- table, once per lane: in the pressure bench's idle_in_tx cell, p50 pickup
-- from 3 to 45 ms and p99 up to 252 ms over the first minute, gone at the
-- first autovacuum (auto_explain: a Seq Scan on jobs, 12,440 rows removed by
-- the filter, 37 ms, in idemstage_lane_heads). Every table these functions
-- read has an index for the read, so with sequential scans off the planner
-- takes it, at any size.

ALTER FUNCTION idemstage_fetch(text[], integer) SET enable_seqscan = off;
ALTER FUNCTION idemstage_fetch_queues(text[], integer) SET enable_seqscan = off;
ALTER FUNCTION idemstage_fetch_plain(text, integer) SET enable_seqscan = off;
ALTER FUNCTION idemstage_fetch_controlled(text, integer) SET enable_seqscan = off;
ALTER FUNCTION idemstage_advance_floors(bigint, bigint, bigint, boolean) SET enable_seqscan = off;
