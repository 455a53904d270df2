-- Idle lanes parked (issue 31; docs/storage-under-pressure.md).
--
-- The fetch reads every lane of its queue (`idemstage_lane_heads`: one probe
-- of the ready index per lane) on every call. A queue of many tenants of which
-- few have work paid for all of them: 1,000 lanes cost a fetch ~1 ms against
-- ~0.24 ms for one. The run of the floors now parks a lane that has no ready
-- job due within the horizon and was not worked lately (the same test that
-- keeps it from raising an idle lane's floor), and the fetch reads only the
-- lanes not parked.
--
-- A lane is woken by whatever makes a job of it ready: a send (the statement
-- trigger, one UPDATE for the statement's lanes, writing only a parked one), a
-- job ready again (retried, deferred, given back, retried by an operator: the
-- row trigger), and the run of the floors itself, which wakes a lane once it
-- has a ready job due within the horizon (a job scheduled ahead, or one whose
-- send raced the run that parked its lane: the send's UPDATE did not see the
-- lane parked yet, so the job waits for the next run, as a job below its floor
-- does). Parking and waking are row versions of the lane, one per idle spell;
-- the floors' raises stay HOT (`parked` is in the partial index's predicate,
-- `floor` in no index).
ALTER TABLE job_lanes ADD COLUMN parked boolean NOT NULL DEFAULT false;
CREATE INDEX job_lanes_awake_idx ON job_lanes (queue) WHERE NOT parked;

CREATE OR REPLACE FUNCTION idemstage_jobs_lanes() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.job_lanes (queue, tenant_id, priority)
    SELECT DISTINCT n.queue, n.tenant_id, n.priority FROM sent_jobs n
     ORDER BY 1, 2, 3
    ON CONFLICT DO NOTHING;
    -- A plain UPDATE, not ON CONFLICT DO UPDATE: that locks the lane's row for
    -- every send, this writes (and locks) only a parked one.
    UPDATE public.job_lanes l SET parked = false
      FROM (SELECT DISTINCT n.queue, n.tenant_id, n.priority FROM sent_jobs n) s
     WHERE l.queue = s.queue AND l.tenant_id = s.tenant_id AND l.priority = s.priority
       AND l.parked;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION idemstage_jobs_ready_again() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.ready_seq := pg_catalog.nextval('public.jobs_ready_seq');
    INSERT INTO public.job_lanes (queue, tenant_id, priority)
    VALUES (NEW.queue, NEW.tenant_id, NEW.priority)
    ON CONFLICT DO NOTHING;
    UPDATE public.job_lanes l SET parked = false
     WHERE l.queue = NEW.queue AND l.tenant_id = NEW.tenant_id
       AND l.priority = NEW.priority AND l.parked;
    RETURN NEW;
END;
$$;

CREATE OR REPLACE FUNCTION idemstage_lane_heads(v_queue text)
RETURNS TABLE (tenant_id text, priority integer, floor bigint, head bigint)
LANGUAGE sql STABLE AS $$
    SELECT l.tenant_id, l.priority, l.floor, h.ready_seq
      FROM public.job_lanes l
      CROSS JOIN LATERAL (
          SELECT j.ready_seq FROM public.jobs j
           WHERE j.queue = v_queue AND j.tenant_id = l.tenant_id AND j.priority = l.priority
             AND j.state IN ('created', 'retry') AND j.ready_seq >= l.floor
             AND j.start_after <= now()
           ORDER BY j.ready_seq
           LIMIT 1) h
     WHERE l.queue = v_queue AND NOT l.parked
$$;

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
    WITH busy AS (
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
               (f.first IS NULL
                AND NOT EXISTS (SELECT 1 FROM busy b
                                 WHERE b.queue = f.queue AND b.tenant_id = f.tenant_id
                                   AND b.priority = f.priority)) AS idle
          FROM (SELECT o.queue, o.tenant_id, o.priority,
                       (SELECT j.ready_seq FROM jobs j
                         WHERE j.queue = o.queue AND j.tenant_id = o.tenant_id
                           AND j.priority = o.priority
                           AND j.state IN ('created', 'retry')
                           AND j.start_after <= now() + p_horizon_ms * interval '1 millisecond'
                         ORDER BY j.ready_seq
                         LIMIT 1) AS first
                  FROM job_lanes o) f
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

-- Whoever sends or readies a job wakes its lane (under the same row-level
-- security as the lane's insert: a tenant scope reaches its own lanes only);
-- the worker (the floors' run) parks.
GRANT UPDATE (parked) ON job_lanes TO idemstage_app, idemstage_worker, idemstage_operator;
