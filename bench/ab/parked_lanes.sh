#!/bin/bash
# Run from the repository root against a server (it creates and drops the
# database lanes_bench there). BENCHMARKS.md, section "2026-12-04 15:50".
# A/B of the fetch with 1,000 idle lanes parked vs awake, and the send with the
# wake vs without it, on one database.
set -e
TMP=$(mktemp -d)
BASE=${1:?usage: bench/ab/parked_lanes.sh postgres://user@host:port [idemstage binary]}
DB=$BASE/lanes_bench
psql -q $BASE/postgres -c "DROP DATABASE IF EXISTS lanes_bench" -c "CREATE DATABASE lanes_bench"
DATABASE_URL=$DB ${2:-target/release/idemstage} migrate >/dev/null
psql -q $DB <<'SQL'
-- 1,000 idle tenants: one job each, finished an hour ago; one busy tenant with a backlog.
INSERT INTO jobs (id, queue, payload, tenant_id, state, completed_at)
SELECT lpad(g::text, 26, '0'), 'lq', '{}'::jsonb, 't' || lpad(g::text, 4, '0'), 'completed', now() - interval '1 hour'
  FROM generate_series(1, 1000) g;
INSERT INTO jobs (id, queue, payload, tenant_id)
SELECT lpad((100000 + g)::text, 26, '0'), 'lq', '{}'::jsonb, 'busy'
  FROM generate_series(1, 100000) g;
ANALYZE;
SELECT idemstage_advance_floors(NULL, 3000, 2000);
SELECT count(*) FILTER (WHERE parked) AS parked, count(*) AS lanes FROM job_lanes;
SQL
cat > $TMP/fetch.sql <<'SQL'
BEGIN;
SELECT count(*) FROM idemstage_fetch_plain('lq', 32);
ROLLBACK;
SQL
cat > $TMP/send.sql <<'SQL'
\set n random(1, 1000000000)
INSERT INTO jobs (id, queue, payload, tenant_id) VALUES (lpad((1000000000 + :n)::text, 26, '0'), 'sq', '{}'::jsonb, 't0001');
SQL
for round in 1 2 3; do
  for mode in parked awake; do
    if [ $mode = parked ]; then psql -qAt $DB -c "UPDATE job_lanes SET parked = (tenant_id <> 'busy') WHERE queue = 'lq'"; else psql -qAt $DB -c "UPDATE job_lanes SET parked = false WHERE queue = 'lq'"; fi
    psql -qAt $DB -c "VACUUM ANALYZE job_lanes"
    tps=$(pgbench -n -M prepared -c 1 -T 15 -f $TMP/fetch.sql $DB 2>/dev/null | grep -E "^latency average" | awk '{print $4}')
    echo "fetch round $round $mode latency_ms $tps"
  done
done
# The send: the statement trigger with the wake (now) vs without it (before).
NOW=$(psql -qAt $DB -c "SELECT pg_get_functiondef('idemstage_jobs_lanes'::regproc)")
BEFORE="CREATE OR REPLACE FUNCTION public.idemstage_jobs_lanes() RETURNS trigger LANGUAGE plpgsql AS \$\$
BEGIN
    INSERT INTO public.job_lanes (queue, tenant_id, priority)
    SELECT DISTINCT n.queue, n.tenant_id, n.priority FROM sent_jobs n
     ORDER BY 1, 2, 3
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END;
\$\$;"
for round in 1 2 3; do
  for mode in wake before; do
    if [ $mode = wake ]; then psql -qAt $DB -c "$NOW"; else psql -qAt $DB -c "$BEFORE"; fi
    lat=$(pgbench -n -M prepared -c 2 -T 10 -f $TMP/send.sql $DB 2>/dev/null | grep -E "^latency average" | awk '{print $4}')
    echo "send round $round $mode latency_ms $lat"
  done
done
psql -qAt $DB -c "$NOW"
