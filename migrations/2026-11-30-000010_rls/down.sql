-- The role idemstage_app stays: it belongs to the server and other databases on it
-- may still use it. Only this database's policies and grants are removed.
DROP POLICY tenant_isolation ON anfragen;
DROP POLICY tenant_isolation ON pipeline_runs;
DROP POLICY tenant_isolation ON pipeline_run_attempts;
DROP POLICY tenant_isolation ON audit_log;

ALTER TABLE anfragen DISABLE ROW LEVEL SECURITY;
ALTER TABLE pipeline_runs DISABLE ROW LEVEL SECURITY;
ALTER TABLE pipeline_run_attempts DISABLE ROW LEVEL SECURITY;
ALTER TABLE audit_log DISABLE ROW LEVEL SECURITY;

REVOKE ALL ON
    anfragen, pipeline_runs, pipeline_run_attempts, audit_log, jobs
    FROM idemstage_app;
REVOKE USAGE ON SCHEMA public FROM idemstage_app;
