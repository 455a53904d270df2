-- A keyed job a closure ended is written back to its row's state first, so
-- that the restored live index holds only live jobs.
UPDATE jobs j SET state = z.outcome, completed_at = z.closed_at, output = z.output
  FROM job_closures z
 WHERE z.ready_seq = j.ready_seq AND z.job_id = j.id AND z.outcome = 'completed'
   AND j.singleton_key IS NOT NULL AND j.state IN ('created', 'retry');
CREATE UNIQUE INDEX jobs_singleton_live_uq ON jobs (queue, singleton_key)
    WHERE singleton_key IS NOT NULL AND state IN ('created', 'retry', 'active');
CREATE UNIQUE INDEX jobs_singleton_window_uq ON jobs (queue, singleton_key, singleton_on)
    WHERE singleton_on IS NOT NULL;
DROP TRIGGER jobs_release_keys ON jobs;
DROP TRIGGER jobs_key_follows_state ON jobs;
DROP FUNCTION idemstage_jobs_key_follows_state();
DROP FUNCTION idemstage_jobs_release_keys();
DROP TABLE job_singletons;
DROP FUNCTION idemstage_stage_key_tenant(text, text);
