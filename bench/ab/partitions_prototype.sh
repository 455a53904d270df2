#!/bin/bash
# Run from the repository root against a server (it creates and drops the
# database partitions_bench there). BENCHMARKS.md, section "2026-12-05 11:30".
# What day partitions (docs/storage-under-pressure.md, step 4) cost a statement
# by exact key, the kind every fenced end and every renewal is: a table of
# 1,000,000 jobs, plain or range-partitioned by id into 8 days, and its claims
# keyed by the entry alone (plain) or by (job, entry) on the same days.
# Statements as the library sends them: prepared, generic plans (the fetch and
# floors functions force them; a driver's prepared statement gets one after
# five runs), so a partitioned table is pruned when each execution starts
# (days); and, for the partitioned tables, custom plans (days_custom: planned
# with the key's value each time, pruned by the planner).
# Prints transactions/s per statement, variant and round (pgbench -M prepared,
# one client, 10 s each), variants alternating.
set -e
BASE=${1:?usage: bench/ab/partitions_prototype.sh postgres://user@host:port [rounds]}
DB=$BASE/partitions_bench
ROUNDS=${2:-3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
psql -q "$BASE/postgres" -c "DROP DATABASE IF EXISTS partitions_bench" -c "CREATE DATABASE partitions_bench"
psql -q "$DB" <<'SQL'
-- Ids sort by day as ULIDs do: the day's letter, then a number.
CREATE FUNCTION job_id(n bigint) RETURNS text IMMUTABLE LANGUAGE sql
    AS $$ SELECT chr(65 + (n % 8)::int) || lpad(n::text, 9, '0') $$;
CREATE TABLE jobs_plain (id text PRIMARY KEY, state text NOT NULL, ready_seq bigint NOT NULL,
                         payload jsonb NOT NULL, completed_at timestamptz);
CREATE TABLE jobs_days (id text NOT NULL, state text NOT NULL, ready_seq bigint NOT NULL,
                        payload jsonb NOT NULL, completed_at timestamptz, PRIMARY KEY (id))
    PARTITION BY RANGE (id);
CREATE TABLE claims_plain (ready_seq bigint PRIMARY KEY, job_id text NOT NULL,
                           attempt int NOT NULL, lease_expires_at timestamptz NOT NULL);
CREATE TABLE claims_days (ready_seq bigint NOT NULL, job_id text NOT NULL,
                          attempt int NOT NULL, lease_expires_at timestamptz NOT NULL,
                          PRIMARY KEY (job_id, ready_seq)) PARTITION BY RANGE (job_id);
DO $$ BEGIN
  FOR d IN 0..7 LOOP
    EXECUTE format('CREATE TABLE jobs_day%s PARTITION OF jobs_days FOR VALUES FROM (%L) TO (%L)',
                   d, chr(65 + d), chr(66 + d));
    EXECUTE format('CREATE TABLE claims_day%s PARTITION OF claims_days FOR VALUES FROM (%L) TO (%L)',
                   d, chr(65 + d), chr(66 + d));
  END LOOP;
END $$;
INSERT INTO jobs_plain SELECT job_id(n), 'created', n, '{"i": 1}' FROM generate_series(1, 1000000) n;
INSERT INTO jobs_days SELECT * FROM jobs_plain;
INSERT INTO claims_plain SELECT n, job_id(n), 1, now() + interval '1 hour' FROM generate_series(1, 1000000) n;
INSERT INTO claims_days SELECT * FROM claims_plain;
VACUUM ANALYZE;
SQL
# The fenced end's shape: the job by id, its claim by entry (and, partitioned,
# by job), the row written.
for v in plain days; do
  if [ $v = plain ]; then claim="k.ready_seq = j.ready_seq"; else claim="k.job_id = j.id AND k.ready_seq = j.ready_seq"; fi
  cat > "$TMP/read_$v.sql" <<SQL
\set n random(1, 1000000)
SELECT j.state, (SELECT k.attempt FROM claims_$v k WHERE $claim) FROM jobs_$v j WHERE j.id = job_id(:n);
SQL
  cat > "$TMP/end_$v.sql" <<SQL
\set n random(1, 1000000)
UPDATE jobs_$v j SET completed_at = now()
 WHERE j.id = job_id(:n) AND (SELECT k.attempt FROM claims_$v k WHERE $claim) = 1;
SQL
done
for r in $(seq 1 "$ROUNDS"); do
  for s in read end; do
    for v in plain days days_custom; do
      mode=force_generic_plan; file=$v
      if [ $v = days_custom ]; then mode=force_custom_plan; file=days; fi
      tps=$(PGOPTIONS="-c plan_cache_mode=$mode" pgbench -n -M prepared -c 1 -T 10 \
              -f "$TMP/${s}_$file.sql" "$DB" 2>/dev/null | awk '/^tps/ {print $3}')
      echo "round $r $s $v tps $tps"
    done
  done
done
psql -q "$BASE/postgres" -c "DROP DATABASE partitions_bench"
