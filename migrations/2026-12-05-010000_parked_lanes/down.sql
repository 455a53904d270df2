-- Back to the lanes without parking (migration 2026-12-04-000000_ready_floors).

CREATE OR REPLACE FUNCTION idemstage_jobs_lanes() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.job_lanes (queue, tenant_id, priority)
    SELECT DISTINCT n.queue, n.tenant_id, n.priority FROM sent_jobs n
     ORDER BY 1, 2, 3
    ON CONFLICT DO NOTHING;
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
     WHERE l.queue = v_queue
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
    -- Per lane: its first ready job due within the horizon (`first`), and the
    -- floor it may rise to (`up`: never above the previous mark). Lowered only
    -- when a ready job is below it (so that a run with an older mark, of another
    -- worker, does not pull floors down); raised at most every p_raise_every_ms,
    -- and only when the lane has a ready job or was worked lately (`busy`: a job
    -- leased now or finished within the window): a raise is a row version, and
    -- an idle lane has nothing new below its mark to skip.
    WITH busy AS (
        SELECT j.queue, j.tenant_id, j.priority FROM jobs j
         WHERE j.lease_expires_at IS NOT NULL
        UNION
        SELECT j.queue, j.tenant_id, j.priority FROM jobs j
         WHERE j.state IN ('completed', 'cancelled', 'failed')
           AND j.completed_at > now() - (p_raise_every_ms + p_horizon_ms) * interval '1 millisecond'
    )
    UPDATE job_lanes l
       SET floor = CASE WHEN n.first < l.floor THEN n.first ELSE n.up END,
           floor_at = CASE WHEN n.first < l.floor THEN l.floor_at ELSE clock_timestamp() END
      FROM (SELECT f.queue, f.tenant_id, f.priority, f.first,
                   CASE WHEN p_mark IS NOT NULL
                        THEN least(p_mark, coalesce(f.first, p_mark)) END AS up
              FROM (SELECT o.queue, o.tenant_id, o.priority,
                           (SELECT j.ready_seq FROM jobs j
                             WHERE j.queue = o.queue AND j.tenant_id = o.tenant_id
                               AND j.priority = o.priority
                               AND j.state IN ('created', 'retry')
                               AND j.start_after <= now() + p_horizon_ms * interval '1 millisecond'
                             ORDER BY j.ready_seq
                             LIMIT 1) AS first
                      FROM job_lanes o) f) n
     WHERE l.queue = n.queue AND l.tenant_id = n.tenant_id AND l.priority = n.priority
       AND (n.first < l.floor
            OR (n.up > l.floor
                AND l.floor_at <= clock_timestamp() - p_raise_every_ms * interval '1 millisecond'
                AND (n.first IS NOT NULL
                     OR EXISTS (SELECT 1 FROM busy b
                                 WHERE b.queue = l.queue AND b.tenant_id = l.tenant_id
                                   AND b.priority = l.priority))));
    RETURN v_mark;
END;
$$;

DROP INDEX job_lanes_awake_idx;
ALTER TABLE job_lanes DROP COLUMN parked;
