-- Cancelled runs become dead (final, never claimed again: the closest status the
-- older schema has), their cancelled attempts failed.
UPDATE pipeline_run_attempts SET outcome = 'failed' WHERE outcome = 'cancelled';
UPDATE pipeline_runs SET status = 'dead' WHERE status = 'cancelled';

CREATE OR REPLACE FUNCTION pipeline_runs_record_attempt() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' OR NEW.attempts <> OLD.attempts THEN
        -- A new attempt: the previous one (if any) was given up without finishing.
        IF TG_OP = 'UPDATE' THEN
            UPDATE pipeline_run_attempts
               SET outcome = 'abandoned', finished_at = now()
             WHERE run_id = NEW.id AND attempt = OLD.attempts AND outcome = 'running';
        END IF;
        INSERT INTO pipeline_run_attempts
            (run_id, attempt, tenant_id, worker_id, input_hash, started_at, upstream_attempt)
        VALUES (NEW.id, NEW.attempts, NEW.tenant_id, NEW.worker_id, NEW.input_hash,
                NEW.started_at, NEW.upstream_attempt);
    ELSIF NEW.status <> OLD.status AND NEW.status IN ('success', 'failed', 'dead') THEN
        UPDATE pipeline_run_attempts
           SET outcome = CASE WHEN NEW.status = 'success' THEN 'success' ELSE 'failed' END,
               finished_at = now(),
               error = NEW.last_error
         WHERE run_id = NEW.id AND attempt = NEW.attempts AND outcome = 'running';
    ELSIF NEW.status <> OLD.status AND NEW.status = 'stale' THEN
        -- A running attempt invalidated by its upstream's new success (or whose
        -- upstream moved on before it committed): it can never commit.
        UPDATE pipeline_run_attempts
           SET outcome = 'fenced', finished_at = now(), error = NEW.last_error
         WHERE run_id = NEW.id AND attempt = NEW.attempts AND outcome = 'running';
    END IF;
    RETURN NULL;
END;
$$;

ALTER TABLE pipeline_run_attempts DROP CONSTRAINT pipeline_run_attempts_outcome_check,
    ADD CONSTRAINT pipeline_run_attempts_outcome_check
        CHECK (outcome IN ('running', 'success', 'failed', 'abandoned', 'fenced'));
ALTER TABLE pipeline_runs DROP CONSTRAINT pipeline_runs_status_check,
    ADD CONSTRAINT pipeline_runs_status_check
        CHECK (status IN ('running', 'success', 'failed', 'dead', 'stale'));
