-- The tenant scope's check of a stage-form singleton key (migration
-- 2026-12-05-170000_job_singletons) called a SQL function with its own
-- search_path, which PostgreSQL does not inline: every key a scoped send
-- inserted ran it as a statement of its own (8 µs and a call, measured with
-- pg_stat_statements in `idemstage bench pipeline`). The policy now holds the
-- same test as its expression; a policy's expression is bound to its
-- functions and operators when it is created, so it needs no search_path.
DROP POLICY stage_key_of_own_tenant ON job_singletons;
CREATE POLICY stage_key_of_own_tenant ON job_singletons AS RESTRICTIVE FOR INSERT
    TO idemstage_app
    WITH CHECK (
        NOT (left(singleton_key, length(queue) + 1) = queue || ':'
             AND substr(singleton_key, length(queue) + 2)
                 ~ '^[a-z0-9][a-z0-9_-]*:[0-7][0-9A-HJKMNP-TV-Z]*$'
             AND length(split_part(substr(singleton_key, length(queue) + 2), ':', 1)) <= 63
             AND length(split_part(substr(singleton_key, length(queue) + 2), ':', 2)) = 26)
        OR split_part(substr(singleton_key, length(queue) + 2), ':', 1) = tenant_id);
DROP FUNCTION idemstage_stage_key_tenant(text, text);
