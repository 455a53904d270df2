-- Operator reruns, one item or many at once.
--
-- `stage_reruns`: a success made not current by an operator (`idemstage rerun`),
-- so that the stage runs again on the same input and upstream attempt. The claim
-- admits such a run as it admits any `stale` one (no current success to compare
-- with); this row is what makes the second success on the same input a rerun
-- somebody asked for, not a double execution: the checker excuses a repeated
-- success only across a row here (`after_attempt`: the run's attempts when the
-- rerun was asked for). Append-only, like the audit trail.
CREATE TABLE stage_reruns (
    tenant_id     tenant_slug NOT NULL,
    run_id        ulid_text   NOT NULL,
    after_attempt integer     NOT NULL CHECK (after_attempt >= 1),
    actor         text        NOT NULL,
    bulk_id       ulid_text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, after_attempt),
    CONSTRAINT stage_reruns_run_fk FOREIGN KEY (tenant_id, run_id)
        REFERENCES stage_runs (tenant_id, id)
);

-- A rerun, retry or cancel of many items (`idemstage rerun|retry|cancel` with
-- filters): what it selects (`filter`, kept so that a resumed run selects the
-- same), who asked, and how far it got. The items are taken in (tenant, item)
-- order, a batch at a time; each batch's writes and the move of `done_tenant`/
-- `done_item` past it commit in one transaction, so a run resumed after a crash
-- starts after the last committed batch and acts on no item twice. Across
-- tenants (an operator's), so no row-level security: only the operator writes it.
CREATE TABLE bulk_actions (
    id          ulid_text   NOT NULL PRIMARY KEY,
    action      text        NOT NULL
        CONSTRAINT bulk_actions_action_check CHECK (action IN ('rerun', 'retry', 'cancel')),
    filter      jsonb       NOT NULL,
    actor       text        NOT NULL,
    batch_size  integer     NOT NULL CHECK (batch_size BETWEEN 1 AND 10000),
    done_tenant text,
    done_item   text,
    selected    integer     NOT NULL DEFAULT 0,
    acted       integer     NOT NULL DEFAULT 0,
    batches     integer     NOT NULL DEFAULT 0,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    CONSTRAINT bulk_actions_done_ck CHECK ((done_tenant IS NULL) = (done_item IS NULL))
);

GRANT SELECT, INSERT ON stage_reruns TO idemstage_app;
GRANT SELECT ON stage_reruns TO idemstage_operator;
GRANT SELECT, INSERT, UPDATE ON bulk_actions TO idemstage_operator;

ALTER TABLE stage_reruns ENABLE ROW LEVEL SECURITY;
ALTER TABLE stage_reruns FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON stage_reruns TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY operator_read ON stage_reruns FOR SELECT TO idemstage_operator USING (true);
