-- The typed stage contract (issue 30): a stage's output travels with the attempt
-- that produced it, and a prepared value (a paid external call) survives the
-- attempt that paid for it.
--
-- 1. pipeline_runs.output: what the stage's successful attempt returned (JSON),
--    written in the fenced transaction that marks it `success`, so it always
--    belongs to `success_attempt`. The next stage reads its upstream's output
--    where `success_attempt` is the attempt its own run is bound to
--    (`upstream_attempt`): an upstream that succeeded again since has no output
--    for that attempt, and the reader is stale, never handed the newer output.
ALTER TABLE pipeline_runs ADD COLUMN output jsonb;

-- 2. stage_checkpoints: the value a stage's `prepare` returned (an LLM's answer),
--    with the binding it was computed from (the run's input hash and upstream
--    attempt). The next attempt of the same run reuses it when its binding is the
--    same, instead of paying for the call again (a commit that failed, a worker
--    that died, a lease lost after `prepare`); a changed input or upstream never
--    matches. One row per run, replaced by each attempt that prepares anew, and
--    deleted by the success that used it.
CREATE TABLE stage_checkpoints (
    run_id           ulid_text   NOT NULL PRIMARY KEY
                                 REFERENCES pipeline_runs (id) ON DELETE CASCADE,
    tenant_id        tenant_slug NOT NULL,
    input_hash       text        NOT NULL,
    upstream_attempt integer,
    attempt          integer     NOT NULL,
    prepared         jsonb       NOT NULL,
    written_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Under the runs' isolation: the scoped role of the run's tenant, operators read.
GRANT SELECT, INSERT, UPDATE, DELETE ON stage_checkpoints TO idemstage_app;
GRANT SELECT ON stage_checkpoints TO idemstage_operator;
ALTER TABLE stage_checkpoints ENABLE ROW LEVEL SECURITY;
ALTER TABLE stage_checkpoints FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON stage_checkpoints TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY operator_read ON stage_checkpoints FOR SELECT TO idemstage_operator USING (true);
