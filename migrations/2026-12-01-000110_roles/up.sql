-- Least privilege (issue 15): three roles instead of "whoever DATABASE_URL names".
--
-- * The migration owner: whoever runs the migrations (unchanged). Owns every table.
-- * idemstage_worker: NOLOGIN group role of the workers' login roles
--       CREATE ROLE w LOGIN PASSWORD '...' IN ROLE idemstage_worker;
--   Owns nothing, NOSUPERUSER, NOBYPASSRLS, NOINHERIT. Directly it may only work
--   the queue (jobs, the buckets, read the controls, the fetch functions); every
--   tenant table it reaches through the tenant scope, i.e. as idemstage_app (it is
--   a member so that `SET LOCAL role idemstage_app` works) with app.tenant_id set.
--   NOINHERIT: idemstage_app's grants apply only inside a scope, never directly.
-- * idemstage_operator: NOLOGIN group role for status, the console, reports and
--   the operator commands: reads every tenant's rows (a SELECT policy of its own),
--   writes the queue controls, sends and cancels jobs; retry and cancel write runs
--   scoped to the tenant they name, as idemstage_app (a member for that).
--
-- Nobody deletes pipeline_runs or their attempt history: DELETE on them is taken
-- from idemstage_app as well (TRUNCATE it never had). The core's tenant tables are
-- now FORCEd like the teams' (000060): the owner, connecting directly and not a
-- superuser, is under the policies too; it is made a member of idemstage_operator
-- so that its status and reports still read across tenants.
--
-- Roles are per server, shared by every database on it: created if missing, and
-- down.sql leaves them (and memberships) in place, because other databases may
-- still use them. down.sql removes only what this database holds: its grants, its
-- policies, FORCE.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'idemstage_worker') THEN
        CREATE ROLE idemstage_worker NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE
            NOREPLICATION NOBYPASSRLS NOINHERIT;
    END IF;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
    NULL; -- created concurrently by a migration of another database
END
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'idemstage_operator') THEN
        CREATE ROLE idemstage_operator NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE
            NOREPLICATION NOBYPASSRLS NOINHERIT;
    END IF;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
    NULL;
END
$$;

DO $$
BEGIN
    IF NOT pg_has_role('idemstage_worker', 'idemstage_app', 'MEMBER') THEN
        GRANT idemstage_app TO idemstage_worker;
    END IF;
    IF NOT pg_has_role('idemstage_operator', 'idemstage_app', 'MEMBER') THEN
        GRANT idemstage_app TO idemstage_operator;
    END IF;
    IF NOT pg_has_role(current_user, 'idemstage_operator', 'MEMBER') THEN
        EXECUTE format('GRANT idemstage_operator TO %I', current_user);
    END IF;
EXCEPTION WHEN unique_violation THEN
    NULL; -- granted concurrently by a migration of another database
END
$$;

-- Never deleted (ARCHITECTURE.md, invariants), not even within a tenant.
REVOKE DELETE ON pipeline_runs, pipeline_run_attempts FROM idemstage_app;

-- The worker: the queue, outside any tenant scope.
GRANT USAGE ON SCHEMA public TO idemstage_worker;
-- DELETE: maintenance removes finished jobs after their retention.
GRANT SELECT, INSERT, UPDATE, DELETE ON jobs TO idemstage_worker;
-- The fetch takes turns on the control rows (SELECT .. FOR UPDATE needs UPDATE on
-- one column); the worker changes no limit.
GRANT SELECT ON queue_controls TO idemstage_worker;
GRANT UPDATE (updated_at) ON queue_controls TO idemstage_worker;
-- The fetch takes tokens; a rate-limited stage holds its bucket.
GRANT SELECT, INSERT, UPDATE ON queue_buckets TO idemstage_worker;
GRANT EXECUTE ON FUNCTION
    idemstage_fetch(text[], integer),
    idemstage_fetch_plain(text, integer),
    idemstage_fetch_controlled(text, integer),
    idemstage_fetch_wait(text[])
    TO idemstage_worker;

-- The operator: reads everything, writes the controls and the queue.
GRANT USAGE ON SCHEMA public TO idemstage_operator;
GRANT SELECT ON
    anfragen, pipeline_runs, pipeline_run_attempts, audit_log,
    jobs, queue_controls, queue_buckets
    TO idemstage_operator;
GRANT INSERT, UPDATE ON jobs TO idemstage_operator;
GRANT INSERT, UPDATE, DELETE ON queue_controls, queue_buckets TO idemstage_operator;
GRANT EXECUTE ON FUNCTION idemstage_fetch_wait(text[]) TO idemstage_operator;

CREATE POLICY operator_read ON anfragen FOR SELECT TO idemstage_operator USING (true);
CREATE POLICY operator_read ON pipeline_runs FOR SELECT TO idemstage_operator USING (true);
CREATE POLICY operator_read ON pipeline_run_attempts FOR SELECT TO idemstage_operator
    USING (true);
CREATE POLICY operator_read ON audit_log FOR SELECT TO idemstage_operator USING (true);

ALTER TABLE anfragen FORCE ROW LEVEL SECURITY;
ALTER TABLE pipeline_runs FORCE ROW LEVEL SECURITY;
ALTER TABLE pipeline_run_attempts FORCE ROW LEVEL SECURITY;
ALTER TABLE audit_log FORCE ROW LEVEL SECURITY;
