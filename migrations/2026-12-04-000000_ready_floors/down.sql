-- Back to the baseline's fetch: the lanes, the floors and the sequence go, the
-- fetch walks the ready index again (migration 2026-12-04-000000_ready_floors).
DROP TRIGGER jobs_ready_again ON jobs;
DROP TRIGGER jobs_lanes ON jobs;
DROP FUNCTION idemstage_jobs_ready_again();
DROP FUNCTION idemstage_jobs_lanes();
DROP FUNCTION idemstage_advance_floors(bigint, bigint, bigint);

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
    v_first text;
BEGIN
    -- Nothing ready: one probe of the fetch index, not the fair query (an idle
    -- queue is asked on every fetch of a worker that serves it).
    SELECT j.tenant_id INTO v_first FROM jobs j
     WHERE j.queue = v_queue AND j.state IN ('created', 'retry')
       AND j.start_after <= now()
     ORDER BY j.tenant_id LIMIT 1;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- One tenant with ready jobs: no shares to compute, its jobs in order (what
    -- the fair query returns for one tenant, without its ~1 ms of CTEs). A job
    -- of another tenant sent meanwhile waits for the next fetch, as it would
    -- behind this fetch's snapshot anyway.
    -- In index order with LIMIT 1, as the fair query's tenant walk: a generic
    -- plan of a bare EXISTS on `tenant_id > v_first` scans the whole table.
    PERFORM 1 FROM jobs j
      WHERE j.queue = v_queue AND j.state IN ('created', 'retry')
        AND j.tenant_id > v_first AND j.start_after <= now()
      ORDER BY j.tenant_id LIMIT 1;
    IF NOT FOUND THEN
        RETURN QUERY
        WITH next AS (
            SELECT j.ctid, j.priority, j.id FROM jobs j
             WHERE j.queue = v_queue AND j.tenant_id = v_first
               AND j.state IN ('created', 'retry') AND j.start_after <= now()
             ORDER BY j.priority DESC, j.id
             LIMIT v_n
             FOR UPDATE SKIP LOCKED
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
        SELECT l.id::text, l.queue, l.tenant_id, l.payload, l.priority, l.singleton_key,
               l.attempt, l.retry_count, l.retry_limit, l.expire_in_ms, l.lease_expires_at,
               l.created_at, l.last_error
          FROM leased l
         ORDER BY l.priority DESC, l.id;
        RETURN;
    END IF;
    -- Several tenants: the fair query (000070's, unchanged).
    RETURN QUERY
    WITH RECURSIVE tenants AS (
        (SELECT j.tenant_id FROM jobs j
          WHERE j.queue = v_queue AND j.state IN ('created', 'retry')
            AND j.start_after <= now()
          ORDER BY j.tenant_id LIMIT 1)
        UNION ALL
        SELECT (SELECT j.tenant_id FROM jobs j
                 WHERE j.queue = v_queue AND j.state IN ('created', 'retry')
                   AND j.tenant_id > t.tenant_id AND j.start_after <= now()
                 ORDER BY j.tenant_id LIMIT 1)
          FROM tenants t
         WHERE t.tenant_id IS NOT NULL
    ), heads AS (
        SELECT t.tenant_id, h.priority, h.id
          FROM tenants t
          CROSS JOIN LATERAL (
              SELECT j.priority, j.id FROM jobs j
               WHERE j.queue = v_queue AND j.tenant_id = t.tenant_id
                 AND j.state IN ('created', 'retry') AND j.start_after <= now()
               ORDER BY j.priority DESC, j.id
               LIMIT 1) h
         WHERE t.tenant_id IS NOT NULL
         ORDER BY h.priority DESC, h.id
         LIMIT v_n
    ), fair AS (
        SELECT heads.tenant_id,
               row_number() OVER (ORDER BY heads.priority DESC, heads.id) AS turn,
               count(*) OVER () AS tenants,
               ceil(v_n::numeric / count(*) OVER ())::integer AS share
          FROM heads
    ), avail AS (
        -- What each tenant has of its share (read, not locked; one tenant: all).
        SELECT f.*,
               CASE WHEN f.tenants = 1 THEN f.share
                    ELSE (SELECT count(*) FROM (
                              SELECT 1 FROM jobs j
                               WHERE j.queue = v_queue AND j.tenant_id = f.tenant_id
                                 AND j.state IN ('created', 'retry') AND j.start_after <= now()
                               -- In index order, as the lock below reads: without it a
                               -- generic plan may take a bitmap scan of the tenant's
                               -- whole backlog.
                               ORDER BY j.priority DESC, j.id
                               LIMIT f.share) x)::integer
               END AS avail
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
        SELECT c.ctid, c.id, s.turn,
               row_number() OVER (PARTITION BY s.tenant_id ORDER BY c.priority DESC, c.id) AS rank
          FROM shares s
          CROSS JOIN LATERAL (
              SELECT j.ctid, j.priority, j.id FROM jobs j
               WHERE j.queue = v_queue AND j.tenant_id = s.tenant_id
                 AND j.state IN ('created', 'retry') AND j.start_after <= now()
               ORDER BY j.priority DESC, j.id
               LIMIT s.take
               FOR UPDATE SKIP LOCKED) c
    ), next AS (
        SELECT ctid, id, rank, turn FROM candidates ORDER BY rank, turn LIMIT v_n
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
BEGIN
    RETURN QUERY
    WITH RECURSIVE tenants AS (
        (SELECT j.tenant_id FROM jobs j
          WHERE j.queue = v_queue AND j.state IN ('created', 'retry')
            AND j.start_after <= now()
          ORDER BY j.tenant_id LIMIT 1)
        UNION ALL
        SELECT (SELECT j.tenant_id FROM jobs j
                 WHERE j.queue = v_queue AND j.state IN ('created', 'retry')
                   AND j.tenant_id > t.tenant_id AND j.start_after <= now()
                 ORDER BY j.tenant_id LIMIT 1)
          FROM tenants t
         WHERE t.tenant_id IS NOT NULL
    ), ctl AS (
        SELECT t.tenant_id,
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
         WHERE t.tenant_id IS NOT NULL
    ), room AS (
        SELECT c.tenant_id, c.weight, c.rate_count, k.tokens, k.at,
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
        SELECT r.tenant_id, r.room, r.weight, r.rate_count, r.tokens, r.at, h.priority, h.id
          FROM room r
          CROSS JOIN LATERAL (
              SELECT j.priority, j.id FROM jobs j
               WHERE j.queue = v_queue AND j.tenant_id = r.tenant_id
                 AND j.state IN ('created', 'retry') AND j.start_after <= now()
               ORDER BY j.priority DESC, j.id
               LIMIT 1) h
         WHERE r.room > 0
         ORDER BY h.priority DESC, h.id
         LIMIT v_n
    ), fair AS (
        SELECT heads.tenant_id, heads.weight, heads.rate_count, heads.tokens, heads.at,
               heads.room,
               row_number() OVER (ORDER BY heads.priority DESC, heads.id) AS turn,
               count(*) OVER () AS tenants,
               least(heads.room,
                     ceil(v_n::numeric * heads.weight / sum(heads.weight) OVER ()))::integer
                   AS share
          FROM heads
    ), avail AS (
        -- What each tenant has of its share (read, not locked; one tenant: all).
        SELECT f.*,
               CASE WHEN f.tenants = 1 THEN f.share
                    ELSE (SELECT count(*) FROM (
                              SELECT 1 FROM jobs j
                               WHERE j.queue = v_queue AND j.tenant_id = f.tenant_id
                                 AND j.state IN ('created', 'retry') AND j.start_after <= now()
                               -- In index order, as the lock below reads: without it a
                               -- generic plan may take a bitmap scan of the tenant's
                               -- whole backlog.
                               ORDER BY j.priority DESC, j.id
                               LIMIT f.share) x)::integer
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
        SELECT c.ctid, c.id, s.turn, s.weight,
               row_number() OVER (PARTITION BY s.tenant_id ORDER BY c.priority DESC, c.id) AS rank
          FROM shares s
          CROSS JOIN LATERAL (
              SELECT j.ctid, j.priority, j.id FROM jobs j
               WHERE j.queue = v_queue AND j.tenant_id = s.tenant_id
                 AND j.state IN ('created', 'retry') AND j.start_after <= now()
               ORDER BY j.priority DESC, j.id
               LIMIT s.take
               FOR UPDATE SKIP LOCKED) c
    ), next AS (
        -- Weighted round-robin: a tenant of weight w takes w turns per round.
        SELECT ctid, id, rank::float8 / weight AS round, turn FROM candidates
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
       AND EXISTS (SELECT 1 FROM jobs j
                    WHERE j.queue = q.queue AND j.state IN ('created', 'retry')
                      AND j.start_after <= now())
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

ALTER FUNCTION idemstage_fetch_plain(text, integer) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION idemstage_fetch_controlled(text, integer) SET plan_cache_mode = force_generic_plan;

DROP FUNCTION idemstage_lane_heads(text);
DROP TABLE job_lanes;
CREATE INDEX jobs_fetch_idx ON jobs (queue, tenant_id, priority DESC, id)
    WHERE state IN ('created', 'retry');
DROP INDEX jobs_ready_idx;
ALTER TABLE jobs DROP COLUMN ready_seq;
