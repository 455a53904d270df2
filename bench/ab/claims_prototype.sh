#!/bin/bash
# Run from the repository root against a server (it creates and drops the
# database claims_bench there). BENCHMARKS.md, section "2026-12-04 23:30".
# The drain loop (fetch 32, complete them, one transaction) of today's storage
# against two prototypes of docs/storage-under-pressure.md's next steps, on
# one lane with a backlog of 500,000 jobs and no senders:
#   rows:     today's idemstage_fetch and the fenced completion (UPDATEs of jobs)
#   claims:   the fetch appends a claim (jobs untouched), the completion
#             updates the job's row, fenced by its claim (step 2)
#   closures: the same fetch; the completion appends a closure (step 3)
# Prints, per variant and round: transactions/s, and the dead tuples each job
# left (autovacuum off on the tables).
set -e
TMP=$(mktemp -d)
BASE=${1:?usage: bench/ab/claims_prototype.sh postgres://user@host:port [idemstage binary] [rounds]}
DB=$BASE/claims_bench
ROUNDS=${3:-3}
setup() {
  psql -q $BASE/postgres -c "DROP DATABASE IF EXISTS claims_bench" -c "CREATE DATABASE claims_bench"
  DATABASE_URL=$DB ${BIN:-target/release/idemstage} migrate >/dev/null
  psql -q $DB <<'SQL'
CREATE TABLE job_claims (
    ready_seq bigint PRIMARY KEY, job_id text NOT NULL, attempt integer NOT NULL,
    queue text NOT NULL, tenant_id text NOT NULL, priority integer NOT NULL,
    claimed_at timestamptz NOT NULL DEFAULT now(), lease_expires_at timestamptz NOT NULL);
CREATE UNIQUE INDEX ON job_claims (job_id, attempt);
CREATE INDEX ON job_claims (queue, tenant_id, priority, lease_expires_at);
CREATE TABLE job_closures (
    job_id text NOT NULL, attempt integer NOT NULL, outcome text NOT NULL,
    closed_at timestamptz NOT NULL DEFAULT now(), output jsonb,
    PRIMARY KEY (job_id, attempt));
ALTER TABLE jobs SET (autovacuum_enabled = off);
ALTER TABLE job_lanes SET (autovacuum_enabled = off);
ALTER TABLE job_claims SET (autovacuum_enabled = off);
ALTER TABLE job_closures SET (autovacuum_enabled = off);

CREATE FUNCTION proto_fetch(v_queue text, v_n integer) RETURNS TABLE(id text, attempt integer)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off AS $$
#variable_conflict use_column
DECLARE v_priorities integer[]; v_floors bigint[]; v_tenant text;
BEGIN
    SELECT array_agg(l.priority), array_agg(l.floor), min(l.tenant_id)
      INTO v_priorities, v_floors, v_tenant
      FROM job_lanes l WHERE l.queue = v_queue AND NOT l.parked;
    IF v_priorities IS NULL THEN RETURN; END IF;
    RETURN QUERY
    WITH next AS (
        SELECT c.id, c.ready_seq, c.priority, c.attempt, c.expire_in_ms, c.tenant_id,
               c.payload
          FROM unnest(v_priorities, v_floors) AS l(priority, floor)
          CROSS JOIN LATERAL (
              SELECT j.id, j.ready_seq, j.priority, j.attempt, j.expire_in_ms, j.tenant_id,
                     j.payload
                FROM jobs j
               WHERE j.queue = v_queue AND j.tenant_id = v_tenant AND j.priority = l.priority
                 AND j.state IN ('created', 'retry') AND j.ready_seq >= l.floor
                 AND j.start_after <= now()
                 -- A scalar subquery, a probe per entry: as NOT EXISTS it is
                 -- planned as a merge anti join over every claim.
                 AND (SELECT 1 FROM job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL
               ORDER BY j.ready_seq
               LIMIT v_n
               FOR UPDATE SKIP LOCKED) c
         ORDER BY c.priority DESC, c.ready_seq
         LIMIT v_n
    ), claimed AS (
        INSERT INTO job_claims AS k (ready_seq, job_id, attempt, queue, tenant_id, priority,
                                     lease_expires_at)
        SELECT n.ready_seq, n.id, n.attempt + 1, v_queue, n.tenant_id, n.priority,
               now() + n.expire_in_ms * interval '1 millisecond'
          FROM next n
        ON CONFLICT (ready_seq) DO NOTHING
        RETURNING k.job_id, k.attempt
    )
    -- The job's columns from `next` (a join back to jobs is planned for the
    -- CTE's default estimate, a merge over the whole primary key).
    SELECT c.job_id::text, c.attempt FROM claimed c JOIN next n ON n.id = c.job_id;
END $$;

-- The floor of each lane to its first job neither claimed nor finished (no
-- senders here, so no mark to respect).
CREATE FUNCTION proto_advance() RETURNS void LANGUAGE sql SET jit = off AS $$
    UPDATE job_lanes l SET floor = coalesce((
        SELECT j.ready_seq FROM jobs j
         WHERE j.queue = l.queue AND j.tenant_id = l.tenant_id AND j.priority = l.priority
           AND j.state IN ('created', 'retry') AND j.ready_seq >= l.floor
           AND (SELECT 1 FROM job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL
         ORDER BY j.ready_seq LIMIT 1), l.floor)
$$;

CREATE FUNCTION cycle_rows(v_n integer) RETURNS bigint LANGUAGE plpgsql SET jit = off AS $$
DECLARE ids text[]; atts integer[]; done bigint;
BEGIN
    SELECT array_agg(f.id), array_agg(f.attempt) INTO ids, atts
      FROM idemstage_fetch(ARRAY['q'], v_n) f;
    UPDATE jobs j SET state = 'completed', completed_at = now(), lease_expires_at = NULL
      FROM unnest(ids, atts) t(id, a)
     WHERE j.id = t.id AND j.attempt = t.a AND j.state = 'active';
    GET DIAGNOSTICS done = ROW_COUNT;
    RETURN done;
END $$;

CREATE FUNCTION cycle_claims(v_n integer) RETURNS bigint LANGUAGE plpgsql SET jit = off AS $$
DECLARE ids text[]; atts integer[]; done bigint;
BEGIN
    SELECT array_agg(f.id), array_agg(f.attempt) INTO ids, atts FROM proto_fetch('q', v_n) f;
    UPDATE jobs j SET state = 'completed', completed_at = now(), attempt = k.attempt,
                      started_at = k.claimed_at
      FROM unnest(ids, atts) t(id, a), job_claims k
     WHERE j.id = t.id AND k.job_id = t.id AND k.attempt = t.a
       AND j.ready_seq = k.ready_seq AND j.state IN ('created', 'retry');
    GET DIAGNOSTICS done = ROW_COUNT;
    RETURN done;
END $$;

CREATE FUNCTION cycle_closures(v_n integer) RETURNS bigint LANGUAGE plpgsql SET jit = off AS $$
DECLARE ids text[]; atts integer[]; done bigint;
BEGIN
    SELECT array_agg(f.id), array_agg(f.attempt) INTO ids, atts FROM proto_fetch('q', v_n) f;
    INSERT INTO job_closures (job_id, attempt, outcome)
    SELECT t.id, t.a, 'completed'
      FROM unnest(ids, atts) t(id, a)
      JOIN job_claims k ON k.job_id = t.id AND k.attempt = t.a
      JOIN jobs j ON j.id = t.id AND j.ready_seq = k.ready_seq AND j.state IN ('created', 'retry')
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS done = ROW_COUNT;
    RETURN done;
END $$;
SQL
}
load() {
  psql -q $DB <<'SQL'
TRUNCATE jobs, job_lanes, job_claims, job_closures;
INSERT INTO jobs (id, queue, payload)
SELECT lpad(g::text, 26, '0'), 'q', '{"n": 1}'::jsonb FROM generate_series(1, 500000) g;
VACUUM ANALYZE jobs, job_lanes, job_claims, job_closures;
SELECT pg_stat_reset();
SQL
}
BIN=${2:-target/release/idemstage}
setup
for round in $(seq 1 $ROUNDS); do
  for variant in rows claims closures; do
    load
    echo "SELECT cycle_$variant(32);" > $TMP/cycle.sql
    # The floors' run once a second beside the loop, as a worker would.
    # (Today's run raises a floor no higher than its previous run's mark.)
    ( mark=NULL; while true; do
        if [ $variant = rows ]; then mark=$(psql -qAt $DB -c "SELECT idemstage_advance_floors($mark, 3000, 0)")
        else psql -qAt $DB -c "SELECT proto_advance()" >/dev/null; fi
        sleep 1
      done ) & floors=$!
    tps=$(pgbench -n -M prepared -c 2 -T 8 -f $TMP/cycle.sql $DB 2>/dev/null | grep -E "^tps" | awk '{print $3}')
    kill $floors; wait $floors 2>/dev/null || true
    sleep 1
    psql -qAt $DB -c "SELECT '$variant', $round, round($tps * 32), (SELECT count(*) FROM jobs WHERE state = 'completed') + (SELECT count(*) FROM job_closures),
      (SELECT string_agg(relname || '=' || n_dead_tup, ' ' ORDER BY relname) FROM pg_stat_user_tables WHERE n_dead_tup > 0)"
  done
done
