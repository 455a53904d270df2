-- Durable waits go (migration 2026-12-04-200000_durable_waits). A run still
-- waiting cannot stay: it is refused by the old status check.
DROP TABLE stage_waits;
ALTER TABLE stage_run_attempts DROP CONSTRAINT stage_run_attempts_outcome_check;
ALTER TABLE stage_run_attempts ADD CONSTRAINT stage_run_attempts_outcome_check
    CHECK (outcome IN ('running', 'success', 'failed', 'abandoned', 'fenced', 'cancelled'));
ALTER TABLE stage_runs DROP CONSTRAINT stage_runs_status_check;
ALTER TABLE stage_runs ADD CONSTRAINT stage_runs_status_check
    CHECK (status IN ('running', 'success', 'failed', 'dead', 'stale', 'cancelled'));
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
    ELSIF NEW.status <> OLD.status AND NEW.status = 'cancelled' THEN
        -- A running attempt of a cancelled run: fenced by the cancel, never commits.
        UPDATE stage_run_attempts
           SET outcome = 'cancelled',
               finished_at = greatest(started_at, coalesce(NEW.finished_at, clock_timestamp())),
               error = NEW.last_error
         WHERE run_id = NEW.id AND attempt = NEW.attempts AND outcome = 'running';
    END IF;
    RETURN NULL;
END;
$$;
