-- How long a worker whose fetch came back short should wait before it fetches
-- again, when the reason is a control rather than an empty queue: a rate-limited
-- bucket refills at a known time, a held bucket at its held_until, and a capped
-- queue frees a slot whenever one of its jobs ends in any worker (unknown here,
-- so a short re-check). NULL: no ready job of these queues is under a rate or a
-- cap, and the worker waits for a notification or its poll interval.
CREATE FUNCTION idemstage_fetch_wait(p_queues text[])
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
