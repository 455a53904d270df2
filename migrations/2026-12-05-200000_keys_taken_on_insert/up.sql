-- A job's singleton key is taken by `jobs`' own insert trigger, for every
-- writer, not by the library's send statement (2026-12-05-170000_job_singletons
-- inserted the key's row in the send): a job row written by hand (a team's
-- script) took no key, so a second live job of a key could be written beside
-- the library's, which the index on `jobs` had refused from any writer. The
-- trigger inserts the key's row first; when a rule refuses it (a live job of
-- the key, or one in its window), the job's row is not inserted (the BEFORE
-- trigger returns NULL): the library's send sees no row back, `Duplicate`,
-- as before; a hand's INSERT inserts nothing. It fires only for a job with a
-- key (its WHEN), after the labels' check (triggers fire by name), so a
-- squatter is refused before it takes anything.
CREATE FUNCTION idemstage_jobs_take_key() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.job_singletons (job_id, queue, singleton_key, singleton_on, tenant_id)
    VALUES (NEW.id, NEW.queue, NEW.singleton_key, NEW.singleton_on, NEW.tenant_id)
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER jobs_take_key
    BEFORE INSERT ON jobs
    FOR EACH ROW
    WHEN (NEW.singleton_key IS NOT NULL)
    EXECUTE FUNCTION idemstage_jobs_take_key();

-- In the tenant scope a key row may be set not live (a completion's release)
-- and locked (start_in's repoint), not renamed: the stage-key check of
-- 2026-12-05-170000 is an INSERT policy, and an UPDATE of `singleton_key`
-- or `queue` could have turned a scoped row into another tenant's stage key.
REVOKE UPDATE ON job_singletons FROM idemstage_app;
GRANT UPDATE (live) ON job_singletons TO idemstage_app;
