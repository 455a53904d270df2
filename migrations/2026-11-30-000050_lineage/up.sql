-- Lineage: a stage's result is computed from the current successful attempt of the
-- stage before it (the first stage: from the anfrage's stored input), and commits
-- only while that attempt is still current.
--
-- success_attempt   the attempt whose committed results are current (set by the
--                   fenced success; kept while a rerun is running, failed or dead,
--                   because the rerun's results never committed; NULL again when
--                   the run is invalidated, `stale`, by its upstream's new success:
--                   its results are then outdated, and nothing may be computed
--                   from them)
-- upstream_stage    the stage this run's current attempt read from (NULL: the first
--                   stage, which reads the anfrage's input, bound by input_hash)
-- upstream_attempt  that stage's success_attempt when this attempt was claimed; the
--                   fenced commit checks it is still current
--
-- The checker's invariant in SQL: every successful run with an upstream names its
-- upstream's success_attempt; every successful first stage names the anfrage's
-- stored input hash.
ALTER TABLE pipeline_runs
    ADD COLUMN success_attempt  integer CHECK (success_attempt >= 1),
    ADD COLUMN upstream_stage   stage_name,
    ADD COLUMN upstream_attempt integer CHECK (upstream_attempt >= 1),
    ADD CONSTRAINT pipeline_runs_upstream_ck
        CHECK ((upstream_stage IS NULL) = (upstream_attempt IS NULL)),
    ADD CONSTRAINT pipeline_runs_success_attempt_ck
        CHECK (success_attempt <= attempts
               AND (status <> 'success' OR success_attempt IS NOT DISTINCT FROM attempts));

-- Each attempt remembers which upstream attempt it read.
ALTER TABLE pipeline_run_attempts ADD COLUMN upstream_attempt integer;

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

UPDATE pipeline_runs SET success_attempt = attempts WHERE status = 'success';
