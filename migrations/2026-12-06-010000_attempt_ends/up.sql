-- An attempt's history row is written once, when the attempt ends (issue 31).
-- Before, the claim inserted it `running` and the end updated it: one row
-- version per stage execution left for VACUUM (1,400 dead tuples at the
-- median of the two-hour soak, as many as `stage_runs`' own), and under a
-- held snapshot one version per stage. Now the ends are a table of their own
-- that is only inserted into (`stage_attempt_ends`, the former table's rows
-- and keys), and the attempt that has not ended is read from its run: the
-- run's row holds the current attempt's worker, input, upstream and start.
-- `stage_run_attempts` is a view of both, with the same columns and rows as
-- the table it replaces (an attempt is `running` until its end is written).
--
-- An end is written at most once (`ON CONFLICT DO NOTHING`, under the run's
-- row lock, as the former `UPDATE ... WHERE outcome = 'running'` was), with
-- one exception kept from before: an `abandoned` end may be named `fenced`
-- later, when the worker that gave it up comes back to find its token gone.

ALTER TABLE stage_run_attempts RENAME TO stage_attempt_ends;
ALTER INDEX stage_run_attempts_pkey RENAME TO stage_attempt_ends_pkey;
ALTER TABLE stage_attempt_ends RENAME CONSTRAINT stage_run_attempts_run_fk
    TO stage_attempt_ends_run_fk;
ALTER TABLE stage_attempt_ends RENAME CONSTRAINT stage_run_attempts_attempt_check
    TO stage_attempt_ends_attempt_check;
ALTER TABLE stage_attempt_ends DROP CONSTRAINT stage_run_attempts_outcome_check;

-- A `running` row of an attempt that is not its run's current one cannot
-- exist (every new attempt ended the one before); should one, it was given up.
UPDATE stage_attempt_ends e
   SET outcome = 'abandoned', finished_at = clock_timestamp()
  FROM stage_runs r
 WHERE e.outcome = 'running' AND r.id = e.run_id AND r.attempts <> e.attempt;
-- The current attempts that have not ended are read from their runs now.
DELETE FROM stage_attempt_ends WHERE outcome = 'running';

ALTER TABLE stage_attempt_ends ALTER COLUMN outcome DROP DEFAULT;
ALTER TABLE stage_attempt_ends ALTER COLUMN finished_at SET NOT NULL;
ALTER TABLE stage_attempt_ends ADD CONSTRAINT stage_attempt_ends_outcome_check
    CHECK (outcome IN ('success', 'failed', 'abandoned', 'fenced', 'cancelled', 'waiting'));
-- Rows are inserted, not updated: the default vacuum thresholds do.
ALTER TABLE stage_attempt_ends RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold);

-- Only an `abandoned` end is ever updated (to `fenced`, above).
REVOKE UPDATE ON stage_attempt_ends FROM idemstage_app;
GRANT UPDATE (outcome, finished_at) ON stage_attempt_ends TO idemstage_app;

CREATE VIEW stage_run_attempts WITH (security_invoker = true) AS
SELECT e.run_id, e.attempt, e.tenant_id, e.worker_id, e.input_hash, e.started_at,
       e.finished_at, e.outcome, e.error, e.upstream_attempt
  FROM stage_attempt_ends e
UNION ALL
SELECT r.id, r.attempts, r.tenant_id, r.worker_id, r.input_hash, r.started_at,
       NULL::timestamptz, 'running'::text, NULL::text, r.upstream_attempt
  FROM stage_runs r
 WHERE NOT EXISTS (SELECT 1 FROM stage_attempt_ends e
                    WHERE e.run_id = r.id AND e.attempt = r.attempts);
GRANT SELECT ON stage_run_attempts TO idemstage_app, idemstage_operator;

-- The end of the run's current attempt (`r`'s `attempts`), with that
-- attempt's own worker, input, upstream and start; nothing if it has ended.
-- PL/pgSQL, so that its plan is kept for the session.
CREATE FUNCTION stage_attempt_end(r stage_runs, p_outcome text, p_finished timestamptz,
                                  p_error text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO stage_attempt_ends
        (run_id, attempt, tenant_id, worker_id, input_hash, started_at, finished_at,
         outcome, error, upstream_attempt)
    VALUES (r.id, r.attempts, r.tenant_id, r.worker_id, r.input_hash, r.started_at,
            p_finished, p_outcome, p_error, r.upstream_attempt)
    ON CONFLICT (run_id, attempt) DO NOTHING;
END;
$$;

-- As migration 2026-12-04-200000_durable_waits's, with each end inserted
-- (from the row before the update: the attempt's own start, input and
-- upstream) instead of an update of the attempt's row.
CREATE OR REPLACE FUNCTION stage_runs_record_attempt() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' OR NEW.attempts <> OLD.attempts THEN
        -- A new attempt: the previous one (if any) was given up without finishing.
        IF TG_OP = 'UPDATE' THEN
            PERFORM stage_attempt_end(OLD, 'abandoned', clock_timestamp(), NULL);
        END IF;
        -- A run created cancelled (its stage had only a queued job) records its one
        -- attempt as cancelled, so that the history still has a row per attempt.
        IF NEW.status = 'cancelled' THEN
            PERFORM stage_attempt_end(
                NEW, 'cancelled',
                greatest(NEW.started_at, coalesce(NEW.finished_at, clock_timestamp())),
                NEW.last_error);
        END IF;
    ELSIF NEW.status <> OLD.status AND NEW.status = 'success'
          AND NEW.success_attempt <> NEW.attempts THEN
        -- Restored to an older success: the current attempt, if it was still
        -- running, never commits.
        PERFORM stage_attempt_end(OLD, 'abandoned', clock_timestamp(), NEW.last_error);
    ELSIF NEW.status <> OLD.status AND NEW.status IN ('success', 'failed', 'dead') THEN
        PERFORM stage_attempt_end(
            OLD, CASE WHEN NEW.status = 'success' THEN 'success' ELSE 'failed' END,
            greatest(OLD.started_at, coalesce(NEW.finished_at, clock_timestamp())),
            NEW.last_error);
    ELSIF NEW.status <> OLD.status AND NEW.status = 'stale' THEN
        -- A running attempt invalidated by its upstream's new success (or whose
        -- upstream moved on before it committed): it can never commit.
        PERFORM stage_attempt_end(OLD, 'fenced', clock_timestamp(), NEW.last_error);
    ELSIF NEW.status <> OLD.status AND NEW.status = 'waiting' THEN
        -- The attempt ended in a wait: it holds nothing any more; the wait's
        -- end makes the run claimable.
        PERFORM stage_attempt_end(OLD, 'waiting', clock_timestamp(), NEW.last_error);
    ELSIF NEW.status <> OLD.status AND NEW.status = 'cancelled' THEN
        -- A running attempt of a cancelled run: fenced by the cancel, never commits.
        PERFORM stage_attempt_end(
            OLD, 'cancelled',
            greatest(OLD.started_at, coalesce(NEW.finished_at, clock_timestamp())),
            NEW.last_error);
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
