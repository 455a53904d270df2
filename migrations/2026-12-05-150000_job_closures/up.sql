-- A completion of a job without a singleton key is a closure appended beside
-- the job, not an UPDATE of its row (issue 31, docs/storage-under-pressure.md,
-- step 3): the job's ready entry was claimed by an insert (job_claims), and is
-- now ended by one, so a job of a plain queue leaves no dead tuple in `jobs`.
--
-- * `job_closures`: one row per ended ready entry (keyed by its `ready_seq`,
--   as its claim), never updated. Every end of a ready entry of a job without
--   a singleton key inserts one first (a completion, a failure, a release, an
--   expiry, a cancel, claimed or not) and writes the job's row only when its
--   insert did: two ends meet on the closure's key, whichever of them writes
--   the row. A completion writes nothing else: the job's row stays `created`
--   or `retry` with its claim, and `job_states` shows it completed, with the
--   closure's time and output.
-- * A job with a singleton key (every stage job has one) ends as before, by
--   its row: the row must leave `jobs_singleton_live_uq` for the key's next
--   job to be sent. No closure is written for it.
-- * An open claim (caps, the floors' run, expiry) is one that is its job's
--   current one and has no closure; the floors count a lane busy when a
--   closure of it is recent, as when a job of it finished lately.
-- * Retention deletes a closure past the retention with its claim, and the
--   job's row when the closure ended it.

CREATE TABLE job_closures (
    ready_seq bigint PRIMARY KEY,
    job_id text NOT NULL,
    attempt integer NOT NULL,
    queue text NOT NULL,
    tenant_id text NOT NULL,
    priority integer NOT NULL,
    outcome text NOT NULL
        CHECK (outcome IN ('completed', 'failed', 'released', 'expired', 'cancelled')),
    output jsonb,
    closed_at timestamptz NOT NULL DEFAULT now()
) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
        autovacuum_vacuum_insert_threshold = 100000, autovacuum_analyze_threshold = 100000);
-- Retention, and the floors' busy lanes.
CREATE INDEX job_closures_closed_at_idx ON job_closures (closed_at);

ALTER TABLE job_closures ENABLE ROW LEVEL SECURITY;
ALTER TABLE job_closures FORCE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON job_closures TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY queue_work ON job_closures TO idemstage_worker, idemstage_operator
    USING (true) WITH CHECK (true);
GRANT SELECT, INSERT ON job_closures TO idemstage_app, idemstage_operator;
GRANT SELECT, INSERT, DELETE ON job_closures TO idemstage_worker;

CREATE OR REPLACE VIEW job_states WITH (security_invoker = true) AS
SELECT j.id, j.queue,
       CASE WHEN z.ready_seq IS NOT NULL THEN 'completed'
            WHEN k.ready_seq IS NULL THEN j.state
            ELSE 'active' END AS state,
       j.priority, j.payload, j.singleton_key, j.singleton_on,
       j.retry_limit, j.retry_count, j.retry_delay_ms, j.retry_backoff,
       j.retry_delay_max_ms, j.expire_in_ms,
       coalesce(k.attempt, j.attempt) AS attempt,
       j.start_after,
       coalesce(k.claimed_at, j.started_at) AS started_at,
       CASE WHEN z.ready_seq IS NULL
            THEN coalesce(k.lease_expires_at, j.lease_expires_at) END AS lease_expires_at,
       coalesce(z.closed_at, j.completed_at) AS completed_at,
       j.created_at, j.dead_letter,
       CASE WHEN z.ready_seq IS NULL THEN j.output ELSE z.output END AS output,
       j.last_error, j.tenant_id, j.ready_seq
  FROM jobs j
  LEFT JOIN job_claims k
         ON k.ready_seq = j.ready_seq AND k.job_id = j.id AND j.state IN ('created', 'retry')
  LEFT JOIN job_closures z
         ON z.ready_seq = k.ready_seq AND z.job_id = j.id AND z.outcome = 'completed';

-- The caps' counts: a claim with a closure is not open.
CREATE OR REPLACE FUNCTION idemstage_fetch_queues(p_queues text[], p_limit integer)
 RETURNS TABLE(id text, queue text, tenant_id text, payload text, priority integer, singleton_key text, attempt integer, retry_count integer, retry_limit integer, expire_in_ms bigint, lease_expires_at timestamp with time zone, created_at timestamp with time zone, last_error text)
 LANGUAGE plpgsql
 SET search_path TO 'public', 'pg_temp'
 SET plan_cache_mode TO 'force_generic_plan'
 SET enable_seqscan TO 'off'
 SET jit TO 'off'
AS $function$
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
    v_counted_at timestamptz;
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
                    SELECT count(*) INTO v_active FROM job_claims a
                     WHERE a.queue = v_queue
                       AND a.lease_expires_at >= (SELECT m.expired_to FROM job_expiry_mark m)
                       AND (SELECT o.ready_seq FROM jobs o
                             WHERE o.id = a.job_id
                               AND o.state IN ('created', 'retry')) = a.ready_seq
                       AND (SELECT 1 FROM job_closures z WHERE z.ready_seq = a.ready_seq) IS NULL;
                    v_n := least(v_n, greatest(v_ctl.max_active - v_active, 0));
                END IF;
                SELECT * INTO v_bucket FROM queue_buckets b
                 WHERE b.queue = v_queue AND b.tenant_id = '';
                -- The bucket's new refilled_at is the instant its tokens are
                -- counted at, not the end of the fetch: what refilled while
                -- the jobs were leased is not lost.
                v_counted_at := clock_timestamp();
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
                VALUES (v_queue, '', v_tokens - v_got, v_counted_at)
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
$function$;

CREATE OR REPLACE FUNCTION idemstage_fetch_controlled(v_queue text, v_n integer)
 RETURNS TABLE(id text, queue text, tenant_id text, payload text, priority integer, singleton_key text, attempt integer, retry_count integer, retry_limit integer, expire_in_ms bigint, lease_expires_at timestamp with time zone, created_at timestamp with time zone, last_error text)
 LANGUAGE plpgsql
 SET search_path TO 'public', 'pg_temp'
 SET plan_cache_mode TO 'force_generic_plan'
 SET enable_seqscan TO 'off'
 SET jit TO 'off'
AS $function$
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
                                            AND o.state IN ('created', 'retry')) = a.ready_seq
                                    AND (SELECT 1 FROM job_closures z WHERE z.ready_seq = a.ready_seq) IS NULL), 0)
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
$function$;

-- The floors' run: a lane is busy when a closure of it is recent; a claim with
-- a closure is not open.
CREATE OR REPLACE FUNCTION idemstage_advance_floors(p_mark bigint, p_horizon_ms bigint, p_raise_every_ms bigint, p_walk_below boolean)
 RETURNS bigint
 LANGUAGE plpgsql
 SET search_path TO 'public', 'pg_temp'
 SET jit TO 'off'
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    v_mark bigint;
    v_queues text[];
    v_tenants text[];
    v_priorities integer[];
    v_firsts bigint[];
    v_idle boolean[];
    v_due timestamptz := now() + p_horizon_ms * interval '1 millisecond';
    v_expired_to timestamptz;
BEGIN
    -- One run at a time ("idemflor"); the others keep their mark.
    IF NOT pg_try_advisory_xact_lock(7594869008633097330) THEN
        RETURN p_mark;
    END IF;
    -- Read before the lanes: a number drawn after this read is above every
    -- floor the next run sets.
    SELECT s.last_value INTO v_mark FROM jobs_ready_seq s;
    SELECT m.expired_to INTO v_expired_to FROM job_expiry_mark m;
    -- Per lane: its first ready job due within the horizon (`first`: below
    -- the floor if one is there, else from the floor on), and whether it is
    -- idle (no such job, nothing of it finished within the window).
    WITH busy AS MATERIALIZED (
        SELECT DISTINCT j.queue, j.tenant_id, j.priority FROM jobs j
         WHERE j.state IN ('completed', 'cancelled', 'failed')
           AND j.completed_at > now() - (p_raise_every_ms + p_horizon_ms) * interval '1 millisecond'
        UNION
        -- A job of a queue completed by its closure alone.
        SELECT z.queue, z.tenant_id, z.priority FROM job_closures z
         WHERE z.closed_at > now() - (p_raise_every_ms + p_horizon_ms) * interval '1 millisecond'
    ), f AS (
        SELECT o.queue, o.tenant_id, o.priority,
               coalesce(
                   CASE WHEN p_walk_below THEN
                       (SELECT j.ready_seq FROM jobs j
                         WHERE j.queue = o.queue AND j.tenant_id = o.tenant_id
                           AND j.priority = o.priority
                           AND j.state IN ('created', 'retry')
                           AND (SELECT 1 FROM job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL
                           AND j.ready_seq < o.floor AND j.start_after <= v_due
                         ORDER BY j.ready_seq
                         LIMIT 1)
                   ELSE
                       (SELECT min(j.ready_seq) FROM jobs j
                         WHERE j.queue = o.queue AND j.tenant_id = o.tenant_id
                           AND j.priority = o.priority
                           AND j.state IN ('created', 'retry')
                           AND (SELECT 1 FROM job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL
                           AND j.start_after > j.created_at
                           AND j.start_after <= v_due AND j.ready_seq < o.floor)
                   END,
                   (SELECT j.ready_seq FROM jobs j
                     WHERE j.queue = o.queue AND j.tenant_id = o.tenant_id
                       AND j.priority = o.priority
                       AND j.state IN ('created', 'retry')
                       AND (SELECT 1 FROM job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL
                       AND j.ready_seq >= o.floor AND j.start_after <= v_due
                     ORDER BY j.ready_seq
                     LIMIT 1)) AS first
          FROM job_lanes o
    )
    SELECT array_agg(f.queue), array_agg(f.tenant_id), array_agg(f.priority),
           array_agg(f.first),
           array_agg(CASE WHEN f.first IS NOT NULL OR b.queue IS NOT NULL THEN false
                          ELSE (SELECT k.lease_expires_at FROM job_claims k
                                 WHERE k.queue = f.queue AND k.tenant_id = f.tenant_id
                                   AND k.lease_expires_at >= v_expired_to
                                   AND k.priority = f.priority
                                   AND (SELECT o.ready_seq FROM jobs o
                                         WHERE o.id = k.job_id
                                           AND o.state IN ('created', 'retry')) = k.ready_seq
                                   AND (SELECT 1 FROM job_closures z WHERE z.ready_seq = k.ready_seq) IS NULL
                                 ORDER BY k.lease_expires_at DESC
                                 LIMIT 1) IS NULL
                     END)
      INTO v_queues, v_tenants, v_priorities, v_firsts, v_idle
      FROM f
      LEFT JOIN busy b
        ON b.queue = f.queue AND b.tenant_id = f.tenant_id AND b.priority = f.priority;
    -- A floor is lowered only when a ready job is below it (so that a run with
    -- an older mark, of another worker, does not pull floors down); raised at
    -- most every p_raise_every_ms, never above the previous mark, and only
    -- when the lane is not idle: a raise is a row version, and an idle lane has
    -- nothing new below its mark to skip. An idle lane is parked (the fetch
    -- skips it), a lane with a job due within the horizon woken.
    UPDATE job_lanes l
       SET floor = CASE WHEN n.first < l.floor THEN n.first
                        WHEN NOT n.idle AND n.up > l.floor
                             AND l.floor_at <= clock_timestamp() - p_raise_every_ms * interval '1 millisecond'
                        THEN n.up
                        ELSE l.floor END,
           floor_at = CASE WHEN NOT n.idle AND n.up > l.floor
                             AND NOT coalesce(n.first < l.floor, false)
                             AND l.floor_at <= clock_timestamp() - p_raise_every_ms * interval '1 millisecond'
                           THEN clock_timestamp()
                           ELSE l.floor_at END,
           parked = n.idle
      FROM (SELECT u.queue, u.tenant_id, u.priority, u.first, u.idle,
                   CASE WHEN p_mark IS NOT NULL
                        THEN least(p_mark, coalesce(u.first, p_mark)) END AS up
              FROM unnest(v_queues, v_tenants, v_priorities, v_firsts, v_idle)
                   AS u(queue, tenant_id, priority, first, idle)) n
     WHERE l.queue = n.queue AND l.tenant_id = n.tenant_id AND l.priority = n.priority
       AND (n.first < l.floor
            OR (NOT n.idle AND n.up > l.floor
                AND l.floor_at <= clock_timestamp() - p_raise_every_ms * interval '1 millisecond')
            OR l.parked <> n.idle);
    RETURN v_mark;
END;
$function$;
