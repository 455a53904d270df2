-- The first schema of idemstage. Table and column names follow the seed so that
-- invariants can be checked with plain SQL. Ids are ULIDs stored as text
-- (26 characters of Crockford base32); tenants are slugs.

CREATE DOMAIN ulid_text AS text
    CHECK (VALUE ~ '^[0-7][0-9A-HJKMNP-TV-Z]{25}$');
CREATE DOMAIN tenant_slug AS text
    CHECK (VALUE ~ '^[a-z0-9][a-z0-9_-]{0,62}$');
CREATE DOMAIN stage_name AS text
    CHECK (VALUE ~ '^[a-z][a-z0-9_]{0,62}$');

CREATE TABLE anfragen (
    tenant_id    tenant_slug NOT NULL,
    id           ulid_text   NOT NULL PRIMARY KEY,
    input_text   text        NOT NULL,
    input_sha256 text        NOT NULL CHECK (input_sha256 ~ '^[0-9a-f]{64}$'),
    s3_key       text        NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    -- An anfrage id is global: the same id under another tenant is refused by the
    -- primary key, and children reference (tenant_id, id) so they cannot cross tenants.
    CONSTRAINT anfragen_tenant_id_uq UNIQUE (tenant_id, id)
);

-- Layer 1: the claim. One row per (tenant, anfrage, stage), never deleted.
-- status:
--   running  a worker holds the lease until lease_expires_at
--   success  final; the stage's results are committed (fenced by attempts)
--   failed   the last attempt failed; claimable again while attempts < max_attempts
--   dead     failed with attempts = max_attempts; final, never claimed again
--   stale    an upstream stage re-ran with new input; claimable again
CREATE TABLE pipeline_runs (
    id               ulid_text   NOT NULL PRIMARY KEY,
    tenant_id        tenant_slug NOT NULL,
    anfrage_id       ulid_text   NOT NULL,
    stage            stage_name  NOT NULL,
    status           text        NOT NULL
        CHECK (status IN ('running', 'success', 'failed', 'dead', 'stale')),
    attempts         integer     NOT NULL CHECK (attempts >= 1),
    max_attempts     integer     NOT NULL CHECK (max_attempts >= 1),
    input_hash       text        NOT NULL,
    worker_id        text        NOT NULL,
    started_at       timestamptz NOT NULL,
    lease_expires_at timestamptz NOT NULL,
    finished_at      timestamptz,
    last_error       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT pipeline_runs_anfrage_fk FOREIGN KEY (tenant_id, anfrage_id)
        REFERENCES anfragen (tenant_id, id),
    CONSTRAINT pipeline_runs_attempts_le_max CHECK (attempts <= max_attempts)
);
CREATE UNIQUE INDEX pipeline_runs_tenant_anfrage_stage_uq
    ON pipeline_runs (tenant_id, anfrage_id, stage);

-- Attempt history: one row per attempt, written by a trigger on pipeline_runs so
-- that no code path can claim without leaving a row. A row is inserted when an
-- attempt starts and its outcome is filled in once when the attempt ends.
CREATE TABLE pipeline_run_attempts (
    run_id      ulid_text   NOT NULL REFERENCES pipeline_runs (id),
    attempt     integer     NOT NULL CHECK (attempt >= 1),
    tenant_id   tenant_slug NOT NULL,
    worker_id   text        NOT NULL,
    input_hash  text        NOT NULL,
    started_at  timestamptz NOT NULL,
    finished_at timestamptz,
    outcome     text        NOT NULL DEFAULT 'running'
        CHECK (outcome IN ('running', 'success', 'failed', 'abandoned', 'fenced')),
    error       text,
    PRIMARY KEY (run_id, attempt)
);

CREATE FUNCTION pipeline_runs_record_attempt() RETURNS trigger
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
            (run_id, attempt, tenant_id, worker_id, input_hash, started_at)
        VALUES (NEW.id, NEW.attempts, NEW.tenant_id, NEW.worker_id, NEW.input_hash, NEW.started_at);
    ELSIF NEW.status <> OLD.status AND NEW.status IN ('success', 'failed', 'dead') THEN
        UPDATE pipeline_run_attempts
           SET outcome = CASE WHEN NEW.status = 'success' THEN 'success' ELSE 'failed' END,
               finished_at = now(),
               error = NEW.last_error
         WHERE run_id = NEW.id AND attempt = NEW.attempts AND outcome = 'running';
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER pipeline_runs_record_attempt
    AFTER INSERT OR UPDATE ON pipeline_runs
    FOR EACH ROW EXECUTE FUNCTION pipeline_runs_record_attempt();

-- Layer 2: the job queue.
-- state: created -> active -> completed | retry -> active ... | failed | cancelled
CREATE TABLE jobs (
    id               ulid_text   NOT NULL PRIMARY KEY,
    queue            text        NOT NULL CHECK (queue ~ '^[A-Za-z0-9_.:-]{1,100}$'),
    state            text        NOT NULL DEFAULT 'created'
        CHECK (state IN ('created', 'retry', 'active', 'completed', 'cancelled', 'failed')),
    priority         integer     NOT NULL DEFAULT 0,
    payload          jsonb       NOT NULL,
    singleton_key    text,
    -- Start of the throttle window for singleton_seconds; NULL when not throttled.
    singleton_on     timestamptz,
    retry_limit      integer     NOT NULL DEFAULT 2 CHECK (retry_limit >= 0),
    retry_count      integer     NOT NULL DEFAULT 0 CHECK (retry_count >= 0),
    retry_delay_ms   bigint      NOT NULL DEFAULT 0 CHECK (retry_delay_ms >= 0),
    retry_backoff    boolean     NOT NULL DEFAULT false,
    retry_delay_max_ms bigint,
    expire_in_ms     bigint      NOT NULL DEFAULT 900000 CHECK (expire_in_ms > 0),
    -- Fencing token of the job lease: incremented on every fetch.
    attempt          integer     NOT NULL DEFAULT 0,
    start_after      timestamptz NOT NULL DEFAULT now(),
    started_at       timestamptz,
    lease_expires_at timestamptz,
    completed_at     timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    dead_letter      text,
    output           jsonb,
    last_error       text
);
-- At most one live job per (queue, singleton_key); the ON CONFLICT of send names this
-- index's columns and predicate explicitly.
CREATE UNIQUE INDEX jobs_singleton_live_uq ON jobs (queue, singleton_key)
    WHERE singleton_key IS NOT NULL AND state IN ('created', 'retry', 'active');
-- Throttle: at most one job per (queue, key, window), whatever its state.
CREATE UNIQUE INDEX jobs_singleton_window_uq ON jobs (queue, singleton_key, singleton_on)
    WHERE singleton_on IS NOT NULL;
CREATE INDEX jobs_fetch_idx ON jobs (queue, priority DESC, id)
    WHERE state IN ('created', 'retry');
CREATE INDEX jobs_lease_idx ON jobs (lease_expires_at) WHERE state = 'active';
CREATE INDEX jobs_completed_idx ON jobs (completed_at)
    WHERE state IN ('completed', 'cancelled', 'failed');

CREATE TABLE audit_log (
    id         ulid_text   NOT NULL PRIMARY KEY,
    tenant_id  tenant_slug NOT NULL,
    entity_id  text        NOT NULL,
    action     text        NOT NULL,
    run_id     ulid_text,
    attempt    integer,
    details    jsonb       NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX audit_log_tenant_entity_idx ON audit_log (tenant_id, entity_id);
