-- The fetch of a queue without controls (idemstage_fetch_plain) ran its fair
-- query on every call: ~1 ms of server time for one ready job (pgbench, one
-- client: an insert and a fetch took 1.10 ms, the insert alone 0.10 ms), most of
-- a job's pickup latency and a large part of a stage execution's cost. Two fast
-- paths go first: a queue with nothing ready costs one index probe, and a queue
-- whose ready jobs are all one tenant's is fetched in order without computing
-- shares. With several tenants the fair query runs as before (its text is
-- 000070's). CREATE OR REPLACE keeps the grants of 000110; the SET clauses are
-- the function's own again.
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
ALTER FUNCTION idemstage_fetch_plain(text, integer) SET plan_cache_mode = force_generic_plan;
