-- A session's fetch walks each lane on from where its last fetch left it, not
-- from the lane's floor (issue 31).
--
-- A lane's floor rises once per floors' run at most (every two intervals), so
-- a walk from it passed every entry the lane's fetches took since: in a drain
-- at 40,000 jobs/s some 80,000 index entries a fetch, spent or still claimed,
-- each skipped or probed. Closures (step 3 of docs/storage-under-pressure.md)
-- would leave every finished job's entry live and make each of them a probe.
--
-- Now each session keeps, per lane, where its next walk starts, in the
-- setting `idemstage.lane_starts` (jsonb, per queue: `since` and `lanes`;
-- a setting, not a row, so moving it makes no row version and a rollback
-- takes it back with the claims): `idemstage_lane_heads` walks from there and
-- the fetch functions move it past the entries they claimed
-- (`idemstage_lanes_claimed`). It is a hint, never a promise: an entry it
-- passes is claimed, or not yet due, or not yet visible, and
--
-- * a lane with nothing from its start is walked from its floor at once;
-- * a job not due at the walk that passed it (a send with a delay, a retry)
--   and due now is found by its own index (`jobs_deferred_idx`) below the
--   start;
-- * every second (`since`), a session's walks start from the floors again,
--   so a job whose sender committed after a walk passed it, or one a
--   rolled-back fetch of another session skipped, waits a second at most, as
--   a job below its floor waits for the next floors' run.
--
-- Behind PgBouncer's transaction pooling the setting stays with the server's
-- connection and serves whichever client runs next on it: a hint all the same.

CREATE OR REPLACE FUNCTION idemstage_lane_heads(v_queue text) RETURNS TABLE(tenant_id text, priority integer, floor bigint, head bigint)
    LANGUAGE plpgsql
    SET search_path TO 'public', 'pg_temp'
    AS $$
#variable_conflict use_column
DECLARE
    v_all jsonb := coalesce(nullif(current_setting('idemstage.lane_starts', true), ''), '{}')::jsonb;
    v_since timestamptz := (v_all -> v_queue ->> 'since')::timestamptz;
    v_starts jsonb := '{}';
    v_tenants text[];
    v_priorities integer[];
    v_heads bigint[];
BEGIN
    IF v_since > now() - interval '1 second' THEN
        v_starts := coalesce(v_all -> v_queue -> 'lanes', '{}');
    ELSE
        v_since := NULL;
    END IF;
    SELECT array_agg(l.tenant_id), array_agg(l.priority), array_agg(h.head)
      INTO v_tenants, v_priorities, v_heads
      FROM job_lanes l
      CROSS JOIN LATERAL (
          SELECT greatest(l.floor, (v_starts ->> (l.tenant_id || '/' || l.priority))::bigint)
                 AS start) s
      CROSS JOIN LATERAL (
          SELECT coalesce(
              -- A job below the start that was not due when a walk passed it,
              -- by `jobs_deferred_idx` from `since` on (`+ 0`: not by the
              -- ready index, whose range below the start is what was passed).
              (SELECT min(j.ready_seq) FROM jobs j
                WHERE v_since IS NOT NULL
                  AND j.queue = v_queue AND j.tenant_id = l.tenant_id
                  AND j.priority = l.priority AND j.state IN ('created', 'retry')
                  AND j.start_after > j.created_at
                  AND j.start_after > v_since AND j.start_after <= now()
                  AND j.ready_seq + 0 >= l.floor AND j.ready_seq + 0 < s.start
                  AND (SELECT 1 FROM job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL),
              (SELECT j.ready_seq FROM jobs j
                WHERE j.queue = v_queue AND j.tenant_id = l.tenant_id
                  AND j.priority = l.priority AND j.state IN ('created', 'retry')
                  AND j.ready_seq >= s.start AND j.start_after <= now()
                  AND (SELECT 1 FROM job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL
                ORDER BY j.ready_seq
                LIMIT 1),
              -- Nothing from the start: the lane from its floor.
              (SELECT j.ready_seq FROM jobs j
                WHERE s.start > l.floor
                  AND j.queue = v_queue AND j.tenant_id = l.tenant_id
                  AND j.priority = l.priority AND j.state IN ('created', 'retry')
                  AND j.ready_seq >= l.floor AND j.start_after <= now()
                  AND (SELECT 1 FROM job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL
                ORDER BY j.ready_seq
                LIMIT 1)) AS head
           OFFSET 0) h -- not pulled up: the filter below would compute the head again
     WHERE l.queue = v_queue AND NOT l.parked AND h.head IS NOT NULL;
    PERFORM set_config('idemstage.lane_starts',
        jsonb_set(v_all, ARRAY[v_queue],
                  jsonb_build_object(
                      'since', coalesce(v_since, now()),
                      'lanes', coalesce((SELECT jsonb_object_agg(u.t || '/' || u.p, u.hd)
                                           FROM unnest(v_tenants, v_priorities, v_heads)
                                                AS u(t, p, hd)), '{}')))::text,
        false);
    RETURN QUERY SELECT u.t, u.p, u.hd, u.hd FROM unnest(v_tenants, v_priorities, v_heads) AS u(t, p, hd);
END
$$;

-- After a fetch claimed entries of a lane, its session's next walk of the lane
-- starts past the last of them.
CREATE FUNCTION idemstage_lanes_claimed(v_queue text, v_tenants text[], v_priorities integer[], v_lasts bigint[]) RETURNS void
    LANGUAGE plpgsql
    SET search_path TO 'public', 'pg_temp'
    AS $$
DECLARE
    v_all jsonb := coalesce(nullif(current_setting('idemstage.lane_starts', true), ''), '{}')::jsonb;
BEGIN
    IF v_tenants IS NULL OR v_all -> v_queue IS NULL THEN
        RETURN;
    END IF;
    PERFORM set_config('idemstage.lane_starts',
        jsonb_set(v_all, ARRAY[v_queue, 'lanes'],
                  coalesce(v_all -> v_queue -> 'lanes', '{}')
                  || (SELECT jsonb_object_agg(u.t || '/' || u.p, u.last + 1)
                        FROM unnest(v_tenants, v_priorities, v_lasts) AS u(t, p, last)))::text,
        false);
END
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
            RETURNING k.ready_seq, k.attempt, k.lease_expires_at, k.tenant_id, k.priority
        ), started AS (
        -- This session's next walk of each lane starts past what it claimed.
        SELECT idemstage_lanes_claimed(v_queue, array_agg(s.tenant_id), array_agg(s.priority),
                                       array_agg(s.last)) AS done
          FROM (SELECT c.tenant_id, c.priority, max(c.ready_seq) AS last
                  FROM claimed c GROUP BY c.tenant_id, c.priority) s
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
          FROM leased l CROSS JOIN started
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
        RETURNING k.ready_seq, k.attempt, k.lease_expires_at, k.tenant_id, k.priority
    ), started AS (
        -- This session's next walk of each lane starts past what it claimed.
        SELECT idemstage_lanes_claimed(v_queue, array_agg(s.tenant_id), array_agg(s.priority),
                                       array_agg(s.last)) AS done
          FROM (SELECT c.tenant_id, c.priority, max(c.ready_seq) AS last
                  FROM claimed c GROUP BY c.tenant_id, c.priority) s
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
      FROM leased l JOIN next n ON n.id = l.id CROSS JOIN started
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
        RETURNING k.ready_seq, k.attempt, k.lease_expires_at, k.tenant_id, k.priority
    ), started AS (
        -- This session's next walk of each lane starts past what it claimed.
        SELECT idemstage_lanes_claimed(v_queue, array_agg(s.tenant_id), array_agg(s.priority),
                                       array_agg(s.last)) AS done
          FROM (SELECT c.tenant_id, c.priority, max(c.ready_seq) AS last
                  FROM claimed c GROUP BY c.tenant_id, c.priority) s
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
      FROM leased l JOIN next n ON n.id = l.id CROSS JOIN started
     ORDER BY n.round, n.turn;
END
$$;
