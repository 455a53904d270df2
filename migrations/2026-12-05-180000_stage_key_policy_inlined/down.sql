CREATE FUNCTION idemstage_stage_key_tenant(p_queue text, p_key text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path TO 'pg_catalog', 'pg_temp'
AS $$
    SELECT CASE
        WHEN left(p_key, length(p_queue) + 1) = p_queue || ':'
         AND substr(p_key, length(p_queue) + 2) ~ '^[a-z0-9][a-z0-9_-]*:[0-7][0-9A-HJKMNP-TV-Z]*$'
         AND length(split_part(substr(p_key, length(p_queue) + 2), ':', 1)) <= 63
         AND length(split_part(substr(p_key, length(p_queue) + 2), ':', 2)) = 26
        THEN split_part(substr(p_key, length(p_queue) + 2), ':', 1)
    END
$$;
DROP POLICY stage_key_of_own_tenant ON job_singletons;
CREATE POLICY stage_key_of_own_tenant ON job_singletons AS RESTRICTIVE FOR INSERT
    TO idemstage_app
    WITH CHECK (coalesce(idemstage_stage_key_tenant(queue, singleton_key) = tenant_id, true));
