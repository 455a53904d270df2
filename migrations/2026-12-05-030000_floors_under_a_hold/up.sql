-- The floors' run under a held snapshot (issue 31).
--
-- Measured in the idle_in_tx cell (BENCHMARKS.md, "2026-12-05"): one run took
-- 6 ms at the start of a 4-minute hold and 158 ms at its end, reading ~290,000
-- buffers, once a second; and while it ran, the sends into the lanes it had
-- written waited for it (a send's lane insert checks the lane's key). Two
-- reads grew with the hold:
--
-- - `busy` read every lease of every lane: the index of leased jobs keeps an
--   entry for each version that had a lease, and the held snapshot keeps them
--   all. Now a lane is asked for a lease only when it has no ready job and
--   nothing finished within the window (a lane being worked has both), and
--   from its latest lease deadline back, where a lease still held is found
--   after the jobs leased since it, not after every one since the hold.
-- - `first` walked each lane from its start, past every entry leased since the
--   hold began, to find a ready job below the floor. A job is below its floor
--   for one of two reasons: it was not due within the horizon when the floor
--   passed it (deferred: scheduled, retried, given back, moved by hand), or
--   its sending transaction outlived a run. The first kind is found every run
--   by `jobs_deferred_idx`, which holds only jobs that were not due when they
--   were sent or made ready again; the second by a walk from the lane's start
--   on every run that asks for it (`p_walk_below`; the library asks every
--   30th run, the first run of a process, and the old three-argument form
--   always). Every other run reads each lane from its floor.
--
-- The lanes are read into arrays first and written after, so a run holds the
-- lanes' rows for the UPDATE alone, not for the reads.

-- A job not due when it became ready (a send with a delay, a retry, a job
-- given back or deferred): `start_after` is after `created_at`, which a plain
-- send's `now()` is not.
CREATE INDEX jobs_deferred_idx ON jobs (queue, tenant_id, priority, start_after, ready_seq)
    WHERE state IN ('created', 'retry') AND start_after > created_at;

CREATE FUNCTION idemstage_advance_floors(p_mark bigint, p_horizon_ms bigint,
                                         p_raise_every_ms bigint, p_walk_below boolean)
RETURNS bigint
LANGUAGE plpgsql SET search_path = public, pg_temp SET jit = off AS $$
DECLARE
    v_mark bigint;
    v_queues text[];
    v_tenants text[];
    v_priorities integer[];
    v_firsts bigint[];
    v_idle boolean[];
    v_due timestamptz := now() + p_horizon_ms * interval '1 millisecond';
BEGIN
    -- One run at a time ("idemflor"); the others keep their mark.
    IF NOT pg_try_advisory_xact_lock(7594869008633097330) THEN
        RETURN p_mark;
    END IF;
    -- Read before the lanes: a number drawn after this read is above every
    -- floor the next run sets.
    SELECT s.last_value INTO v_mark FROM jobs_ready_seq s;
    -- Per lane: its first ready job due within the horizon (`first`: below
    -- the floor if one is there, else from the floor on), and whether it is
    -- idle (no such job, nothing of it finished within the window).
    WITH busy AS MATERIALIZED (
        SELECT DISTINCT j.queue, j.tenant_id, j.priority FROM jobs j
         WHERE j.state IN ('completed', 'cancelled', 'failed')
           AND j.completed_at > now() - (p_raise_every_ms + p_horizon_ms) * interval '1 millisecond'
    ), f AS (
        SELECT o.queue, o.tenant_id, o.priority,
               coalesce(
                   CASE WHEN p_walk_below THEN
                       (SELECT j.ready_seq FROM jobs j
                         WHERE j.queue = o.queue AND j.tenant_id = o.tenant_id
                           AND j.priority = o.priority
                           AND j.state IN ('created', 'retry')
                           AND j.ready_seq < o.floor AND j.start_after <= v_due
                         ORDER BY j.ready_seq
                         LIMIT 1)
                   ELSE
                       (SELECT min(j.ready_seq) FROM jobs j
                         WHERE j.queue = o.queue AND j.tenant_id = o.tenant_id
                           AND j.priority = o.priority
                           AND j.state IN ('created', 'retry')
                           AND j.start_after > j.created_at
                           AND j.start_after <= v_due AND j.ready_seq < o.floor)
                   END,
                   (SELECT j.ready_seq FROM jobs j
                     WHERE j.queue = o.queue AND j.tenant_id = o.tenant_id
                       AND j.priority = o.priority
                       AND j.state IN ('created', 'retry')
                       AND j.ready_seq >= o.floor AND j.start_after <= v_due
                     ORDER BY j.ready_seq
                     LIMIT 1)) AS first
          FROM job_lanes o
    )
    SELECT array_agg(f.queue), array_agg(f.tenant_id), array_agg(f.priority),
           array_agg(f.first),
           array_agg(CASE WHEN f.first IS NOT NULL OR b.queue IS NOT NULL THEN false
                          ELSE NOT EXISTS (
                              SELECT 1 FROM jobs j
                               WHERE j.queue = f.queue AND j.tenant_id = f.tenant_id
                                 AND j.lease_expires_at IS NOT NULL
                                 AND j.priority = f.priority
                               ORDER BY j.lease_expires_at DESC
                               LIMIT 1)
                     END)
      INTO v_queues, v_tenants, v_priorities, v_firsts, v_idle
      FROM f
      LEFT JOIN busy b
        ON b.queue = f.queue AND b.tenant_id = f.tenant_id AND b.priority = f.priority;
    -- A floor is lowered only when a ready job is below it (so that a run with
    -- an older mark, of another worker, does not pull floors down); raised at
    -- most every p_raise_every_ms, never above the previous mark, and only
    -- when the lane is not idle: a raise is a row version, and an idle lane has
    -- nothing new below its mark to skip. An idle lane is parked (the fetch
    -- skips it), a lane with a job due within the horizon woken.
    UPDATE job_lanes l
       SET floor = CASE WHEN n.first < l.floor THEN n.first
                        WHEN NOT n.idle AND n.up > l.floor
                             AND l.floor_at <= clock_timestamp() - p_raise_every_ms * interval '1 millisecond'
                        THEN n.up
                        ELSE l.floor END,
           floor_at = CASE WHEN NOT n.idle AND n.up > l.floor
                             AND NOT coalesce(n.first < l.floor, false)
                             AND l.floor_at <= clock_timestamp() - p_raise_every_ms * interval '1 millisecond'
                           THEN clock_timestamp()
                           ELSE l.floor_at END,
           parked = n.idle
      FROM (SELECT u.queue, u.tenant_id, u.priority, u.first, u.idle,
                   CASE WHEN p_mark IS NOT NULL
                        THEN least(p_mark, coalesce(u.first, p_mark)) END AS up
              FROM unnest(v_queues, v_tenants, v_priorities, v_firsts, v_idle)
                   AS u(queue, tenant_id, priority, first, idle)) n
     WHERE l.queue = n.queue AND l.tenant_id = n.tenant_id AND l.priority = n.priority
       AND (n.first < l.floor
            OR (NOT n.idle AND n.up > l.floor
                AND l.floor_at <= clock_timestamp() - p_raise_every_ms * interval '1 millisecond')
            OR l.parked <> n.idle);
    RETURN v_mark;
END;
$$;

-- The form of the earlier migrations, for a process built before this one:
-- every run of it walks below the floors, as its runs did.
CREATE OR REPLACE FUNCTION idemstage_advance_floors(p_mark bigint, p_horizon_ms bigint,
                                                    p_raise_every_ms bigint)
RETURNS bigint
LANGUAGE sql SET search_path = public, pg_temp AS $$
    SELECT idemstage_advance_floors(p_mark, p_horizon_ms, p_raise_every_ms, true)
$$;
