CREATE TABLE job_singletons (
    job_id text PRIMARY KEY,
    queue text NOT NULL,
    singleton_key text NOT NULL,
    singleton_on timestamptz,
    live boolean NOT NULL DEFAULT true,
    tenant_id text NOT NULL
) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
CREATE UNIQUE INDEX job_singletons_live_uq ON job_singletons (queue, singleton_key)
    WHERE live;
CREATE UNIQUE INDEX job_singletons_window_uq
    ON job_singletons (queue, singleton_key, singleton_on)
    WHERE singleton_on IS NOT NULL;

INSERT INTO job_singletons (job_id, queue, singleton_key, singleton_on, live, tenant_id)
SELECT coalesce(k.job_id, w.job_id), coalesce(k.queue, w.queue),
       coalesce(k.singleton_key, w.singleton_key), w.singleton_on, k.job_id IS NOT NULL,
       coalesce(k.tenant_id, w.tenant_id)
  FROM (SELECT * FROM job_keys WHERE live) k
  FULL JOIN job_windows w ON w.job_id = k.job_id;

CREATE OR REPLACE FUNCTION idemstage_jobs_take_key() RETURNS trigger
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

CREATE OR REPLACE FUNCTION idemstage_jobs_key_follows_state() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state IN ('created', 'retry') THEN
        INSERT INTO public.job_singletons (job_id, queue, singleton_key, singleton_on,
                                           tenant_id)
        VALUES (NEW.id, NEW.queue, NEW.singleton_key, NEW.singleton_on, NEW.tenant_id)
        ON CONFLICT (job_id) DO UPDATE SET live = true;
    ELSIF NEW.singleton_on IS NULL THEN
        DELETE FROM public.job_singletons WHERE job_id = NEW.id;
    ELSE
        UPDATE public.job_singletons SET live = false WHERE job_id = NEW.id AND live;
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION idemstage_jobs_key_follows_labels() RETURNS trigger
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

CREATE OR REPLACE FUNCTION idemstage_jobs_release_keys() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM public.job_singletons g
     WHERE g.job_id = ANY(ARRAY(SELECT d.id FROM deleted d));
    RETURN NULL;
END;
$$;

DROP FUNCTION idemstage_take_key_or_raise(text, text, text, text);
DROP FUNCTION idemstage_take_key(text, text, text, text);
DROP TABLE job_keys;
DROP TABLE job_windows;

ALTER TABLE job_singletons ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON job_singletons TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY stage_key_of_own_tenant ON job_singletons AS RESTRICTIVE FOR INSERT
    TO idemstage_app
    WITH CHECK (
        NOT (left(singleton_key, length(queue) + 1) = queue || ':'
             AND substr(singleton_key, length(queue) + 2)
                 ~ '^[a-z0-9][a-z0-9_-]*:[0-7][0-9A-HJKMNP-TV-Z]*$'
             AND length(split_part(substr(singleton_key, length(queue) + 2), ':', 1)) <= 63
             AND length(split_part(substr(singleton_key, length(queue) + 2), ':', 2)) = 26)
        OR split_part(substr(singleton_key, length(queue) + 2), ':', 1) = tenant_id);
CREATE POLICY queue_work ON job_singletons TO idemstage_worker, idemstage_operator
    USING (true) WITH CHECK (true);
GRANT SELECT, INSERT, DELETE ON job_singletons TO idemstage_app;
GRANT UPDATE (live) ON job_singletons TO idemstage_app;
GRANT SELECT, INSERT, UPDATE, DELETE ON job_singletons TO idemstage_worker, idemstage_operator;
