-- Operator commands (issue 14): `idemstage cancel` ends an anfrage's unfinished
-- stages in a new final status, `cancelled`.
--
-- pipeline_runs.status
--   cancelled  final: an operator cancelled the anfrage while the stage was not
--              final (running, failed or stale), or while only its job was queued
--              (then the run is created cancelled). Never claimed again (the
--              claim's guard admits only failed, stale, an expired lease and a
--              rerun of a success), so a running attempt is fenced: its commit,
--              renewal, failure and release all expect `running`. Its
--              success_attempt, if it had one, stays: results computed from it
--              stay current.
-- pipeline_run_attempts.outcome
--   cancelled  the attempt was running when its run was cancelled (or is the
--              one recorded for a run created cancelled): it never commits.
ALTER TABLE pipeline_runs DROP CONSTRAINT pipeline_runs_status_check,
    ADD CONSTRAINT pipeline_runs_status_check
        CHECK (status IN ('running', 'success', 'failed', 'dead', 'stale', 'cancelled'));
ALTER TABLE pipeline_run_attempts DROP CONSTRAINT pipeline_run_attempts_outcome_check,
    ADD CONSTRAINT pipeline_run_attempts_outcome_check
        CHECK (outcome IN ('running', 'success', 'failed', 'abandoned', 'fenced', 'cancelled'));

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
