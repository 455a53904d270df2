-- Tenant isolation by row-level security on every tenant table.
--
-- Decision: the application keeps connecting as whatever user DATABASE_URL names
-- (often the owner of the tables, or a superuser in tests, both of which bypass
-- RLS). Every tenant-scoped transaction of the persistence layer instead begins with
--     SELECT set_config('role', 'idemstage_app', true),
--            set_config('app.tenant_id', <the job's tenant>, true)
-- i.e. SET LOCAL ROLE to `idemstage_app`, a NOLOGIN, NOSUPERUSER, NOBYPASSRLS role
-- that owns nothing, plus the tenant as a transaction-local setting. Both end with
-- the transaction, so a pooled connection never carries a tenant into the next
-- transaction. The policies see only rows whose tenant_id equals the setting; with
-- no setting, current_setting(..., true) is NULL and no row is visible or writable.
--
-- This works against any server: the migrating user needs CREATEROLE (or the role
-- must exist already) and becomes a member of idemstage_app so that it may SET
-- ROLE to it. Roles are per server: the role is created once and shared by every
-- database on that server, and down.sql leaves it in place (other databases may
-- still use it). Reports, status, queue maintenance and the invariant checks run
-- as the connecting user, across tenants, on purpose.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'idemstage_app') THEN
        CREATE ROLE idemstage_app NOLOGIN NOSUPERUSER NOBYPASSRLS NOINHERIT;
    END IF;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
    NULL; -- created concurrently by a migration of another database
END
$$;

DO $$
BEGIN
    IF NOT pg_has_role(current_user, 'idemstage_app', 'MEMBER') THEN
        EXECUTE format('GRANT idemstage_app TO %I', current_user);
    END IF;
END
$$;

GRANT USAGE ON SCHEMA public TO idemstage_app;
GRANT SELECT, INSERT, UPDATE, DELETE ON
    anfragen, pipeline_runs, pipeline_run_attempts, audit_log
    TO idemstage_app;
-- The queue has no tenant column: the fenced transaction sends the next stage's job.
GRANT SELECT, INSERT, UPDATE ON jobs TO idemstage_app;

ALTER TABLE anfragen ENABLE ROW LEVEL SECURITY;
ALTER TABLE pipeline_runs ENABLE ROW LEVEL SECURITY;
ALTER TABLE pipeline_run_attempts ENABLE ROW LEVEL SECURITY;
ALTER TABLE audit_log ENABLE ROW LEVEL SECURITY;

CREATE POLICY tenant_isolation ON anfragen TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY tenant_isolation ON pipeline_runs TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY tenant_isolation ON pipeline_run_attempts TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY tenant_isolation ON audit_log TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
