-- `job_states`: a job with the state it is in, for every reader of a job's
-- state, attempt or lease (operators, the console, metrics, maintenance's
-- counts, the reconciler, tests).
--
-- Today it is `jobs` as it is. The storage of docs/storage-under-pressure.md
-- takes the fetch's lease and the completion off the job's row (a claim and a
-- closure appended beside it, so that the hot path leaves no dead tuple): from
-- then on `jobs.state` is what the job was sent or last put back as, and this
-- view derives the rest. Readers moved here first, so that the change of
-- storage changes the view, not them. Writers keep writing `jobs`.
--
-- security_invoker: the view reads `jobs` with the caller's rights, so a
-- tenant's scope (row-level security on `jobs`) sees its own jobs only.

CREATE VIEW job_states WITH (security_invoker = true) AS
SELECT j.id, j.queue, j.state, j.priority, j.payload, j.singleton_key, j.singleton_on,
       j.retry_limit, j.retry_count, j.retry_delay_ms, j.retry_backoff,
       j.retry_delay_max_ms, j.expire_in_ms, j.attempt, j.start_after, j.started_at,
       j.lease_expires_at, j.completed_at, j.created_at, j.dead_letter, j.output,
       j.last_error, j.tenant_id, j.ready_seq
  FROM jobs j;

GRANT SELECT ON job_states TO idemstage_app, idemstage_worker, idemstage_operator;
