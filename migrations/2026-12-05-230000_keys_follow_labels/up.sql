-- A job's key row follows the job's labels. `job_singletons` names a key by
-- the job's queue, key, window and tenant as they were when it was sent; an
-- UPDATE of those on `jobs` (by hand: the library writes none of them) left
-- the row on the old key: the old key stayed taken by a job no longer of it,
-- and the new one was held by nothing, so a second live job of it could be
-- sent (the unique index on `jobs` before 2026-12-05-170000_job_singletons
-- refused that from any writer). Now the row is moved with the job (a unique
-- violation when the new key is another live job's: refused, nothing
-- changed), taken when a live job without one gets a key, and dropped when
-- the key is set to NULL. An ended job keeps what it had (none, or a windowed
-- key kept not live). The WHEN keeps it off every UPDATE that does not change
-- them, the hot path's included.
CREATE FUNCTION idemstage_jobs_key_follows_labels() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.singleton_key IS NULL THEN
        DELETE FROM public.job_singletons WHERE job_id = NEW.id;
        RETURN NULL;
    END IF;
    UPDATE public.job_singletons
       SET queue = NEW.queue, singleton_key = NEW.singleton_key,
           singleton_on = NEW.singleton_on, tenant_id = NEW.tenant_id
     WHERE job_id = NEW.id;
    IF NOT FOUND AND NEW.state IN ('created', 'retry')
       AND NOT EXISTS (SELECT 1 FROM public.job_closures z WHERE z.ready_seq = NEW.ready_seq) THEN
        INSERT INTO public.job_singletons (job_id, queue, singleton_key, singleton_on, tenant_id)
        VALUES (NEW.id, NEW.queue, NEW.singleton_key, NEW.singleton_on, NEW.tenant_id);
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER jobs_key_follows_labels
    AFTER UPDATE OF queue, singleton_key, singleton_on, tenant_id ON jobs
    FOR EACH ROW
    WHEN ((OLD.queue, OLD.singleton_key, OLD.singleton_on, OLD.tenant_id)
          IS DISTINCT FROM (NEW.queue, NEW.singleton_key, NEW.singleton_on, NEW.tenant_id))
    EXECUTE FUNCTION idemstage_jobs_key_follows_labels();
