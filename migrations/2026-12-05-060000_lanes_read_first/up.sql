-- A send, or a job ready again, reads its lane before it inserts it.
--
-- `INSERT ... ON CONFLICT DO NOTHING` checks the key against the newest version
-- of the lane's row, and when a transaction that has not committed yet wrote
-- that row, it waits for that transaction. The floors' run writes the lanes it
-- raises (every busy lane, every other run) and parks: each send into such a
-- lane waited for the run's commit. A lane is never deleted, so one this
-- transaction's snapshot sees exists at its commit too: it is inserted only
-- when it is not seen, and the insert waits only for a transaction that is
-- creating the same lane.
--
-- The wake (`parked = false`) is unchanged: it writes the row only when this
-- snapshot sees the lane parked. A lane that a run parks while the send is
-- open is woken by the next run, the same as a send whose transaction began
-- before the run (isolation spec `send_vs_park`).

CREATE OR REPLACE FUNCTION idemstage_jobs_lanes() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.job_lanes (queue, tenant_id, priority)
    SELECT DISTINCT n.queue, n.tenant_id, n.priority FROM sent_jobs n
     WHERE NOT EXISTS (SELECT 1 FROM public.job_lanes l
                        WHERE l.queue = n.queue AND l.tenant_id = n.tenant_id
                          AND l.priority = n.priority)
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
    IF NOT EXISTS (SELECT 1 FROM public.job_lanes l
                    WHERE l.queue = NEW.queue AND l.tenant_id = NEW.tenant_id
                      AND l.priority = NEW.priority) THEN
        INSERT INTO public.job_lanes (queue, tenant_id, priority)
        VALUES (NEW.queue, NEW.tenant_id, NEW.priority)
        ON CONFLICT DO NOTHING;
    END IF;
    UPDATE public.job_lanes l SET parked = false
     WHERE l.queue = NEW.queue AND l.tenant_id = NEW.tenant_id
       AND l.priority = NEW.priority AND l.parked;
    RETURN NULL;
END;
$$;
