-- Durable waits: a stage attempt can end in `waiting` for a named signal (a
-- person's approval, a provider's callback) or a timer, with a deadline and
-- what happens then. A waiting run holds no worker, no lease and no job; the
-- claim admits it only once its wait has ended (the end sets it `running` with
-- its lease over and one more attempt in its budget, as a release does, and
-- sends its job).
--
-- `stage_waits`: one row per attempt that waited: the signal it waits for
-- (NULL: a timer), its deadline, what its end is (`fail`: the run ends `dead`;
-- `resume`: it runs again, the signal read as timed out), and how it ended
-- (`signal` with the payload and who delivered it, `timeout`, or `gone` when
-- the run stopped waiting otherwise: cancelled, or invalidated by its upstream;
-- the attempt trigger ends it then).
-- Ended once: the delivery is a conditional write on `ended_at IS NULL`, under
-- the run's row lock. The open waits have their own index, so the timeouts are
-- found without reading `stage_runs` (an index there on the status would make
-- every completion a non-HOT update).
ALTER TABLE stage_runs DROP CONSTRAINT stage_runs_status_check;
ALTER TABLE stage_runs ADD CONSTRAINT stage_runs_status_check
    CHECK (status IN ('running', 'success', 'failed', 'dead', 'stale', 'cancelled', 'waiting'));
ALTER TABLE stage_run_attempts DROP CONSTRAINT stage_run_attempts_outcome_check;
ALTER TABLE stage_run_attempts ADD CONSTRAINT stage_run_attempts_outcome_check
    CHECK (outcome IN ('running', 'success', 'failed', 'abandoned', 'fenced', 'cancelled',
                       'waiting'));

CREATE TABLE stage_waits (
    tenant_id   tenant_slug NOT NULL,
    run_id      ulid_text   NOT NULL,
    attempt     integer     NOT NULL CHECK (attempt >= 1),
    stage       stage_name  NOT NULL,
    signal      stage_name,
    wait_until  timestamptz NOT NULL,
    on_timeout  text        NOT NULL
        CONSTRAINT stage_waits_on_timeout_check CHECK (on_timeout IN ('fail', 'resume')),
    created_at  timestamptz NOT NULL DEFAULT now(),
    ended_at    timestamptz,
    ended_by    text
        CONSTRAINT stage_waits_ended_by_check CHECK (ended_by IN ('signal', 'timeout', 'gone')),
    payload     jsonb,
    actor       text,
    PRIMARY KEY (run_id, attempt),
    CONSTRAINT stage_waits_run_fk FOREIGN KEY (tenant_id, run_id)
        REFERENCES stage_runs (tenant_id, id),
    CONSTRAINT stage_waits_ended_ck CHECK ((ended_at IS NULL) = (ended_by IS NULL))
);
CREATE INDEX stage_waits_open_idx ON stage_waits (wait_until, stage) WHERE ended_at IS NULL;

GRANT SELECT, INSERT, UPDATE ON stage_waits TO idemstage_app;
GRANT SELECT ON stage_waits TO idemstage_operator;
-- The worker finds the waits past their deadline across tenants (outside any
-- scope, as it finds ready jobs): the columns that say which and when, never
-- what a signal carried or who sent it; the rest it reads in the tenant's scope.
GRANT SELECT (tenant_id, run_id, attempt, stage, wait_until, ended_at)
    ON stage_waits TO idemstage_worker;

ALTER TABLE stage_waits ENABLE ROW LEVEL SECURITY;
ALTER TABLE stage_waits FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON stage_waits TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY operator_read ON stage_waits FOR SELECT
    TO idemstage_operator, idemstage_worker USING (true);

-- The attempt history knows the wait: an attempt that ended in one is `waiting`.
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
