-- A fetch walks a lane from its head, not from its floor (issue 31).
--
-- Since the claims (2026-12-05-090000_job_claims), a claimed job stays
-- `created` or `retry` until its attempt ends, so its ready entry stays live
-- and every walk from the floor passes every claim in flight, probing each.
-- The fetch functions walked a lane twice: `idemstage_lane_heads` to its head
-- (the first ready entry without a claim), then their own walk from the floor
-- again. The lanes' walk start (the column `floor`, which the functions pass
-- to their walks) is now that head: at the heads' snapshot every ready entry
-- below it had a claim, and a claimed entry is never ready again under the
-- same `ready_seq` (an end writes the job's row; ready again draws a new
-- number). A job sent with a lower `ready_seq` and committed after that
-- snapshot is found by the next fetch, whose heads start at the floor again.
-- Measured with pgbench on the drain's statements (BENCHMARKS.md
-- "2026-12-05 03:30"): two fetch-and-complete loops over 100,000 jobs from
-- 244-270 to 278-285 fetches/s (300 before the claims).
CREATE OR REPLACE FUNCTION idemstage_lane_heads(v_queue text) RETURNS TABLE(tenant_id text, priority integer, floor bigint, head bigint)
    LANGUAGE sql STABLE
    AS $$
    SELECT l.tenant_id, l.priority, h.ready_seq AS floor, h.ready_seq AS head
      FROM public.job_lanes l
      CROSS JOIN LATERAL (
          SELECT j.ready_seq FROM public.jobs j
           WHERE j.queue = v_queue AND j.tenant_id = l.tenant_id AND j.priority = l.priority
             AND j.state IN ('created', 'retry') AND j.ready_seq >= l.floor
             AND j.start_after <= now()
             AND (SELECT 1 FROM public.job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL
           ORDER BY j.ready_seq
           LIMIT 1) h
     WHERE l.queue = v_queue AND NOT l.parked
$$;
