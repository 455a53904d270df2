REVOKE UPDATE (live) ON job_singletons FROM idemstage_app;
GRANT UPDATE ON job_singletons TO idemstage_app;
DROP TRIGGER jobs_take_key ON jobs;
DROP FUNCTION idemstage_jobs_take_key();
