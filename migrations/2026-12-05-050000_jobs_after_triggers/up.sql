-- No BEFORE ROW trigger on the UPDATEs of `jobs`.
--
-- A table with a BEFORE ROW UPDATE trigger pays for it on every row an UPDATE
-- writes, whether the trigger fires or not: the executor fetches and locks the
-- old row for the trigger before it looks at the trigger's columns or its WHEN.
-- Every lease, renewal and completion is such an UPDATE, and `jobs` had two of
-- them (the labels' check, which fires only when a label is written, and the
-- ready-again sequence number, which fires only when a job becomes ready
-- again). Measured: the same UPDATE of 100,000 rows 13-15 % slower with them,
-- 6 % with AFTER triggers that do not fire; the raw drain loops of
-- `idemstage bench queue` (fetch and completion, nothing else) 19 % faster
-- without them (BENCHMARKS.md).
--
-- * The labels' check runs BEFORE INSERT (where it costs no fetch of an old
--   row) and AFTER an UPDATE of a label: it only raises, so it needs no NEW to
--   change.
-- * A job ready again draws its sequence number AFTER its UPDATE, with an
--   UPDATE of its own: a second row version, on the rare paths only (a retry, a
--   deferral, a job given back or taken back, an operator's retry), in the
--   same transaction, so that no reader sees the job ready with its old number.
--   That UPDATE writes neither the state nor a label, so it fires neither
--   trigger again.

DROP TRIGGER jobs_check_labels ON jobs;
CREATE TRIGGER jobs_check_labels
    BEFORE INSERT ON jobs
    FOR EACH ROW EXECUTE FUNCTION idemstage_jobs_check_labels();
CREATE TRIGGER jobs_check_labels_on_update
    AFTER UPDATE OF queue, payload, singleton_key, tenant_id ON jobs
    FOR EACH ROW EXECUTE FUNCTION idemstage_jobs_check_labels();

DROP TRIGGER jobs_ready_again ON jobs;

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

CREATE TRIGGER jobs_ready_again
    AFTER UPDATE OF state, queue, tenant_id, priority ON jobs
    FOR EACH ROW
    WHEN (NEW.state IN ('created', 'retry')
          AND (OLD.state NOT IN ('created', 'retry')
               OR (NEW.queue, NEW.tenant_id, NEW.priority)
                  IS DISTINCT FROM (OLD.queue, OLD.tenant_id, OLD.priority)))
    EXECUTE FUNCTION idemstage_jobs_ready_again();
