// The pg-boss reference for `cargo xtask bench`: the queue tests of
// `idemstage bench queue` on the same server, printed as one JSON object.
//
// usage: DATABASE_URL=postgres://... node pgboss.mjs [--jobs 20000] [--concurrency 16]
//        [--drain-batch 256] [--drain-loops 2,4,16] [--fast-workers 1,2,4]
//        [--latency-sends 300] [--latency-gap-ms 20]
//
// pg-boss 12 (https://timgit.github.io/pg-boss/): queue policy 'standard' does not
// de-duplicate by singletonKey; 'short' refuses a second *queued* job with the same
// key, which is the enqueue test's "duplicate among queued jobs". Everything else
// uses 'standard', its fastest.
//
// Workers (api/workers): a work() worker fetches `batchSize` jobs, hands them to
// the handler as one array and completes them with one statement; between fetches
// it waits `pollingIntervalSeconds` (at least 0.5 s) unless `burstWhenBatchFull`
// is set and the last fetch came back full. So:
// - worker_c16: one worker with batchSize 16 and burstWhenBatchFull: 16 jobs in
//   flight, as our QueueWorker at concurrency 16 (batch 16);
// - fast: batchSize = --drain-batch with burstWhenBatchFull, for each
//   localConcurrency in --fast-workers (workers polling independently in this
//   process); the fastest is reported. pg-boss documents no other throughput
//   setting for work().
// - latency: LISTEN/NOTIFY (useListenNotify on the instance, notify on the
//   queue), new in pg-boss 11: a worker is woken when a job is created.
import { readFileSync } from 'node:fs'
import { performance } from 'node:perf_hooks'
import pg from 'pg'
import { PgBoss } from 'pg-boss'
import {
  arg, list, databaseUrl, sleep, round1, round3, quantile, Ledger, timedDrain, drainViolations
} from './common.mjs'

const JOBS = arg('jobs', 20000)
const CONCURRENCY = arg('concurrency', 16)
const DRAIN_BATCH = arg('drain-batch', 256)
const DRAIN_LOOPS = list('drain-loops', '2,4,16')
const FAST_WORKERS = list('fast-workers', '1,2,4')
const LATENCY_SENDS = arg('latency-sends', 300)
const LATENCY_GAP_MS = arg('latency-gap-ms', 20)

const version = JSON.parse(
  readFileSync(new URL('./node_modules/pg-boss/package.json', import.meta.url))
).version
const url = databaseUrl()
const violations = []
const warnings = []

// A schema left by another pg-boss version (the benchmark database is disposable).
{
  const client = new pg.Client({ connectionString: url })
  await client.connect()
  await client.query('DROP SCHEMA IF EXISTS pgboss CASCADE')
  await client.end()
}

const boss = new PgBoss({
  connectionString: url,
  max: CONCURRENCY + 4,
  // No background maintenance or cron during the timed runs (ours has none either
  // in the drain loop); its workers still poll.
  supervise: false,
  schedule: false,
  useListenNotify: true
})
boss.on('error', e => console.error('pg-boss error:', e.message))
boss.on('warning', w => warnings.push(w.type ?? String(w.message ?? w)))
await boss.start()
const db = boss.getDb()
const count = async (sql, params) => Number((await db.executeSql(sql, params)).rows[0].n)
const completedIn = queue => count(
  "SELECT count(*) AS n FROM pgboss.job WHERE name = $1 AND state = 'completed'", [queue])

const RUN = Date.now().toString(36)
let queues = 0
async function freshQueue (name, options) {
  const queue = `${name}_${RUN}_${queues++}`
  await boss.createQueue(queue, options)
  return queue
}

// A backlog of JOBS jobs in batches of 1,000, then VACUUM ANALYZE (as ours).
async function backlog (name) {
  const queue = await freshQueue(name, { policy: 'standard' })
  for (let i = 0; i < JOBS; i += 1000) {
    await boss.insert(queue, Array.from({ length: Math.min(1000, JOBS - i) }, (_, k) => ({
      data: { i: i + k }
    })))
  }
  await db.executeSql('VACUUM ANALYZE pgboss.job')
  return queue
}

// (a) enqueue: send i uses key i mod JOBS/2, so the second half is refused.
const ENQUEUE = await freshQueue('bench_enqueue', { policy: 'short' })
const keys = Math.ceil(JOBS / 2)
let next = 0
let refused = 0
let t0 = performance.now()
await Promise.all(Array.from({ length: CONCURRENCY }, async () => {
  for (let i = next++; i < JOBS; i = next++) {
    const id = await boss.send(ENQUEUE, { i }, { singletonKey: `k${i % keys}` })
    if (id === null) refused++
  }
}))
const enqueueS = (performance.now() - t0) / 1000
const distinct = await count('SELECT count(*) AS n FROM pgboss.job WHERE name = $1', [ENQUEUE])
if (distinct !== keys) violations.push(`enqueue created ${distinct} jobs, expected ${keys}`)

// (b) drain with the raw API: fetch(batch) + complete(ids) loops, once per loop count.
async function drain (loops) {
  const queue = await backlog(`bench_drain_${loops}`)
  let drained = 0
  const t0 = performance.now()
  await Promise.all(Array.from({ length: loops }, async () => {
    for (;;) {
      const jobs = await boss.fetch(queue, { batchSize: DRAIN_BATCH })
      if (!jobs || jobs.length === 0) return
      await boss.complete(queue, jobs.map(j => j.id))
      drained += jobs.length
    }
  }))
  const perS = round1(drained / ((performance.now() - t0) / 1000))
  const completed = await completedIn(queue)
  if (drained !== JOBS || completed !== JOBS) {
    violations.push(`drain with ${loops} loops: ${drained} fetched, ${completed} completed of ${JOBS}`)
  }
  return { loops, perS }
}
const drains = []
for (const loops of DRAIN_LOOPS) drains.push(await drain(loops))
const fastestDrain = drains.reduce((a, b) => (b.perS > a.perS ? b : a))

// (c) the backlog worked off by work() workers with a no-op handler.
async function workerDrain (label, options) {
  const queue = await backlog(`bench_${label}`)
  const ledger = new Ledger()
  const d = await timedDrain({
    jobs: JOBS,
    ledger,
    start: () => boss.work(queue, options, async jobs => {
      for (const job of jobs) ledger.handle(job.id)
    }),
    completed: () => completedIn(queue)
  })
  await boss.offWork(queue, { wait: true })
  violations.push(...drainViolations(label, JOBS, d))
  return d
}
const c16 = await workerDrain('worker_c16', { batchSize: CONCURRENCY, burstWhenBatchFull: true })
const fast = []
for (const workers of FAST_WORKERS) {
  const d = await workerDrain(`fast_${workers}`, {
    batchSize: DRAIN_BATCH, localConcurrency: workers, burstWhenBatchFull: true
  })
  fast.push({ workers, ...d })
}
const fastest = fast.reduce((a, b) => (b.perS > a.perS ? b : a))

// (d) pickup latency to an idle worker woken by NOTIFY.
const LATENCY = await freshQueue('bench_latency', { policy: 'standard', notify: true })
const started = new Map()
await boss.work(LATENCY, { batchSize: CONCURRENCY, pollingIntervalSeconds: 0.5 }, async jobs => {
  const now = performance.now()
  for (const job of jobs) started.set(job.id, now)
})
await sleep(1000)
const sent = []
for (let i = 0; i < LATENCY_SENDS; i++) {
  const id = await boss.send(LATENCY, { i })
  sent.push([id, performance.now()])
  await sleep(LATENCY_GAP_MS)
}
const deadline = performance.now() + 10000
while (started.size < sent.length && performance.now() < deadline) await sleep(10)
const ms = sent.filter(([id]) => started.has(id))
  .map(([id, at]) => Math.max(0, started.get(id) - at))
  .sort((a, b) => a - b)
if (ms.length !== LATENCY_SENDS) violations.push(`latency: ${ms.length} of ${LATENCY_SENDS} jobs reached a handler`)
await boss.stop({ graceful: false, wait: true })

console.log(JSON.stringify({
  peer: 'pg-boss',
  version,
  enqueue_policy: 'short',
  sends: JOBS,
  enqueue_per_s: round1(JOBS / enqueueS),
  duplicates_refused: refused,
  distinct_jobs_created: distinct,
  drain_batch: DRAIN_BATCH,
  drain_loops: fastestDrain.loops,
  drain_per_s: fastestDrain.perS,
  ...Object.fromEntries(drains.map(d => [`drain_per_s_loops_${d.loops}`, d.perS])),
  worker_c16_per_s: c16.perS,
  worker_c16_config: `work() batchSize ${CONCURRENCY}, burstWhenBatchFull`,
  fast_per_s: fastest.perS,
  fast_config: `work() batchSize ${DRAIN_BATCH}, localConcurrency ${fastest.workers}, burstWhenBatchFull`,
  ...Object.fromEntries(fast.map(d => [`fast_per_s_workers_${d.workers}`, d.perS])),
  latency_samples: ms.length,
  latency_ms_p50: round3(quantile(ms, 0.5)),
  latency_ms_p99: round3(quantile(ms, 0.99)),
  warnings,
  violations
}))
// A drain that lost, repeated or left jobs is not a measurement.
if (violations.length > 0) {
  console.error('pg-boss:', violations.join('; '))
  process.exitCode = 1
}
