-- Back to the trigger functions of migrations 2026-12-05-010000_parked_lanes
-- (the send's) and 2026-12-05-050000_jobs_after_triggers (a job ready again).
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
    UPDATE public.jobs SET ready_seq = pg_catalog.nextval('public.jobs_ready_seq')
     WHERE id = NEW.id;
    INSERT INTO public.job_lanes (queue, tenant_id, priority)
    VALUES (NEW.queue, NEW.tenant_id, NEW.priority)
    ON CONFLICT DO NOTHING;
    UPDATE public.job_lanes l SET parked = false
     WHERE l.queue = NEW.queue AND l.tenant_id = NEW.tenant_id
       AND l.priority = NEW.priority AND l.parked;
    RETURN NULL;
END;
$$;
