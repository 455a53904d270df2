-- Back to the BEFORE ROW triggers of migrations 2026-11-30-000000_baseline and
-- 2026-12-05-010000_parked_lanes.
DROP TRIGGER jobs_check_labels_on_update ON jobs;
DROP TRIGGER jobs_check_labels ON jobs;
CREATE TRIGGER jobs_check_labels
    BEFORE INSERT OR UPDATE OF queue, payload, singleton_key, tenant_id ON jobs
    FOR EACH ROW EXECUTE FUNCTION idemstage_jobs_check_labels();

DROP TRIGGER jobs_ready_again ON jobs;

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

CREATE TRIGGER jobs_ready_again
    BEFORE UPDATE OF state, queue, tenant_id, priority ON jobs
    FOR EACH ROW
    WHEN (NEW.state IN ('created', 'retry')
          AND (OLD.state NOT IN ('created', 'retry')
               OR (NEW.queue, NEW.tenant_id, NEW.priority)
                  IS DISTINCT FROM (OLD.queue, OLD.tenant_id, OLD.priority)))
    EXECUTE FUNCTION idemstage_jobs_ready_again();
