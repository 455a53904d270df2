CREATE OR REPLACE FUNCTION idemstage_lane_heads(v_queue text) RETURNS TABLE(tenant_id text, priority integer, floor bigint, head bigint)
    LANGUAGE sql STABLE
    AS $$
    SELECT l.tenant_id, l.priority, l.floor, h.ready_seq
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
