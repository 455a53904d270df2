-- Priorities with aging (issue 32, item 4). Within a tenant's share the fetch
-- takes the highest priority first; with `queue_controls.aging_ms` set for a
-- queue (scope '', `idemstage limit --stage S --priority-aging 30s`), a job's
-- priority there counts one more for every `aging_ms` it has been ready (from
-- its `start_after`), up to the highest priority with a ready job in the queue,
-- so that an old low-priority job is taken before newer high-priority ones
-- and none starves. Jobs of one lane keep their order; the tenants' turns (the
-- fair share between tenants) do not age. A queue with a control row is
-- fetched by `idemstage_fetch_controlled`, so only that function ages; a
-- queue without one is fetched as before.
ALTER TABLE queue_controls
    ADD COLUMN aging_ms bigint CHECK (aging_ms >= 1),
    ADD CONSTRAINT queue_controls_aging_ck CHECK (aging_ms IS NULL OR scope = '');
ALTER TABLE queue_control_changes ADD COLUMN aging_ms bigint;

-- A job's priority as the fetch ranks it: `p_priority` plus one per `p_aging_ms`
-- since `p_start_after`, at most `p_top` (and never below its own); without an
-- interval, its own.
CREATE FUNCTION idemstage_aged_priority(p_priority integer, p_start_after timestamptz,
                                        p_aging_ms bigint, p_top integer)
RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN p_aging_ms IS NULL OR p_top IS NULL OR p_priority >= p_top
                THEN p_priority
                ELSE least(p_top::numeric,
                           p_priority + floor(greatest(extract(epoch FROM now() - p_start_after), 0)
                                              * 1000 / p_aging_ms))::integer
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
DECLARE
    v_tenants text[];
    v_priorities integer[];
    v_floors bigint[];
    v_heads bigint[];
    v_aging_ms bigint;
    v_top integer;
BEGIN
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


-- The record of control changes keeps the interval too (a change of it alone
-- is a `limits` change).
CREATE OR REPLACE FUNCTION public.idemstage_record_control_change() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_change text;
    v_tag text;
    v_setting text;
    v_actor text;
    v_owner oid;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        IF OLD.paused IS DISTINCT FROM NEW.paused THEN
            v_change := CASE WHEN NEW.paused THEN 'pause' ELSE 'resume' END;
        ELSIF (OLD.max_active, OLD.rate_count, OLD.rate_period_ms, OLD.rate_burst, OLD.weight,
               OLD.aging_ms)
              IS DISTINCT FROM
              (NEW.max_active, NEW.rate_count, NEW.rate_period_ms, NEW.rate_burst, NEW.weight,
               NEW.aging_ms) THEN
            v_change := 'limits';
        ELSE
            -- Nothing an operator sees changed (the fetch's lock, a repeated
            -- setting): not a change, and nothing more to read.
            RETURN NULL;
        END IF;
    END IF;
    -- Only the owner's own tables: the one this trigger is on, and the record.
    LOCK TABLE public.queue_control_changes IN ROW EXCLUSIVE MODE;
    SELECT r.oid INTO v_owner FROM pg_catalog.pg_roles r WHERE r.rolname = current_user;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_class c
                    WHERE c.oid = pg_catalog.to_regclass('public.queue_control_changes')
                      AND c.relowner = v_owner)
       OR NOT EXISTS (SELECT FROM pg_catalog.pg_class c
                       WHERE c.oid = TG_RELID
                         AND c.oid = pg_catalog.to_regclass('public.queue_controls')
                         AND c.relowner = v_owner)
    THEN
        RAISE EXCEPTION 'idemstage: public.queue_controls or public.queue_control_changes is not owned by %: not recording into it', current_user
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    -- The actor only if the setting is this statement's (idemstage_actor_tag()).
    v_tag := (extract(epoch FROM pg_catalog.statement_timestamp()) * 1000000)::bigint::text || ':';
    v_setting := coalesce(pg_catalog.current_setting('idemstage.actor', true), '');
    IF pg_catalog.starts_with(v_setting, v_tag) THEN
        v_actor := nullif(pg_catalog.substr(v_setting, pg_catalog.length(v_tag) + 1), '');
    END IF;
    IF TG_OP = 'DELETE' THEN
        INSERT INTO public.queue_control_changes (queue, scope, change, actor, db_user)
        VALUES (OLD.queue, OLD.scope, 'remove', v_actor, session_user);
        RETURN NULL;
    END IF;
    IF TG_OP = 'INSERT' THEN
        v_change := CASE WHEN NEW.paused THEN 'pause' ELSE 'limits' END;
    END IF;
    INSERT INTO public.queue_control_changes
        (queue, scope, change, paused, max_active, rate_count, rate_period_ms,
         rate_burst, weight, aging_ms, actor, db_user)
    VALUES (NEW.queue, NEW.scope, v_change, NEW.paused, NEW.max_active,
            NEW.rate_count, NEW.rate_period_ms, NEW.rate_burst, NEW.weight,
            NEW.aging_ms, v_actor, session_user);
    RETURN NULL;
END
$$;

