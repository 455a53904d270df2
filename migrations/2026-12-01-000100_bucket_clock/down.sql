-- Back to 000070's fetch functions.

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
        SELECT c.tenant_id, c.weight, c.rate_count, k.tokens,
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
              SELECT idemstage_bucket_tokens(b, c.rate_count, c.rate_period_ms,
                                             c.rate_burst) AS tokens) k
    ), heads AS (
        SELECT r.tenant_id, r.room, r.weight, r.rate_count, r.tokens, h.priority, h.id
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
        SELECT heads.tenant_id, heads.weight, heads.rate_count, heads.tokens, heads.room,
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
        SELECT v_queue, s.tenant_id, s.tokens - n.leased, clock_timestamp()
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

CREATE OR REPLACE FUNCTION idemstage_fetch(p_queues text[], p_limit integer)
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
    v_queue text;
    v_share integer;
    v_got integer;
    v_remaining integer := p_limit;
    v_full text[] := '{}';
    v_pass integer;
    v_n integer;
    v_controlled boolean;
    v_ctl queue_controls;
    v_bucket queue_buckets;
    v_active bigint;
    v_tokens double precision;
BEGIN
    IF p_limit IS NULL OR p_limit <= 0 OR cardinality(p_queues) IS NULL THEN
        RETURN;
    END IF;
    -- Take turns on the capped and rate-limited queues (in a fixed order: no
    -- deadlock between fetchers of overlapping queue sets).
    PERFORM 1 FROM queue_controls c
     WHERE c.queue = ANY(p_queues)
       AND (c.max_active IS NOT NULL OR c.rate_count IS NOT NULL)
     ORDER BY c.queue, c.scope
       FOR UPDATE;
    v_share := ceil(p_limit::numeric / cardinality(p_queues));
    -- Pass 1: every queue its share, in random order (none is always first);
    -- pass 2: what is left, to the queues that filled their share.
    FOR v_pass IN 1..2 LOOP
        FOR v_queue IN
            SELECT u.q FROM unnest(CASE WHEN v_pass = 1 THEN p_queues ELSE v_full END)
                   AS u(q) ORDER BY random()
        LOOP
            EXIT WHEN v_remaining <= 0;
            v_n := CASE WHEN v_pass = 1 THEN least(v_share, v_remaining) ELSE v_remaining END;
            v_controlled := EXISTS (SELECT 1 FROM queue_controls c WHERE c.queue = v_queue)
                OR EXISTS (SELECT 1 FROM queue_buckets b
                            WHERE b.queue = v_queue AND b.held_until > clock_timestamp());
            IF NOT v_controlled THEN
                RETURN QUERY SELECT * FROM idemstage_fetch_plain(v_queue, v_n);
            ELSE
                -- The queue as a whole: paused, its cap, its bucket.
                SELECT * INTO v_ctl FROM queue_controls c WHERE c.queue = v_queue AND c.scope = '';
                IF v_ctl.paused THEN
                    CONTINUE;
                END IF;
                IF v_ctl.max_active IS NOT NULL THEN
                    SELECT count(*) INTO v_active FROM jobs a
                     WHERE a.queue = v_queue AND a.lease_expires_at IS NOT NULL;
                    v_n := least(v_n, greatest(v_ctl.max_active - v_active, 0));
                END IF;
                SELECT * INTO v_bucket FROM queue_buckets b
                 WHERE b.queue = v_queue AND b.tenant_id = '';
                v_tokens := idemstage_bucket_tokens(v_bucket, v_ctl.rate_count,
                                                    v_ctl.rate_period_ms, v_ctl.rate_burst);
                IF v_tokens < v_n THEN
                    v_n := floor(v_tokens);
                END IF;
                IF v_n <= 0 THEN
                    CONTINUE;
                END IF;
                RETURN QUERY SELECT * FROM idemstage_fetch_controlled(v_queue, v_n);
            END IF;
            GET DIAGNOSTICS v_got = ROW_COUNT;
            IF v_controlled AND v_ctl.rate_count IS NOT NULL AND v_got > 0 THEN
                INSERT INTO queue_buckets AS b (queue, tenant_id, tokens, refilled_at)
                VALUES (v_queue, '', v_tokens - v_got, clock_timestamp())
                ON CONFLICT (queue, tenant_id) DO UPDATE
                   SET tokens = excluded.tokens, refilled_at = excluded.refilled_at;
            END IF;
            v_remaining := v_remaining - v_got;
            IF v_pass = 1 AND v_got = v_n THEN
                v_full := v_full || v_queue;
            END IF;
        END LOOP;
        EXIT WHEN v_remaining <= 0 OR cardinality(p_queues) = 1;
    END LOOP;
END
$$;

ALTER FUNCTION idemstage_fetch(text[], integer) RESET plan_cache_mode;
ALTER FUNCTION idemstage_fetch_plain(text, integer) RESET plan_cache_mode;
ALTER FUNCTION idemstage_fetch_controlled(text, integer) RESET plan_cache_mode;
