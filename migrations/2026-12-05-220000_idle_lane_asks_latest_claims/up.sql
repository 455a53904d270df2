-- A lane with no ready job due and nothing finished within the window is
-- asked for an open claim (one still leased keeps it awake), from its latest
-- deadline back. A completion writes a closure and leaves its claim as it
-- was, so every claim of the lane whose deadline is still ahead (a lease's
-- length of them: 15 minutes at the default) was read and found closed, on
-- every run while the lane stayed idle: 300 ms a run on 272,000 such claims
-- in 16 lanes, so about a second's work for a lane that went idle after
-- 200 jobs/s, each second for fifteen minutes. Now the run asks its 64 latest
-- deadlines only. A lane parked with a lease still open further back loses
-- nothing: the job ends by a closure, or is made ready again (a retry, a give
-- back, an expiry: the ready-again trigger draws a new number and wakes the
-- lane), and a parked lane has no ready job for the fetch to skip.
CREATE OR REPLACE FUNCTION idemstage_advance_floors(p_mark bigint, p_horizon_ms bigint, p_raise_every_ms bigint, p_walk_below boolean)
 RETURNS bigint
 LANGUAGE plpgsql
 SET search_path TO 'public', 'pg_temp'
 SET jit TO 'off'
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    v_mark bigint;
    v_queues text[];
    v_tenants text[];
    v_priorities integer[];
    v_firsts bigint[];
    v_idle boolean[];
    v_due timestamptz := now() + p_horizon_ms * interval '1 millisecond';
    v_expired_to timestamptz;
    v_walk_from bigint;
    v_sample_mark bigint;
    v_sample_senders text[];
    v_settled boolean := false;
BEGIN
    -- One run at a time ("idemflor"); the others keep their mark.
    IF NOT pg_try_advisory_xact_lock(7594869008633097330) THEN
        RETURN p_mark;
    END IF;
    -- Read before the lanes: a number drawn after this read is above every
    -- floor the next run sets.
    SELECT s.last_value INTO v_mark FROM jobs_ready_seq s;
    SELECT m.expired_to INTO v_expired_to FROM job_expiry_mark m;
    -- A walk's lower bound, and whether the last sample settled: checked
    -- before the walk's statement takes its snapshot, which then sees every
    -- number up to the sample's value.
    IF p_walk_below THEN
        SELECT w.walked_from, w.sample_mark, w.sample_senders
          INTO v_walk_from, v_sample_mark, v_sample_senders
          FROM job_walk_mark w;
        v_settled := v_sample_mark IS NOT NULL
            AND current_setting('transaction_isolation') = 'read committed'
            AND NOT EXISTS (
                SELECT 1 FROM pg_locks l
                 WHERE l.locktype = 'relation'
                   AND l.database = (SELECT d.oid FROM pg_database d
                                      WHERE d.datname = current_database())
                   AND l.relation = 'public.jobs'::regclass
                   AND l.virtualtransaction = ANY (v_sample_senders));
    END IF;
    v_walk_from := coalesce(v_walk_from, -9223372036854775808);
    -- Per lane: its first ready job due within the horizon (`first`: below
    -- the floor if one is there, else from the floor on), and whether it is
    -- idle (no such job, nothing of it finished within the window).
    WITH busy AS MATERIALIZED (
        SELECT DISTINCT j.queue, j.tenant_id, j.priority FROM jobs j
         WHERE j.state IN ('completed', 'cancelled', 'failed')
           AND j.completed_at > now() - (p_raise_every_ms + p_horizon_ms) * interval '1 millisecond'
        UNION
        -- A job of a queue completed by its closure alone.
        SELECT z.queue, z.tenant_id, z.priority FROM job_closures z
         WHERE z.closed_at > now() - (p_raise_every_ms + p_horizon_ms) * interval '1 millisecond'
    ), f AS (
        SELECT o.queue, o.tenant_id, o.priority,
               coalesce(
                   CASE WHEN p_walk_below THEN
                       (SELECT j.ready_seq FROM jobs j
                         WHERE j.queue = o.queue AND j.tenant_id = o.tenant_id
                           AND j.priority = o.priority
                           AND j.state IN ('created', 'retry')
                           AND (SELECT 1 FROM job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL
                           AND j.ready_seq >= v_walk_from
                           AND j.ready_seq < o.floor AND j.start_after <= v_due
                         ORDER BY j.ready_seq
                         LIMIT 1)
                   ELSE
                       (SELECT min(j.ready_seq + 0) FROM jobs j
                         WHERE j.queue = o.queue AND j.tenant_id = o.tenant_id
                           AND j.priority = o.priority
                           AND j.state IN ('created', 'retry')
                           AND (SELECT 1 FROM job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL
                           AND j.start_after > j.created_at
                           AND j.start_after <= v_due AND j.ready_seq < o.floor)
                   END,
                   (SELECT j.ready_seq FROM jobs j
                     WHERE j.queue = o.queue AND j.tenant_id = o.tenant_id
                       AND j.priority = o.priority
                       AND j.state IN ('created', 'retry')
                       AND (SELECT 1 FROM job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL
                       AND j.ready_seq >= o.floor AND j.start_after <= v_due
                     ORDER BY j.ready_seq
                     LIMIT 1)) AS first
          FROM job_lanes o
    )
    SELECT array_agg(f.queue), array_agg(f.tenant_id), array_agg(f.priority),
           array_agg(f.first),
           array_agg(CASE WHEN f.first IS NOT NULL OR b.queue IS NOT NULL THEN false
                          ELSE (SELECT c.lease_expires_at
                             FROM (SELECT k.lease_expires_at, k.job_id, k.ready_seq
                                     FROM job_claims k
                                    WHERE k.queue = f.queue AND k.tenant_id = f.tenant_id
                                      AND k.lease_expires_at >= v_expired_to
                                      AND k.priority = f.priority
                                    ORDER BY k.lease_expires_at DESC
                                    LIMIT 64) c
                            WHERE (SELECT o.ready_seq FROM jobs o
                                    WHERE o.id = c.job_id
                                      AND o.state IN ('created', 'retry')) = c.ready_seq
                              AND (SELECT 1 FROM job_closures z WHERE z.ready_seq = c.ready_seq) IS NULL
                            LIMIT 1) IS NULL
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
    -- The walk saw every number up to a settled sample's value: the next one
    -- starts there. A new sample: this run's mark, then the transactions now
    -- holding a write lock on jobs (a sender that drew a number up to the mark
    -- and has not ended is one of them).
    IF p_walk_below THEN
        INSERT INTO job_walk_mark AS w (walked_from, sample_mark, sample_senders)
        SELECT CASE WHEN v_settled THEN v_sample_mark END, v_mark,
               coalesce(array_agg(DISTINCT l.virtualtransaction), ARRAY[]::text[])
          FROM pg_locks l
         WHERE l.locktype = 'relation'
           AND l.database = (SELECT d.oid FROM pg_database d
                              WHERE d.datname = current_database())
           AND l.relation = 'public.jobs'::regclass
           AND l.mode = 'RowExclusiveLock' AND l.granted
        ON CONFLICT (only_row) DO UPDATE
           SET walked_from = CASE WHEN v_settled THEN v_sample_mark ELSE w.walked_from END,
               sample_mark = CASE WHEN v_settled OR w.sample_mark IS NULL
                                  THEN excluded.sample_mark ELSE w.sample_mark END,
               sample_senders = CASE WHEN v_settled OR w.sample_mark IS NULL
                                     THEN excluded.sample_senders ELSE w.sample_senders END;
    END IF;
    RETURN v_mark;
END;
$function$;
