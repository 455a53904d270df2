#!/bin/bash
# Interleaved rounds of pgbench's stage.sql (job=1, pipelined, prepared, 16
# clients) and `idemstage bench pipeline`, each with its client's CPU
# (user + system, from /usr/bin/time): a quick look between full runs of
# `cargo xtask bench`, which is the verdict. Usage:
#   DATABASE_URL=postgres://…/bench bench/stage-pair.sh [rounds] [idemstage binary]
set -euo pipefail
url=${DATABASE_URL:?a database whose name contains "bench"}
rounds=${1:-3}
bin=${2:-target/release/idemstage}
pgbench=$(command -v pgbench || echo /usr/lib/postgresql/15/bin/pgbench)
cd "$(dirname "$0")/.."
for _ in $(seq "$rounds"); do
  DATABASE_URL=$url "$bin" bench claim --setup-only >/dev/null
  # The jobs stage.sql's job mode fetches: clients x batch x 4 (as xtask).
  psql -Xq "$url" -c "INSERT INTO jobs (id, queue, payload, tenant_id) SELECT lpad(g::text, 26, '0'), 'feasibility', '{}'::jsonb, 'bench' FROM generate_series(1, 2048) g; ANALYZE jobs"
  out=$( { /usr/bin/time -f "client_cpu_s %U %S" "$pgbench" -n -M prepared -j 2 -c 16 -T 10 \
      -D pipeline=1 -D tenant=bench -D worker=pgbench -D idle_ms=10000 -D done_stage=done \
      -D next_queue=feasibility -D 'queues={intake,extract,feasibility,calculate}' \
      -D input_hash=63ff0668491a0d9cb9b6b7d42d553b6a7f774d615a7a6285194610f7e29d3042 \
      -D clients=16 -D job=1 -D batch=32 -D k=0 -f bench/pgbench/stage.sql "$url"; } 2>&1 )
  echo "pgbench: $(grep -o 'processed: [0-9]*' <<<"$out") $(grep '^tps' <<<"$out" | cut -d' ' -f3) per s, $(grep client_cpu_s <<<"$out")"
  out=$( { /usr/bin/time -f "client_cpu_s %U %S" env DATABASE_URL="$url" "$bin" bench pipeline --json; } 2>&1 )
  echo "ours: $(grep -o '"stage_executions":[0-9]*' <<<"$out") $(grep -o '"stages_per_s":[0-9.]*' <<<"$out"), $(grep client_cpu_s <<<"$out")"
done
