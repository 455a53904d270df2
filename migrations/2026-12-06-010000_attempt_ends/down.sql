DROP VIEW stage_run_attempts;
ALTER TABLE stage_attempt_ends RENAME TO stage_run_attempts;
ALTER INDEX stage_attempt_ends_pkey RENAME TO stage_run_attempts_pkey;
ALTER TABLE stage_run_attempts RENAME CONSTRAINT stage_attempt_ends_run_fk
    TO stage_run_attempts_run_fk;
ALTER TABLE stage_run_attempts RENAME CONSTRAINT stage_attempt_ends_attempt_check
    TO stage_run_attempts_attempt_check;
ALTER TABLE stage_run_attempts DROP CONSTRAINT stage_attempt_ends_outcome_check;
ALTER TABLE stage_run_attempts ADD CONSTRAINT stage_run_attempts_outcome_check
    CHECK (outcome IN ('running', 'success', 'failed', 'abandoned', 'fenced', 'cancelled',
                       'waiting'));
ALTER TABLE stage_run_attempts ALTER COLUMN outcome SET DEFAULT 'running';
ALTER TABLE stage_run_attempts ALTER COLUMN finished_at DROP NOT NULL;
ALTER TABLE stage_run_attempts SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
REVOKE UPDATE (outcome, finished_at) ON stage_run_attempts FROM idemstage_app;
GRANT UPDATE ON stage_run_attempts TO idemstage_app;

INSERT INTO stage_run_attempts
    (run_id, attempt, tenant_id, worker_id, input_hash, started_at, upstream_attempt)
SELECT r.id, r.attempts, r.tenant_id, r.worker_id, r.input_hash, r.started_at, r.upstream_attempt
  FROM stage_runs r
 WHERE NOT EXISTS (SELECT 1 FROM stage_run_attempts e
                    WHERE e.run_id = r.id AND e.attempt = r.attempts);

CREATE OR REPLACE FUNCTION stage_runs_record_attempt() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' OR NEW.attempts <> OLD.attempts THEN
        -- A new attempt: the previous one (if any) was given up without finishing.
        IF TG_OP = 'UPDATE' THEN
            UPDATE stage_run_attempts
               SET outcome = 'abandoned', finished_at = clock_timestamp()
             WHERE run_id = NEW.id AND attempt = OLD.attempts AND outcome = 'running';
        END IF;
        -- A run created cancelled (its stage had only a queued job) records its one
        -- attempt as cancelled, so that the history still has a row per attempt.
        INSERT INTO stage_run_attempts
            (run_id, attempt, tenant_id, worker_id, input_hash, started_at, upstream_attempt,
             outcome, finished_at, error)
        VALUES (NEW.id, NEW.attempts, NEW.tenant_id, NEW.worker_id, NEW.input_hash,
                NEW.started_at, NEW.upstream_attempt,
                CASE WHEN NEW.status = 'cancelled' THEN 'cancelled' ELSE 'running' END,
                CASE WHEN NEW.status = 'cancelled'
                     THEN greatest(NEW.started_at, coalesce(NEW.finished_at, clock_timestamp()))
                END,
                CASE WHEN NEW.status = 'cancelled' THEN NEW.last_error END);
    ELSIF NEW.status <> OLD.status AND NEW.status = 'success'
          AND NEW.success_attempt <> NEW.attempts THEN
        -- Restored to an older success: the current attempt, if it was still
        -- running, never commits.
        UPDATE stage_run_attempts
           SET outcome = 'abandoned', finished_at = clock_timestamp(), error = NEW.last_error
         WHERE run_id = NEW.id AND attempt = NEW.attempts AND outcome = 'running';
    ELSIF NEW.status <> OLD.status AND NEW.status IN ('success', 'failed', 'dead') THEN
        UPDATE stage_run_attempts
           SET outcome = CASE WHEN NEW.status = 'success' THEN 'success' ELSE 'failed' END,
               finished_at = greatest(started_at, coalesce(NEW.finished_at, clock_timestamp())),
               error = NEW.last_error
         WHERE run_id = NEW.id AND attempt = NEW.attempts AND outcome = 'running';
    ELSIF NEW.status <> OLD.status AND NEW.status = 'stale' THEN
        -- A running attempt invalidated by its upstream's new success (or whose
        -- upstream moved on before it committed): it can never commit.
        UPDATE stage_run_attempts
           SET outcome = 'fenced', finished_at = clock_timestamp(), error = NEW.last_error
         WHERE run_id = NEW.id AND attempt = NEW.attempts AND outcome = 'running';
    ELSIF NEW.status <> OLD.status AND NEW.status = 'waiting' THEN
        -- The attempt ended in a wait (migration 2026-12-04-200000_durable_waits):
        -- it holds nothing any more; the wait's end makes the run claimable.
        UPDATE stage_run_attempts
           SET outcome = 'waiting', finished_at = clock_timestamp(), error = NEW.last_error
         WHERE run_id = NEW.id AND attempt = NEW.attempts AND outcome = 'running';
    ELSIF NEW.status <> OLD.status AND NEW.status = 'cancelled' THEN
        -- A running attempt of a cancelled run: fenced by the cancel, never commits.
        UPDATE stage_run_attempts
           SET outcome = 'cancelled',
               finished_at = greatest(started_at, coalesce(NEW.finished_at, clock_timestamp())),
               error = NEW.last_error
         WHERE run_id = NEW.id AND attempt = NEW.attempts AND outcome = 'running';
    END IF;
    -- A run that stops waiting other than by its wait's end (cancelled, or
    -- invalidated by its upstream's new success) ends its open wait: no wait
    -- stays open on a run that no longer waits, and no late signal finds it.
    IF TG_OP = 'UPDATE' AND OLD.status = 'waiting' AND NEW.status <> 'waiting' THEN
        UPDATE stage_waits
           SET ended_at = clock_timestamp(), ended_by = 'gone'
         WHERE run_id = NEW.id AND ended_at IS NULL;
    END IF;
    RETURN NULL;
END;
$$;

DROP FUNCTION stage_attempt_end(stage_runs, text, timestamptz, text);
