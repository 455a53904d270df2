-- Back to the run of migration 2026-12-05-020000_floors_busy_once.
DROP FUNCTION idemstage_advance_floors(bigint, bigint, bigint, boolean);
DROP INDEX jobs_deferred_idx;
CREATE OR REPLACE FUNCTION idemstage_advance_floors(p_mark bigint, p_horizon_ms bigint,
                                                    p_raise_every_ms bigint)
RETURNS bigint
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
DECLARE
    v_mark bigint;
BEGIN
    -- One run at a time ("idemflor"); the others keep their mark.
    IF NOT pg_try_advisory_xact_lock(7594869008633097330) THEN
        RETURN p_mark;
    END IF;
    -- Read before the lanes: a number drawn after this read is above every
    -- floor the next run sets.
    SELECT s.last_value INTO v_mark FROM jobs_ready_seq s;
    -- Per lane: its first ready job due within the horizon (`first`), the
    -- floor it may rise to (`up`: never above the previous mark), and whether
    -- it is idle: no such job, and nothing of it leased now or finished within
    -- the window. A floor is lowered only when a ready job is below it (so that
    -- a run with an older mark, of another worker, does not pull floors down);
    -- raised at most every p_raise_every_ms, and only when the lane is not
    -- idle: a raise is a row version, and an idle lane has nothing new below
    -- its mark to skip. An idle lane is parked (the fetch skips it), a lane
    -- with a job due within the horizon woken.
    WITH busy AS MATERIALIZED (
        SELECT j.queue, j.tenant_id, j.priority FROM jobs j
         WHERE j.lease_expires_at IS NOT NULL
        UNION
        SELECT j.queue, j.tenant_id, j.priority FROM jobs j
         WHERE j.state IN ('completed', 'cancelled', 'failed')
           AND j.completed_at > now() - (p_raise_every_ms + p_horizon_ms) * interval '1 millisecond'
    ), lanes AS (
        SELECT f.queue, f.tenant_id, f.priority, f.first,
               CASE WHEN p_mark IS NOT NULL
                    THEN least(p_mark, coalesce(f.first, p_mark)) END AS up,
               (f.first IS NULL AND b.queue IS NULL) AS idle
          FROM (SELECT o.queue, o.tenant_id, o.priority,
                       (SELECT j.ready_seq FROM jobs j
                         WHERE j.queue = o.queue AND j.tenant_id = o.tenant_id
                           AND j.priority = o.priority
                           AND j.state IN ('created', 'retry')
                           AND j.start_after <= now() + p_horizon_ms * interval '1 millisecond'
                         ORDER BY j.ready_seq
                         LIMIT 1) AS first
                  FROM job_lanes o) f
          LEFT JOIN busy b
            ON b.queue = f.queue AND b.tenant_id = f.tenant_id AND b.priority = f.priority
    )
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
      FROM lanes n
     WHERE l.queue = n.queue AND l.tenant_id = n.tenant_id AND l.priority = n.priority
       AND (n.first < l.floor
            OR (NOT n.idle AND n.up > l.floor
                AND l.floor_at <= clock_timestamp() - p_raise_every_ms * interval '1 millisecond')
            OR l.parked <> n.idle);
    RETURN v_mark;
END;
$$;
