-- Fair fetch across tenants: a job carries its tenant, and a fetch gives every
-- tenant with ready jobs of a queue a share, instead of oldest-first across all.
--
-- tenant_id  the tenant the job works for ('' for a job of no tenant: a plain
--            queue job). Set by `send` from `JobToSend::tenant`; a stage's job
--            carries its anfrage's tenant.
ALTER TABLE jobs
    ADD COLUMN tenant_id text NOT NULL DEFAULT ''
        CONSTRAINT jobs_tenant_id_check
        CHECK (tenant_id = '' OR (tenant_id ~ '^[a-z0-9][a-z0-9_-]*$' AND length(tenant_id) <= 63));

-- The fetch walks the tenants of a queue with ready jobs (a skip scan over
-- (queue, tenant_id)) and, per tenant, its jobs in priority order: one index for
-- both, in place of (queue, priority DESC, id).
DROP INDEX jobs_fetch_idx;
CREATE INDEX jobs_fetch_idx ON jobs (queue, tenant_id, priority DESC, id)
    WHERE state IN ('created', 'retry');

-- Leases per (queue, tenant): what concurrency caps count. Still keyed so that
-- only conditions on the lease can choose it (see 000020).
DROP INDEX jobs_lease_idx;
CREATE INDEX jobs_lease_idx ON jobs (queue, tenant_id, lease_expires_at)
    WHERE lease_expires_at IS NOT NULL;

-- idemstage_fetch(queues, n): leases up to n ready jobs of the queues and returns
-- them. Per queue, the tenants with ready jobs take turns in the order of their
-- first job (priority, then age: the tenant that has waited longest first); at
-- most n tenants are served, each gets an equal share of n (rounded up), and the
-- jobs are interleaved round-robin (every tenant's first job in turn order, then
-- every tenant's second, ...; within a tenant by priority, then age), so one
-- tenant's backlog cannot take a fetch from the others. With several queues,
-- each gets ceil(n / queues) first (in random order, so that none is always
-- first), then the queues that filled their share get what is left.
--
-- FOR UPDATE SKIP LOCKED per tenant: concurrent fetchers pass each other's rows.
-- The lease is written through the ctids of the locked rows (see the comment of
-- LEASE_SQL in persistence/src/queue/fetch.rs).
CREATE FUNCTION idemstage_fetch(p_queues text[], p_limit integer)
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
BEGIN
    IF p_limit IS NULL OR p_limit <= 0 OR cardinality(p_queues) IS NULL THEN
        RETURN;
    END IF;
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
            RETURN QUERY
        WITH RECURSIVE tenants AS (
            (SELECT j.tenant_id FROM jobs j
              WHERE j.queue = v_queue AND j.state IN ('created', 'retry')
              ORDER BY j.tenant_id LIMIT 1)
            UNION ALL
            SELECT (SELECT j.tenant_id FROM jobs j
                     WHERE j.queue = v_queue AND j.state IN ('created', 'retry')
                       AND j.tenant_id > t.tenant_id
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
        ), shares AS (
            SELECT heads.tenant_id,
                   row_number() OVER (ORDER BY heads.priority DESC, heads.id) AS turn,
                   ceil(v_n::numeric / count(*) OVER ())::integer AS share
              FROM heads
        ), candidates AS (
            SELECT c.ctid, c.id, s.turn,
                   row_number() OVER (PARTITION BY s.tenant_id ORDER BY c.priority DESC, c.id) AS rank
              FROM shares s
              CROSS JOIN LATERAL (
                  SELECT j.ctid, j.priority, j.id FROM jobs j
                   WHERE j.queue = v_queue AND j.tenant_id = s.tenant_id
                     AND j.state IN ('created', 'retry') AND j.start_after <= now()
                   ORDER BY j.priority DESC, j.id
                   LIMIT s.share
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
            GET DIAGNOSTICS v_got = ROW_COUNT;
            v_remaining := v_remaining - v_got;
            IF v_pass = 1 AND v_got = v_n THEN
                v_full := v_full || v_queue;
            END IF;
        END LOOP;
        EXIT WHEN v_remaining <= 0 OR cardinality(p_queues) = 1;
    END LOOP;
END
$$;
