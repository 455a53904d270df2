-- The roles idemstage_worker and idemstage_operator, and the memberships up.sql
-- granted, stay: roles belong to the server, and other databases on it may still
-- use them (dropping a role that still holds grants elsewhere fails, and would
-- lock their workers out). Only this database's grants, policies and flags go.
ALTER TABLE anfragen NO FORCE ROW LEVEL SECURITY;
ALTER TABLE pipeline_runs NO FORCE ROW LEVEL SECURITY;
ALTER TABLE pipeline_run_attempts NO FORCE ROW LEVEL SECURITY;
ALTER TABLE audit_log NO FORCE ROW LEVEL SECURITY;

DROP POLICY operator_read ON anfragen;
DROP POLICY operator_read ON pipeline_runs;
DROP POLICY operator_read ON pipeline_run_attempts;
DROP POLICY operator_read ON audit_log;

REVOKE ALL ON
    anfragen, pipeline_runs, pipeline_run_attempts, audit_log,
    jobs, queue_controls, queue_buckets
    FROM idemstage_worker, idemstage_operator;
REVOKE ALL ON FUNCTION
    idemstage_fetch(text[], integer),
    idemstage_fetch_plain(text, integer),
    idemstage_fetch_controlled(text, integer),
    idemstage_fetch_wait(text[])
    FROM idemstage_worker, idemstage_operator;
REVOKE USAGE ON SCHEMA public FROM idemstage_worker, idemstage_operator;

GRANT DELETE ON pipeline_runs, pipeline_run_attempts TO idemstage_app;
