-- Back to 000080's attempt trigger and 000050's success check (NOT VALID: a run
-- restored to an older success would fail it), without the kept inputs.
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
        -- A run created cancelled (its stage had only a queued job) records its one
        -- attempt as cancelled, so that the history still has a row per attempt.
        INSERT INTO pipeline_run_attempts
            (run_id, attempt, tenant_id, worker_id, input_hash, started_at, upstream_attempt,
             outcome, finished_at, error)
        VALUES (NEW.id, NEW.attempts, NEW.tenant_id, NEW.worker_id, NEW.input_hash,
                NEW.started_at, NEW.upstream_attempt,
                CASE WHEN NEW.status = 'cancelled' THEN 'cancelled' ELSE 'running' END,
                CASE WHEN NEW.status = 'cancelled' THEN now() END,
                CASE WHEN NEW.status = 'cancelled' THEN NEW.last_error END);
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
    ELSIF NEW.status <> OLD.status AND NEW.status = 'cancelled' THEN
        -- A running attempt of a cancelled run: fenced by the cancel, never commits.
        UPDATE pipeline_run_attempts
           SET outcome = 'cancelled', finished_at = now(), error = NEW.last_error
         WHERE run_id = NEW.id AND attempt = NEW.attempts AND outcome = 'running';
    END IF;
    RETURN NULL;
END;
$$;

ALTER TABLE pipeline_runs DROP CONSTRAINT pipeline_runs_success_attempt_ck,
    ADD CONSTRAINT pipeline_runs_success_attempt_ck
        CHECK (success_attempt <= attempts
               AND (status <> 'success' OR success_attempt IS NOT DISTINCT FROM attempts))
        NOT VALID;

DROP TRIGGER anfragen_keep_replaced_input ON anfragen;
DROP FUNCTION anfragen_keep_replaced_input();
DROP TABLE anfrage_inputs;
