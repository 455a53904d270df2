DROP FUNCTION idemstage_lanes_claimed(text, text[], integer[], bigint[]);

CREATE OR REPLACE FUNCTION idemstage_lane_heads(v_queue text) RETURNS TABLE(tenant_id text, priority integer, floor bigint, head bigint)
    LANGUAGE sql STABLE
    AS $$
    SELECT l.tenant_id, l.priority, h.ready_seq AS floor, h.ready_seq AS head
      FROM public.job_lanes l
      CROSS JOIN LATERAL (
          SELECT j.ready_seq FROM public.jobs j
           WHERE j.queue = v_queue AND j.tenant_id = l.tenant_id AND j.priority = l.priority
             AND j.state IN ('created', 'retry') AND j.ready_seq >= l.floor
             AND j.start_after <= now()
             AND (SELECT 1 FROM public.job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL
           ORDER BY j.ready_seq
           LIMIT 1) h
     WHERE l.queue = v_queue AND NOT l.parked
$$;

CREATE OR REPLACE FUNCTION idemstage_fetch_plain(v_queue text, v_n integer) RETURNS TABLE(id text, queue text, tenant_id text, payload text, priority integer, singleton_key text, attempt integer, retry_count integer, retry_limit integer, expire_in_ms bigint, lease_expires_at timestamp with time zone, created_at timestamp with time zone, last_error text)
    LANGUAGE plpgsql
    SET search_path TO 'public', 'pg_temp'
    SET plan_cache_mode TO 'force_generic_plan'
    SET enable_seqscan TO 'off'
    SET jit TO 'off'
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
                     AND (SELECT 1 FROM job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL
                   ORDER BY j.ready_seq
                   LIMIT v_n
                   FOR UPDATE SKIP LOCKED) c
             ORDER BY c.priority DESC, c.ready_seq
             LIMIT v_n
        ), claimed AS (
            -- The lease is a claim appended beside the job; the job's row is
            -- not written (a dead tuple per job less). ON CONFLICT: a fetch whose
            -- snapshot missed a claim committed meanwhile locked the job after its
            -- claimer committed; the claim there is the other's.
            INSERT INTO job_claims AS k (ready_seq, job_id, attempt, queue, tenant_id, priority,
                                         claim_xid, claimed_at, lease_expires_at)
            SELECT j.ready_seq, j.id, j.attempt + 1, j.queue, j.tenant_id, j.priority,
                   pg_current_xact_id()::text::bigint, now(), now() + j.expire_in_ms * interval '1 millisecond'
              FROM jobs j
             WHERE j.ctid = ANY(ARRAY(SELECT ctid FROM next))
            ON CONFLICT (ready_seq) DO NOTHING
            RETURNING k.ready_seq, k.attempt, k.lease_expires_at
        ), leased AS (
            SELECT j.id, j.queue, j.tenant_id, j.payload::text AS payload, j.priority,
                   j.singleton_key, c.attempt, j.retry_count, j.retry_limit,
                   j.expire_in_ms, c.lease_expires_at, j.created_at, j.last_error, j.ready_seq
              FROM jobs j JOIN claimed c ON c.ready_seq = j.ready_seq
             WHERE j.ctid = ANY(ARRAY(SELECT ctid FROM next))
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
                                 AND (SELECT 1 FROM job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL
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
                 AND (SELECT 1 FROM job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL
               ORDER BY j.ready_seq
               LIMIT s.take
               FOR UPDATE SKIP LOCKED) c
    ), next AS (
        SELECT ctid, id, rank, turn FROM candidates
         WHERE rank <= take
         ORDER BY rank, turn LIMIT v_n
    ), claimed AS (
        -- The lease is a claim appended beside the job; the job's row is
        -- not written (a dead tuple per job less). ON CONFLICT: a fetch whose
        -- snapshot missed a claim committed meanwhile locked the job after its
        -- claimer committed; the claim there is the other's.
        INSERT INTO job_claims AS k (ready_seq, job_id, attempt, queue, tenant_id, priority,
                                     claim_xid, claimed_at, lease_expires_at)
        SELECT j.ready_seq, j.id, j.attempt + 1, j.queue, j.tenant_id, j.priority,
               pg_current_xact_id()::text::bigint, now(), now() + j.expire_in_ms * interval '1 millisecond'
          FROM jobs j
         WHERE j.ctid = ANY(ARRAY(SELECT ctid FROM next))
        ON CONFLICT (ready_seq) DO NOTHING
        RETURNING k.ready_seq, k.attempt, k.lease_expires_at
    ), leased AS (
        SELECT j.id, j.queue, j.tenant_id, j.payload::text AS payload, j.priority,
               j.singleton_key, c.attempt, j.retry_count, j.retry_limit,
               j.expire_in_ms, c.lease_expires_at, j.created_at, j.last_error
          FROM jobs j JOIN claimed c ON c.ready_seq = j.ready_seq
         WHERE j.ctid = ANY(ARRAY(SELECT ctid FROM next))
    )
    -- In fetch order (RETURNING has none): round-robin over the tenants.
    SELECT l.id::text, l.queue, l.tenant_id, l.payload, l.priority, l.singleton_key,
           l.attempt, l.retry_count, l.retry_limit, l.expire_in_ms, l.lease_expires_at,
           l.created_at, l.last_error
      FROM leased l JOIN next n ON n.id = l.id
     ORDER BY n.rank, n.turn;
END
$$;

CREATE OR REPLACE FUNCTION idemstage_fetch_controlled(v_queue text, v_n integer) RETURNS TABLE(id text, queue text, tenant_id text, payload text, priority integer, singleton_key text, attempt integer, retry_count integer, retry_limit integer, expire_in_ms bigint, lease_expires_at timestamp with time zone, created_at timestamp with time zone, last_error text)
    LANGUAGE plpgsql
    SET search_path TO 'public', 'pg_temp'
    SET plan_cache_mode TO 'force_generic_plan'
    SET enable_seqscan TO 'off'
    SET jit TO 'off'
    AS $$
#variable_conflict use_column
DECLARE
    v_tenants text[];
    v_priorities integer[];
    v_floors bigint[];
    v_heads bigint[];
    v_aging_ms bigint;
    v_top integer;
    v_expired_to timestamptz;
BEGIN
    SELECT m.expired_to INTO v_expired_to FROM job_expiry_mark m;
    SELECT array_agg(h.tenant_id), array_agg(h.priority), array_agg(h.floor),
           array_agg(h.head)
      INTO v_tenants, v_priorities, v_floors, v_heads
      FROM idemstage_lane_heads(v_queue) h;
    IF v_tenants IS NULL THEN
        RETURN;
    END IF;
    -- Aging: a job's priority within its tenant's share rises by one per
    -- aging interval it has been ready, up to the highest lane of the queue
    -- with a ready job, so that none waits for ever behind a stream of
    -- higher ones. The tenants' turns do not age: fairness is untouched.
    SELECT c.aging_ms INTO v_aging_ms FROM queue_controls c
     WHERE c.queue = v_queue AND c.scope = '';
    v_top := (SELECT max(p) FROM unnest(v_priorities) AS p);
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
                                 -- The scope's open claims: those still its job's
                                 -- current one, from the expiry mark on (an open
                                 -- claim below it has been taken back).
                                 SELECT count(*) FROM job_claims a
                                  WHERE a.queue = v_queue AND a.tenant_id = c.tenant_id
                                    AND a.lease_expires_at >= v_expired_to
                                    AND (SELECT o.ready_seq FROM jobs o
                                          WHERE o.id = a.job_id
                                            AND o.state IN ('created', 'retry')) = a.ready_seq), 0)
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
                                 AND (SELECT 1 FROM job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL
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
                                  ORDER BY idemstage_aged_priority(c.priority, c.start_after,
                                                                   v_aging_ms, v_top) DESC,
                                           c.ready_seq) AS rank
          FROM shares s
          JOIN lanes l ON l.tenant_id = s.tenant_id
          CROSS JOIN LATERAL (
              SELECT j.ctid, j.id, j.priority, j.ready_seq, j.start_after FROM jobs j
               WHERE j.queue = v_queue AND j.tenant_id = l.tenant_id
                 AND j.priority = l.priority AND j.state IN ('created', 'retry')
                 AND j.ready_seq >= l.floor AND j.start_after <= now()
                 AND (SELECT 1 FROM job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL
               ORDER BY j.ready_seq
               LIMIT s.take
               FOR UPDATE SKIP LOCKED) c
    ), next AS (
        -- Weighted round-robin: a tenant of weight w takes w turns per round.
        SELECT ctid, id, rank::float8 / weight AS round, turn FROM candidates
         WHERE rank <= take
         ORDER BY 3, turn LIMIT v_n
    ), claimed AS (
        -- The lease is a claim appended beside the job; the job's row is
        -- not written (a dead tuple per job less). ON CONFLICT: a fetch whose
        -- snapshot missed a claim committed meanwhile locked the job after its
        -- claimer committed; the claim there is the other's.
        INSERT INTO job_claims AS k (ready_seq, job_id, attempt, queue, tenant_id, priority,
                                     claim_xid, claimed_at, lease_expires_at)
        SELECT j.ready_seq, j.id, j.attempt + 1, j.queue, j.tenant_id, j.priority,
               pg_current_xact_id()::text::bigint, now(), now() + j.expire_in_ms * interval '1 millisecond'
          FROM jobs j
         WHERE j.ctid = ANY(ARRAY(SELECT ctid FROM next))
        ON CONFLICT (ready_seq) DO NOTHING
        RETURNING k.ready_seq, k.attempt, k.lease_expires_at
    ), leased AS (
        SELECT j.id, j.queue, j.tenant_id, j.payload::text AS payload, j.priority,
               j.singleton_key, c.attempt, j.retry_count, j.retry_limit,
               j.expire_in_ms, c.lease_expires_at, j.created_at, j.last_error
          FROM jobs j JOIN claimed c ON c.ready_seq = j.ready_seq
         WHERE j.ctid = ANY(ARRAY(SELECT ctid FROM next))
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
