-- Ready floors: the fetch reads each lane of ready jobs from a floor, not from
-- the start of the lane (issue 31; docs/storage-under-pressure.md).
--
-- While a transaction holds the cluster's xmin, the ready-index entry of every
-- job the fetch leased since stays in the index: the lease changes `state`, the
-- index's predicate column, so it is no HOT update, and no scan may mark the old
-- entry dead while the held snapshot still sees that version as ready. Each
-- fetch walked all of them, from the start of each tenant's range, on every
-- call. Now:
--
-- * `ready_seq` orders a lane: drawn from a sequence when a job is sent and
--   again each time it becomes ready (retried, deferred, released, taken back,
--   retried by an operator), so that a lane's spent entries sort before its
--   ready ones.
-- * `job_lanes` lists every (queue, tenant, priority) a job was ever sent to,
--   with its `floor`: no ready, due job of the lane sorts below it (but see
--   below). The fetch finds the queue's tenants from these rows (not by walking
--   the index) and reads each lane from its floor.
-- * `idemstage_advance_floors`, run about once a second by one worker (an
--   advisory lock), moves each floor up to the lane's first ready job due
--   within the horizon, never past the sequence's value at its previous run:
--   a job whose sequence number was drawn after that run is above the floor.
--   It raises a floor at most once per `p_raise_every_ms` (each raise is a row
--   version, and a held snapshot keeps those too) and lowers one only to a
--   ready job below it, at once: a job deferred past the horizon and now due,
--   or one whose transaction ran longer than a whole period between two runs.
--   Such a job waits for the next run, never longer; nothing else moves a
--   floor, and without runs every floor stays where it is (a job sent after
--   the last run is above it).

CREATE SEQUENCE jobs_ready_seq;

ALTER TABLE jobs ADD COLUMN ready_seq bigint NOT NULL DEFAULT nextval('jobs_ready_seq');
ALTER SEQUENCE jobs_ready_seq OWNED BY jobs.ready_seq;

DROP INDEX jobs_fetch_idx;
CREATE INDEX jobs_ready_idx ON jobs (queue, tenant_id, priority DESC, ready_seq)
    WHERE state IN ('created', 'retry');

CREATE TABLE job_lanes (
    queue     text        NOT NULL,
    tenant_id text        NOT NULL,
    priority  integer     NOT NULL,
    floor     bigint      NOT NULL DEFAULT 0,
    -- When the floor was last raised (a raise is a row version: at most one per
    -- p_raise_every_ms).
    floor_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, tenant_id, priority)
);

INSERT INTO job_lanes (queue, tenant_id, priority)
SELECT DISTINCT queue, tenant_id, priority FROM jobs;

-- A job sent: its lane exists when it commits (one statement per INSERT, not one
-- per row: a batch send pays once). In a fixed order, so that two transactions
-- creating the same new lanes wait for each other instead of deadlocking.
CREATE FUNCTION idemstage_jobs_lanes() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.job_lanes (queue, tenant_id, priority)
    SELECT DISTINCT n.queue, n.tenant_id, n.priority FROM sent_jobs n
     ORDER BY 1, 2, 3
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END;
$$;

CREATE TRIGGER jobs_lanes
    AFTER INSERT ON jobs REFERENCING NEW TABLE AS sent_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION idemstage_jobs_lanes();

-- A job ready again: the back of its lane, above any floor, on every path (the
-- library's, an operator's, a hand-written UPDATE). Its lane is made sure of
-- too: a job sent to a lane before this migration may come back after it. The
-- WHEN keeps the trigger off the lease and the completion. A ready job moved in
-- time keeps its place (one brought forward is still first); if it is below its
-- floor when it comes due, the next run of the floors lowers the floor.
CREATE FUNCTION idemstage_jobs_ready_again() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.ready_seq := pg_catalog.nextval('public.jobs_ready_seq');
    INSERT INTO public.job_lanes (queue, tenant_id, priority)
    VALUES (NEW.queue, NEW.tenant_id, NEW.priority)
    ON CONFLICT DO NOTHING;
    RETURN NEW;
END;
$$;

CREATE TRIGGER jobs_ready_again
    BEFORE UPDATE OF state, queue, tenant_id, priority ON jobs
    FOR EACH ROW
    WHEN (NEW.state IN ('created', 'retry')
          AND (OLD.state NOT IN ('created', 'retry')
               OR (NEW.queue, NEW.tenant_id, NEW.priority)
                  IS DISTINCT FROM (OLD.queue, OLD.tenant_id, OLD.priority)))
    EXECUTE FUNCTION idemstage_jobs_ready_again();

-- The lanes of `v_queue` with a ready, due job at or above the floor, each with
-- that job's sequence number (the lane's head). SQL, so that the planner inlines
-- it into the fetch's statement.
CREATE FUNCTION idemstage_lane_heads(v_queue text)
RETURNS TABLE (tenant_id text, priority integer, floor bigint, head bigint)
LANGUAGE sql STABLE AS $$
    SELECT l.tenant_id, l.priority, l.floor, h.ready_seq
      FROM public.job_lanes l
      CROSS JOIN LATERAL (
          SELECT j.ready_seq FROM public.jobs j
           WHERE j.queue = v_queue AND j.tenant_id = l.tenant_id AND j.priority = l.priority
             AND j.state IN ('created', 'retry') AND j.ready_seq >= l.floor
             AND j.start_after <= now()
           ORDER BY j.ready_seq
           LIMIT 1) h
     WHERE l.queue = v_queue
$$;

-- One run of the floors (see the top). `p_mark`: what the previous run returned
-- (NULL: none, so this run only lowers); returns the mark for the next run.
CREATE FUNCTION idemstage_advance_floors(p_mark bigint, p_horizon_ms bigint,
                                         p_raise_every_ms bigint)
RETURNS bigint
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
DECLARE
    v_mark bigint;
BEGIN
    -- One run at a time ("idemflor"); the others keep their mark.
    IF NOT pg_try_advisory_xact_lock(7594869008633097330) THEN
        RETURN p_mark;
    END IF;
    -- Read before the lanes: a number drawn after this read is above every
    -- floor the next run sets.
    SELECT s.last_value INTO v_mark FROM jobs_ready_seq s;
    -- Per lane: its first ready job due within the horizon (`first`), and the
    -- floor it may rise to (`up`: never above the previous mark). Lowered only
    -- when a ready job is below it (so that a run with an older mark, of another
    -- worker, does not pull floors down); raised at most every p_raise_every_ms,
    -- and only when the lane has a ready job or was worked lately (`busy`: a job
    -- leased now or finished within the window): a raise is a row version, and
    -- an idle lane has nothing new below its mark to skip.
    WITH busy AS (
        SELECT j.queue, j.tenant_id, j.priority FROM jobs j
         WHERE j.lease_expires_at IS NOT NULL
        UNION
        SELECT j.queue, j.tenant_id, j.priority FROM jobs j
         WHERE j.state IN ('completed', 'cancelled', 'failed')
           AND j.completed_at > now() - (p_raise_every_ms + p_horizon_ms) * interval '1 millisecond'
    )
    UPDATE job_lanes l
       SET floor = CASE WHEN n.first < l.floor THEN n.first ELSE n.up END,
           floor_at = CASE WHEN n.first < l.floor THEN l.floor_at ELSE clock_timestamp() END
      FROM (SELECT f.queue, f.tenant_id, f.priority, f.first,
                   CASE WHEN p_mark IS NOT NULL
                        THEN least(p_mark, coalesce(f.first, p_mark)) END AS up
              FROM (SELECT o.queue, o.tenant_id, o.priority,
                           (SELECT j.ready_seq FROM jobs j
                             WHERE j.queue = o.queue AND j.tenant_id = o.tenant_id
                               AND j.priority = o.priority
                               AND j.state IN ('created', 'retry')
                               AND j.start_after <= now() + p_horizon_ms * interval '1 millisecond'
                             ORDER BY j.ready_seq
                             LIMIT 1) AS first
                      FROM job_lanes o) f) n
     WHERE l.queue = n.queue AND l.tenant_id = n.tenant_id AND l.priority = n.priority
       AND (n.first < l.floor
            OR (n.up > l.floor
                AND l.floor_at <= clock_timestamp() - p_raise_every_ms * interval '1 millisecond'
                AND (n.first IS NOT NULL
                     OR EXISTS (SELECT 1 FROM busy b
                                 WHERE b.queue = l.queue AND b.tenant_id = l.tenant_id
                                   AND b.priority = l.priority))));
    RETURN v_mark;
END;
$$;

CREATE OR REPLACE FUNCTION idemstage_fetch_plain(v_queue text, v_n integer)
RETURNS TABLE (id text, queue text, tenant_id text, payload text, priority integer,
               singleton_key text, attempt integer, retry_count integer,
               retry_limit integer, expire_in_ms bigint, lease_expires_at timestamptz,
               created_at timestamptz, last_error text)
LANGUAGE plpgsql
VOLATILE
SET search_path = public, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_tenants text[];
    v_priorities integer[];
    v_floors bigint[];
    v_heads bigint[];
BEGIN
    -- The lanes with a ready job, read once: nothing ready costs one probe per
    -- lane of the queue.
    SELECT array_agg(h.tenant_id), array_agg(h.priority), array_agg(h.floor),
           array_agg(h.head)
      INTO v_tenants, v_priorities, v_floors, v_heads
      FROM idemstage_lane_heads(v_queue) h;
    IF v_tenants IS NULL THEN
        RETURN;
    END IF;
    -- One tenant with ready jobs: no shares to compute, its jobs in order (what
    -- the fair query returns for one tenant, without its ~1 ms of CTEs). A job
    -- of another tenant sent meanwhile waits for the next fetch, as it would
    -- behind this fetch's snapshot anyway.
    IF v_tenants[1] = ALL (v_tenants) THEN
        RETURN QUERY
        WITH next AS (
            SELECT c.ctid, c.priority, c.ready_seq
              FROM unnest(v_priorities, v_floors) AS l(priority, floor)
              CROSS JOIN LATERAL (
                  SELECT j.ctid, j.priority, j.ready_seq FROM jobs j
                   WHERE j.queue = v_queue AND j.tenant_id = v_tenants[1]
                     AND j.priority = l.priority AND j.state IN ('created', 'retry')
                     AND j.ready_seq >= l.floor AND j.start_after <= now()
                   ORDER BY j.ready_seq
                   LIMIT v_n
                   FOR UPDATE SKIP LOCKED) c
             ORDER BY c.priority DESC, c.ready_seq
             LIMIT v_n
        ), leased AS (
            UPDATE jobs j
               SET state = 'active',
                   attempt = j.attempt + 1,
                   started_at = now(),
                   lease_expires_at = now() + j.expire_in_ms * interval '1 millisecond'
             WHERE j.ctid = ANY(ARRAY(SELECT ctid FROM next))
            RETURNING j.id, j.queue, j.tenant_id, j.payload::text AS payload, j.priority,
                      j.singleton_key, j.attempt, j.retry_count, j.retry_limit,
                      j.expire_in_ms, j.lease_expires_at, j.created_at, j.last_error,
                      j.ready_seq
        )
        SELECT l.id::text, l.queue, l.tenant_id, l.payload, l.priority, l.singleton_key,
               l.attempt, l.retry_count, l.retry_limit, l.expire_in_ms, l.lease_expires_at,
               l.created_at, l.last_error
          FROM leased l
         ORDER BY l.priority DESC, l.ready_seq;
        RETURN;
    END IF;
    -- Several tenants: the fair query, over the lanes read above.
    RETURN QUERY
    WITH lanes AS (
        SELECT * FROM unnest(v_tenants, v_priorities, v_floors, v_heads)
                 AS l(tenant_id, priority, floor, head)
    ), heads AS (
        -- A tenant's head is the head of its highest lane.
        SELECT DISTINCT ON (l.tenant_id) l.tenant_id, l.priority, l.head
          FROM lanes l
         ORDER BY l.tenant_id, l.priority DESC, l.head
    ), fair AS (
        SELECT t.tenant_id,
               row_number() OVER (ORDER BY t.priority DESC, t.head) AS turn,
               count(*) OVER () AS tenants,
               ceil(v_n::numeric / count(*) OVER ())::integer AS share
          FROM (SELECT * FROM heads h ORDER BY h.priority DESC, h.head LIMIT v_n) t
    ), avail AS (
        -- What each tenant has of its share (read, not locked).
        SELECT f.*,
               least(f.share, (SELECT count(*) FROM lanes l CROSS JOIN LATERAL (
                              SELECT 1 FROM jobs j
                               WHERE j.queue = v_queue AND j.tenant_id = l.tenant_id
                                 AND j.priority = l.priority
                                 AND j.state IN ('created', 'retry')
                                 AND j.ready_seq >= l.floor AND j.start_after <= now()
                               ORDER BY j.ready_seq
                               LIMIT f.share) x
                         WHERE l.tenant_id = f.tenant_id))::integer AS avail
          FROM fair f
    ), shares AS (
        -- The share the tenants with less did not use goes to those with more, so
        -- that a fetch is still full when one tenant has the backlog.
        SELECT a.*,
               CASE WHEN a.avail < a.share THEN a.avail
                    ELSE (a.share + ceil(greatest(v_n - sum(a.avail) OVER (), 0)::numeric
                                          / count(*) FILTER (WHERE a.avail >= a.share) OVER ()
                                    )::integer)
               END AS take
          FROM avail a
    ), candidates AS (
        SELECT c.ctid, c.id, s.turn, s.take,
               row_number() OVER (PARTITION BY s.tenant_id
                                  ORDER BY c.priority DESC, c.ready_seq) AS rank
          FROM shares s
          JOIN lanes l ON l.tenant_id = s.tenant_id
          CROSS JOIN LATERAL (
              SELECT j.ctid, j.id, j.priority, j.ready_seq FROM jobs j
               WHERE j.queue = v_queue AND j.tenant_id = l.tenant_id
                 AND j.priority = l.priority AND j.state IN ('created', 'retry')
                 AND j.ready_seq >= l.floor AND j.start_after <= now()
               ORDER BY j.ready_seq
               LIMIT s.take
               FOR UPDATE SKIP LOCKED) c
    ), next AS (
        SELECT ctid, id, rank, turn FROM candidates
         WHERE rank <= take
         ORDER BY rank, turn LIMIT v_n
    ), leased AS (
        UPDATE jobs j
           SET state = 'active',
               attempt = j.attempt + 1,
               started_at = now(),
               lease_expires_at = now() + j.expire_in_ms * interval '1 millisecond'
         WHERE j.ctid = ANY(ARRAY(SELECT ctid FROM next))
        RETURNING j.id, j.queue, j.tenant_id, j.payload::text AS payload, j.priority,
                  j.singleton_key, j.attempt, j.retry_count, j.retry_limit,
                  j.expire_in_ms, j.lease_expires_at, j.created_at, j.last_error
    )
    -- In fetch order (RETURNING has none): round-robin over the tenants.
    SELECT l.id::text, l.queue, l.tenant_id, l.payload, l.priority, l.singleton_key,
           l.attempt, l.retry_count, l.retry_limit, l.expire_in_ms, l.lease_expires_at,
           l.created_at, l.last_error
      FROM leased l JOIN next n ON n.id = l.id
     ORDER BY n.rank, n.turn;
END
$$;

ALTER FUNCTION idemstage_fetch_plain(text, integer) SET plan_cache_mode = force_generic_plan;

CREATE OR REPLACE FUNCTION idemstage_fetch_controlled(v_queue text, v_n integer)
RETURNS TABLE (id text, queue text, tenant_id text, payload text, priority integer,
               singleton_key text, attempt integer, retry_count integer,
               retry_limit integer, expire_in_ms bigint, lease_expires_at timestamptz,
               created_at timestamptz, last_error text)
LANGUAGE plpgsql
VOLATILE
SET search_path = public, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_tenants text[];
    v_priorities integer[];
    v_floors bigint[];
    v_heads bigint[];
BEGIN
    SELECT array_agg(h.tenant_id), array_agg(h.priority), array_agg(h.floor),
           array_agg(h.head)
      INTO v_tenants, v_priorities, v_floors, v_heads
      FROM idemstage_lane_heads(v_queue) h;
    IF v_tenants IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY
    WITH lanes AS (
        SELECT * FROM unnest(v_tenants, v_priorities, v_floors, v_heads)
                 AS l(tenant_id, priority, floor, head)
    ), tenants AS (
        -- A tenant's head is the head of its highest lane.
        SELECT DISTINCT ON (l.tenant_id) l.tenant_id, l.priority, l.head
          FROM lanes l
         ORDER BY l.tenant_id, l.priority DESC, l.head
    ), ctl AS (
        SELECT t.tenant_id, t.priority, t.head,
               coalesce(s.paused, false) OR coalesce(d.paused, false) AS paused,
               coalesce(s.max_active, d.max_active) AS max_active,
               -- A rate is per tenant; jobs of no tenant have none of their own.
               CASE WHEN t.tenant_id = '' THEN NULL
                    WHEN s.rate_count IS NOT NULL THEN s.rate_count
                    ELSE d.rate_count END AS rate_count,
               CASE WHEN s.rate_count IS NOT NULL THEN s.rate_period_ms
                    ELSE d.rate_period_ms END AS rate_period_ms,
               CASE WHEN s.rate_count IS NOT NULL THEN s.rate_burst
                    ELSE d.rate_burst END AS rate_burst,
               coalesce(s.weight, d.weight, 1) AS weight
          FROM tenants t
          LEFT JOIN queue_controls d ON d.queue = v_queue AND d.scope = '*'
          LEFT JOIN queue_controls s
                 ON s.queue = v_queue AND s.scope = t.tenant_id AND t.tenant_id <> ''
    ), room AS (
        SELECT c.tenant_id, c.priority, c.head, c.weight, c.rate_count, k.tokens, k.at,
               CASE WHEN c.paused THEN 0
                    ELSE least(
                        CASE WHEN c.max_active IS NULL THEN v_n
                             ELSE greatest(c.max_active - (
                                 SELECT count(*) FROM jobs a
                                  WHERE a.queue = v_queue AND a.tenant_id = c.tenant_id
                                    AND a.lease_expires_at IS NOT NULL), 0)
                        END,
                        CASE WHEN k.tokens >= v_n THEN v_n ELSE floor(k.tokens)::integer END)
               END AS room
          FROM ctl c
          LEFT JOIN queue_buckets b ON b.queue = v_queue AND b.tenant_id = c.tenant_id
          CROSS JOIN LATERAL (
              -- The instant the tokens are counted at is the bucket's new
              -- refilled_at: what refilled in between is not lost.
              SELECT idemstage_bucket_tokens(b, c.rate_count, c.rate_period_ms,
                                             c.rate_burst) AS tokens,
                     clock_timestamp() AS at) k
    ), heads AS (
        SELECT r.* FROM room r
         WHERE r.room > 0
         ORDER BY r.priority DESC, r.head
         LIMIT v_n
    ), fair AS (
        SELECT heads.tenant_id, heads.weight, heads.rate_count, heads.tokens, heads.at,
               heads.room,
               row_number() OVER (ORDER BY heads.priority DESC, heads.head) AS turn,
               count(*) OVER () AS tenants,
               least(heads.room,
                     ceil(v_n::numeric * heads.weight / sum(heads.weight) OVER ()))::integer
                   AS share
          FROM heads
    ), avail AS (
        -- What each tenant has of its share (read, not locked; one tenant: all).
        SELECT f.*,
               CASE WHEN f.tenants = 1 THEN f.share
                    ELSE least(f.share, (SELECT count(*) FROM lanes l CROSS JOIN LATERAL (
                              SELECT 1 FROM jobs j
                               WHERE j.queue = v_queue AND j.tenant_id = l.tenant_id
                                 AND j.priority = l.priority
                                 AND j.state IN ('created', 'retry')
                                 AND j.ready_seq >= l.floor AND j.start_after <= now()
                               ORDER BY j.ready_seq
                               LIMIT f.share) x
                         WHERE l.tenant_id = f.tenant_id))::integer
               END AS avail
          FROM fair f
    ), shares AS (
        -- The share the tenants with less did not use goes to those with more, so
        -- that a fetch is still full when one tenant has the backlog.
        SELECT a.*,
               CASE WHEN a.avail < a.share THEN a.avail
                    ELSE least(a.room, (a.share + ceil(greatest(v_n - sum(a.avail) OVER (), 0)::numeric
                                          / count(*) FILTER (WHERE a.avail >= a.share) OVER ()
                                    )::integer))
               END AS take
          FROM avail a
    ), candidates AS (
        SELECT c.ctid, c.id, s.turn, s.weight, s.take,
               row_number() OVER (PARTITION BY s.tenant_id
                                  ORDER BY c.priority DESC, c.ready_seq) AS rank
          FROM shares s
          JOIN lanes l ON l.tenant_id = s.tenant_id
          CROSS JOIN LATERAL (
              SELECT j.ctid, j.id, j.priority, j.ready_seq FROM jobs j
               WHERE j.queue = v_queue AND j.tenant_id = l.tenant_id
                 AND j.priority = l.priority AND j.state IN ('created', 'retry')
                 AND j.ready_seq >= l.floor AND j.start_after <= now()
               ORDER BY j.ready_seq
               LIMIT s.take
               FOR UPDATE SKIP LOCKED) c
    ), next AS (
        -- Weighted round-robin: a tenant of weight w takes w turns per round.
        SELECT ctid, id, rank::float8 / weight AS round, turn FROM candidates
         WHERE rank <= take
         ORDER BY 3, turn LIMIT v_n
    ), leased AS (
        UPDATE jobs j
           SET state = 'active',
               attempt = j.attempt + 1,
               started_at = now(),
               lease_expires_at = now() + j.expire_in_ms * interval '1 millisecond'
         WHERE j.ctid = ANY(ARRAY(SELECT ctid FROM next))
        RETURNING j.id, j.queue, j.tenant_id, j.payload::text AS payload, j.priority,
                  j.singleton_key, j.attempt, j.retry_count, j.retry_limit,
                  j.expire_in_ms, j.lease_expires_at, j.created_at, j.last_error
    ), spent AS (
        INSERT INTO queue_buckets AS b (queue, tenant_id, tokens, refilled_at)
        SELECT v_queue, s.tenant_id, s.tokens - n.leased, s.at
          FROM (SELECT l.tenant_id, count(*) AS leased FROM leased l GROUP BY l.tenant_id) n
          JOIN shares s ON s.tenant_id = n.tenant_id
         WHERE s.rate_count IS NOT NULL
        ON CONFLICT (queue, tenant_id) DO UPDATE
           SET tokens = excluded.tokens, refilled_at = excluded.refilled_at
    )
    SELECT l.id::text, l.queue, l.tenant_id, l.payload, l.priority, l.singleton_key,
           l.attempt, l.retry_count, l.retry_limit, l.expire_in_ms, l.lease_expires_at,
           l.created_at, l.last_error
      FROM leased l JOIN next n ON n.id = l.id
     ORDER BY n.round, n.turn;
END
$$;

ALTER FUNCTION idemstage_fetch_controlled(text, integer) SET plan_cache_mode = force_generic_plan;

-- As before, with "a ready job" read from the lanes' heads.
CREATE OR REPLACE FUNCTION idemstage_fetch_wait(p_queues text[])
RETURNS bigint
LANGUAGE sql STABLE
AS $$
WITH waiting AS (
    -- Queues under a control (or a hold) with ready jobs, not paused as a whole.
    -- The control and bucket rows are probed first: a queue without any (the
    -- common case, asked after every short fetch) costs two key lookups.
    SELECT q.queue FROM unnest(p_queues) AS q(queue)
     WHERE (EXISTS (SELECT 1 FROM queue_controls c WHERE c.queue = q.queue)
            OR EXISTS (SELECT 1 FROM queue_buckets b WHERE b.queue = q.queue))
       AND EXISTS (SELECT 1 FROM idemstage_lane_heads(q.queue))
       AND NOT EXISTS (SELECT 1 FROM queue_controls c
                        WHERE c.queue = q.queue AND c.scope = '' AND c.paused)
), capped AS (
    SELECT 20::float8 AS ms FROM waiting w
     WHERE EXISTS (SELECT 1 FROM queue_controls c
                    WHERE c.queue = w.queue AND c.max_active IS NOT NULL)
), buckets AS (
    -- Each bucket with the rate that applies to it: the queue's for '', else the
    -- tenant's own or every tenant's.
    SELECT b, coalesce(own.rate_count, every.rate_count) AS rate_count,
           coalesce(own.rate_period_ms, every.rate_period_ms) AS rate_period_ms,
           CASE WHEN own.rate_count IS NOT NULL THEN own.rate_burst
                ELSE every.rate_burst END AS rate_burst
      FROM waiting w
      JOIN queue_buckets b ON b.queue = w.queue
      LEFT JOIN queue_controls own
             ON own.queue = b.queue AND own.scope = b.tenant_id AND own.rate_count IS NOT NULL
      LEFT JOIN queue_controls every
             ON every.queue = b.queue AND every.scope = '*' AND b.tenant_id <> ''
), refills AS (
    SELECT CASE
        WHEN (k.b).held_until > clock_timestamp()
            THEN extract(epoch FROM (k.b).held_until - clock_timestamp()) * 1000
        WHEN k.rate_count IS NULL THEN NULL
        ELSE (1 - idemstage_bucket_tokens(k.b, k.rate_count, k.rate_period_ms, k.rate_burst))
             * k.rate_period_ms / k.rate_count
    END AS ms
      FROM buckets k
)
-- A bucket that has refilled a token since the fetch counted (the fetch took
-- that long) waits 0: fetch again soon. (greatest() skips NULLs: without the
-- CASE, no wait at all would read as 10 ms.)
SELECT CASE WHEN min(ms) IS NULL THEN NULL ELSE greatest(10, ceil(min(ms)))::bigint END
  FROM (SELECT ms FROM capped UNION ALL SELECT ms FROM refills WHERE ms IS NOT NULL) x
$$;

-- Grants and row-level security as for jobs: a lane is created by whoever sends
-- or readies a job of it and read by the fetch; only the worker (the floors'
-- run) changes its floor, and nobody deletes one (a job of a missing lane would
-- not be fetched). The worker may delete jobs too: it is trusted with the queue.
GRANT USAGE ON SEQUENCE jobs_ready_seq TO idemstage_app, idemstage_worker, idemstage_operator;
GRANT SELECT ON SEQUENCE jobs_ready_seq TO idemstage_worker;
GRANT SELECT, INSERT ON job_lanes TO idemstage_app, idemstage_worker, idemstage_operator;
GRANT UPDATE (floor, floor_at) ON job_lanes TO idemstage_worker;
GRANT EXECUTE ON FUNCTION idemstage_advance_floors(bigint, bigint, bigint) TO idemstage_worker;
REVOKE EXECUTE ON FUNCTION idemstage_advance_floors(bigint, bigint, bigint) FROM PUBLIC;
ALTER TABLE job_lanes ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON job_lanes TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY queue_work ON job_lanes TO idemstage_worker, idemstage_operator
    USING (true) WITH CHECK (true);
