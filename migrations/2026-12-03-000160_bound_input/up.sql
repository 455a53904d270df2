-- The promise at its edges (issue 29): a stage reads exactly the input its run is
-- bound to, a second success on the same input is never run, and timestamps of
-- an attempt are in order.
--
-- 1. anfrage_inputs: every input an anfrage held before it was replaced (the
--    `Rerun` policy replaces anfragen.input_text/input_sha256 in place). A run is
--    bound to an input by hash (pipeline_runs.input_hash: the first stage's from
--    the anfrage, a later stage's from its upstream's successful attempt), so a
--    stage body reads the text of that hash: the stored one while it is current,
--    else the replaced one kept here (FencedTx::anfrage_text). Written by a
--    trigger on anfragen, so no path can replace an input without keeping the old
--    one. Only replaced inputs are kept: an anfrage never replaced costs nothing.
CREATE TABLE anfrage_inputs (
    tenant_id    tenant_slug NOT NULL,
    anfrage_id   ulid_text   NOT NULL,
    input_sha256 text        NOT NULL CHECK (input_sha256 ~ '^[0-9a-f]{64}$'),
    input_text   text        NOT NULL,
    replaced_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (tenant_id, anfrage_id, input_sha256),
    CONSTRAINT anfrage_inputs_anfrage_fk FOREIGN KEY (tenant_id, anfrage_id)
        REFERENCES anfragen (tenant_id, id)
);

CREATE FUNCTION anfragen_keep_replaced_input() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.anfrage_inputs (tenant_id, anfrage_id, input_sha256, input_text)
    VALUES (OLD.tenant_id, OLD.id, OLD.input_sha256, OLD.input_text)
    ON CONFLICT (tenant_id, anfrage_id, input_sha256) DO NOTHING;
    RETURN NULL;
END;
$$;

CREATE TRIGGER anfragen_keep_replaced_input
    AFTER UPDATE OF input_sha256 ON anfragen
    FOR EACH ROW WHEN (OLD.input_sha256 IS DISTINCT FROM NEW.input_sha256)
    EXECUTE FUNCTION anfragen_keep_replaced_input();

-- Under the same isolation as anfragen: the scoped role of its tenant only (the
-- trigger runs as the role that replaced the input), operators read. Never
-- updated or deleted: a run may be bound to it for ever.
GRANT SELECT, INSERT ON anfrage_inputs TO idemstage_app;
GRANT SELECT ON anfrage_inputs TO idemstage_operator;
ALTER TABLE anfrage_inputs ENABLE ROW LEVEL SECURITY;
ALTER TABLE anfrage_inputs FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON anfrage_inputs TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY operator_read ON anfrage_inputs FOR SELECT TO idemstage_operator USING (true);

-- 2. A run whose current success already is what a claim would compute (the
--    same input hash and upstream attempt: an input set back to the one it
--    succeeded on, after a rerun on another input failed, died or lost its lease)
--    is not run again: the claim's explanation restores it to `success` on that
--    attempt (runs/sql.rs, RESTORE_SUCCESS). Its success_attempt is then older
--    than its attempts, so `success` needs a success_attempt, not this one.
ALTER TABLE pipeline_runs DROP CONSTRAINT pipeline_runs_success_attempt_ck,
    ADD CONSTRAINT pipeline_runs_success_attempt_ck
        CHECK (success_attempt <= attempts
               AND (status <> 'success' OR success_attempt IS NOT NULL));

-- 3. The attempt history: an attempt's finished_at is the run's (or the
--    statement's clock), never the transaction's start, which is before the
--    started_at of an attempt begun in the same transaction (a run created
--    cancelled had finished_at < started_at). A restored success ends a running
--    attempt (a rerun whose lease ran out) `abandoned`: the success is an older
--    attempt's.
CREATE OR REPLACE FUNCTION pipeline_runs_record_attempt() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' OR NEW.attempts <> OLD.attempts THEN
        -- A new attempt: the previous one (if any) was given up without finishing.
        IF TG_OP = 'UPDATE' THEN
            UPDATE pipeline_run_attempts
               SET outcome = 'abandoned', finished_at = clock_timestamp()
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
                CASE WHEN NEW.status = 'cancelled'
                     THEN greatest(NEW.started_at, coalesce(NEW.finished_at, clock_timestamp()))
                END,
                CASE WHEN NEW.status = 'cancelled' THEN NEW.last_error END);
    ELSIF NEW.status <> OLD.status AND NEW.status = 'success'
          AND NEW.success_attempt <> NEW.attempts THEN
        -- Restored to an older success: the current attempt, if it was still
        -- running, never commits.
        UPDATE pipeline_run_attempts
           SET outcome = 'abandoned', finished_at = clock_timestamp(), error = NEW.last_error
         WHERE run_id = NEW.id AND attempt = NEW.attempts AND outcome = 'running';
    ELSIF NEW.status <> OLD.status AND NEW.status IN ('success', 'failed', 'dead') THEN
        UPDATE pipeline_run_attempts
           SET outcome = CASE WHEN NEW.status = 'success' THEN 'success' ELSE 'failed' END,
               finished_at = greatest(started_at, coalesce(NEW.finished_at, clock_timestamp())),
               error = NEW.last_error
         WHERE run_id = NEW.id AND attempt = NEW.attempts AND outcome = 'running';
    ELSIF NEW.status <> OLD.status AND NEW.status = 'stale' THEN
        -- A running attempt invalidated by its upstream's new success (or whose
        -- upstream moved on before it committed): it can never commit.
        UPDATE pipeline_run_attempts
           SET outcome = 'fenced', finished_at = clock_timestamp(), error = NEW.last_error
         WHERE run_id = NEW.id AND attempt = NEW.attempts AND outcome = 'running';
    ELSIF NEW.status <> OLD.status AND NEW.status = 'cancelled' THEN
        -- A running attempt of a cancelled run: fenced by the cancel, never commits.
        UPDATE pipeline_run_attempts
           SET outcome = 'cancelled',
               finished_at = greatest(started_at, coalesce(NEW.finished_at, clock_timestamp())),
               error = NEW.last_error
         WHERE run_id = NEW.id AND attempt = NEW.attempts AND outcome = 'running';
    END IF;
    RETURN NULL;
END;
$$;
