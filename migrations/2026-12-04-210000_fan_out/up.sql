-- Fan-out and gather: a stage's success can hand on a list of children; each
-- child is an item of its own (same tenant, an id derived from the parent item,
-- the fan-out stage, its attempt and the child's key), so every stage of a
-- child has its own claim key, fence, fair share, caps and rates. The gather
-- stage runs once per fan-out, on the parent item, when every child is final.
--
-- `fanouts`: one row per fan-out (a fan-out stage's successful attempt for a
-- parent item), written in that attempt's fenced transaction: how many
-- children, how many are final, and `version`, raised whenever a child's
-- outcome is set or changes, so the gather can tell at its commit whether the
-- children it read are still what they are. `fanout_children`: one row per
-- child, with the outcome that made it final (NULL while it runs).
--
-- Counting a child final takes the fan-out's row lock (`idemstage_child_final`),
-- so the children's final commits are ordered and exactly one of them sees the
-- last count: that transaction sends the gather's job. A child whose outcome is
-- set again (an operator's retry of a dead child, a rerun) after the fan-out was
-- complete makes the gather stale: it runs again on the children as they are.
CREATE TABLE fanouts (
    tenant_id      tenant_slug NOT NULL,
    parent_item    ulid_text   NOT NULL,
    stage          stage_name  NOT NULL,
    attempt        integer     NOT NULL CHECK (attempt >= 1),
    gather_stage   stage_name  NOT NULL,
    input_hash     text        NOT NULL,
    children       integer     NOT NULL CHECK (children >= 0),
    final_children integer     NOT NULL DEFAULT 0,
    version        integer     NOT NULL DEFAULT 0,
    created_at     timestamptz NOT NULL DEFAULT now(),
    completed_at   timestamptz,
    superseded_at  timestamptz,
    PRIMARY KEY (tenant_id, parent_item, stage, attempt),
    CONSTRAINT fanouts_count_ck CHECK (final_children BETWEEN 0 AND children)
);

CREATE TABLE fanout_children (
    tenant_id    tenant_slug NOT NULL,
    item_id      ulid_text   NOT NULL,
    parent_item  ulid_text   NOT NULL,
    stage        stage_name  NOT NULL,
    attempt      integer     NOT NULL,
    child_key    text        NOT NULL CHECK (length(child_key) BETWEEN 1 AND 200),
    position     integer     NOT NULL,
    outcome      text
        CONSTRAINT fanout_children_outcome_check
        CHECK (outcome IN ('success', 'stopped', 'dead', 'cancelled')),
    final_stage  stage_name,
    finished_at  timestamptz,
    PRIMARY KEY (tenant_id, item_id),
    CONSTRAINT fanout_children_key_uq UNIQUE (tenant_id, parent_item, stage, attempt, child_key),
    CONSTRAINT fanout_children_fanout_fk FOREIGN KEY (tenant_id, parent_item, stage, attempt)
        REFERENCES fanouts (tenant_id, parent_item, stage, attempt),
    CONSTRAINT fanout_children_item_fk FOREIGN KEY (tenant_id, item_id)
        REFERENCES items (tenant_id, id)
);

-- A child's outcome is set (`p_outcome`, by the stage `p_stage` of the child
-- item `p_item`). Locks the fan-out's row first (the order every child takes),
-- then sets the child's outcome and counts it if it was not final before.
-- Returns the fan-out (one row, none for an item that is no child): whether it
-- is complete now, whether this call completed it, and whether the child was
-- final before (`recount`). A recount of a complete fan-out makes the gather
-- stage's run `stale` (and everything computed from it): what it read changed.
CREATE FUNCTION idemstage_child_final(p_tenant text, p_item text, p_outcome text, p_stage text)
RETURNS TABLE (parent_item text, stage text, attempt integer, gather_stage text,
               input_hash text, complete boolean, completed_now boolean, recount boolean,
               superseded boolean)
LANGUAGE plpgsql AS $$
DECLARE
    c public.fanout_children%ROWTYPE;
    f public.fanouts%ROWTYPE;
BEGIN
    SELECT * INTO c FROM public.fanout_children x
     WHERE x.tenant_id = p_tenant AND x.item_id = p_item;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT * INTO f FROM public.fanouts y
     WHERE y.tenant_id = c.tenant_id AND y.parent_item = c.parent_item
       AND y.stage = c.stage AND y.attempt = c.attempt;
    -- The gather's run before the fan-out's row: the gather's own commit
    -- takes them in this order (its fence, then its check of the version).
    PERFORM 1 FROM public.stage_runs r
     WHERE r.tenant_id = f.tenant_id AND r.item_id = f.parent_item AND r.stage = f.gather_stage
       FOR UPDATE;
    SELECT * INTO f FROM public.fanouts y
     WHERE y.tenant_id = c.tenant_id AND y.parent_item = c.parent_item
       AND y.stage = c.stage AND y.attempt = c.attempt
       FOR UPDATE;
    -- Read again under the fan-out's lock: another final of this child may
    -- have committed while this one waited.
    SELECT * INTO c FROM public.fanout_children x
     WHERE x.tenant_id = p_tenant AND x.item_id = p_item;
    UPDATE public.fanout_children x
       SET outcome = p_outcome, final_stage = p_stage, finished_at = clock_timestamp()
     WHERE x.tenant_id = p_tenant AND x.item_id = p_item;
    UPDATE public.fanouts y
       SET final_children = y.final_children + CASE WHEN c.outcome IS NULL THEN 1 ELSE 0 END,
           version = y.version + 1,
           completed_at = CASE WHEN c.outcome IS NULL AND y.final_children + 1 = y.children
                               THEN clock_timestamp() ELSE y.completed_at END
     WHERE y.tenant_id = f.tenant_id AND y.parent_item = f.parent_item
       AND y.stage = f.stage AND y.attempt = f.attempt
    RETURNING * INTO f;
    IF c.outcome IS NOT NULL AND f.completed_at IS NOT NULL AND f.superseded_at IS NULL THEN
        -- Its next success on the same fan-out is asked for, not a double
        -- execution: recorded as a rerun (`stage_reruns`, which the checkers
        -- read).
        WITH stale AS (
        UPDATE public.stage_runs r
           SET status = CASE WHEN r.status = 'cancelled' THEN 'cancelled' ELSE 'stale' END,
               last_error = CASE WHEN r.status = 'cancelled' THEN r.last_error
                                 ELSE 'child ' || c.child_key || ' of the fan-out ended again ('
                                      || p_outcome || ')' END,
               success_attempt = NULL,
               lease_expires_at = least(r.lease_expires_at, clock_timestamp())
         WHERE r.tenant_id = f.tenant_id AND r.item_id = f.parent_item
           AND r.stage = f.gather_stage AND r.upstream_attempt = f.attempt
           AND r.status <> 'stale' AND NOT (r.status = 'cancelled' AND r.success_attempt IS NULL)
        RETURNING r.tenant_id, r.id, r.attempts)
        INSERT INTO public.stage_reruns (tenant_id, run_id, after_attempt, actor)
        SELECT stale.tenant_id, stale.id, stale.attempts,
               'fan-out: child ' || c.child_key || ' ended again'
          FROM stale
        ON CONFLICT DO NOTHING;
        -- And what was computed from the gather (INVALIDATE_DOWNSTREAM's rule).
        WITH RECURSIVE downstream AS (
            SELECT d.stage FROM public.stage_runs d
             WHERE d.tenant_id = f.tenant_id AND d.item_id = f.parent_item
               AND d.upstream_stage = f.gather_stage
            UNION
            SELECT d.stage FROM public.stage_runs d JOIN downstream ON d.upstream_stage = downstream.stage
             WHERE d.tenant_id = f.tenant_id AND d.item_id = f.parent_item
        )
        UPDATE public.stage_runs r
           SET status = CASE WHEN r.status = 'cancelled' THEN 'cancelled' ELSE 'stale' END,
               last_error = CASE WHEN r.status = 'cancelled' THEN r.last_error
                                 ELSE 'upstream stage ' || f.gather_stage || ' runs again' END,
               success_attempt = NULL,
               lease_expires_at = least(r.lease_expires_at, clock_timestamp())
         WHERE r.tenant_id = f.tenant_id AND r.item_id = f.parent_item
           AND r.stage IN (SELECT d.stage FROM downstream d)
           AND r.status <> 'stale' AND NOT (r.status = 'cancelled' AND r.success_attempt IS NULL);
    END IF;
    -- The parent is one to look at again: its gather is expected now (the
    -- reconciler sends its job if the caller does not, or crashed first).
    IF f.completed_at IS NOT NULL AND f.superseded_at IS NULL THEN
        PERFORM public.idemstage_open_item(f.tenant_id, f.parent_item);
    END IF;
    parent_item := f.parent_item;
    stage := f.stage;
    attempt := f.attempt;
    gather_stage := f.gather_stage;
    input_hash := f.input_hash;
    complete := f.completed_at IS NOT NULL;
    completed_now := c.outcome IS NULL AND f.final_children = f.children;
    recount := c.outcome IS NOT NULL;
    superseded := f.superseded_at IS NOT NULL;
    RETURN NEXT;
END;
$$;

-- A child's stage that ends `dead` or `cancelled` (on any path: its last
-- attempt failed, its budget ran out, an operator cancelled it, its wait timed
-- out) makes the child final. A success is counted by the executor in the
-- stage's fenced transaction (it knows which stage is the child's last, and
-- sends the gather's job when it completed the fan-out). Only these rare
-- transitions fire it: a completion does not.
CREATE FUNCTION idemstage_child_ended() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM public.idemstage_child_final(NEW.tenant_id, NEW.item_id, NEW.status, NEW.stage);
    RETURN NULL;
END;
$$;

CREATE TRIGGER stage_runs_child_ended
    AFTER UPDATE OF status ON stage_runs
    FOR EACH ROW
    WHEN (NEW.status IN ('dead', 'cancelled') AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION idemstage_child_ended();
CREATE TRIGGER stage_runs_child_created_ended
    AFTER INSERT ON stage_runs
    FOR EACH ROW
    WHEN (NEW.status IN ('dead', 'cancelled'))
    EXECUTE FUNCTION idemstage_child_ended();

GRANT SELECT, INSERT, UPDATE ON fanouts, fanout_children TO idemstage_app;
GRANT SELECT ON fanouts, fanout_children TO idemstage_operator;
GRANT EXECUTE ON FUNCTION idemstage_child_final(text, text, text, text) TO idemstage_app;

ALTER TABLE fanouts ENABLE ROW LEVEL SECURITY;
ALTER TABLE fanouts FORCE ROW LEVEL SECURITY;
ALTER TABLE fanout_children ENABLE ROW LEVEL SECURITY;
ALTER TABLE fanout_children FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON fanouts TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY operator_read ON fanouts FOR SELECT TO idemstage_operator USING (true);
CREATE POLICY tenant_isolation ON fanout_children TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY operator_read ON fanout_children FOR SELECT TO idemstage_operator USING (true);
