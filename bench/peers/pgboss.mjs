// The pg-boss reference for `cargo xtask bench`: the same three queue tests as
// `idemstage bench queue`, on the same server, printed as one JSON object.
//
// usage: DATABASE_URL=postgres://... node pgboss.mjs [--jobs 20000] [--concurrency 16]
//        [--drain-batch 256] [--drain-loops 2,4,16] [--latency-sends 300] [--latency-gap-ms 20]
//
// Queue policies (pg-boss 10): 'standard' does not de-duplicate by singletonKey;
// 'singleton' only refuses a second *active* job; 'short' refuses a second *created*
// (queued) job with the same key (unique index job_i1 on (name, singleton_key) where
// state = 'created'), which is the test's "duplicate among queued jobs". 'stately'
// would refuse it too, but also groups by key on every fetch. The enqueue test uses
// 'short'; the drain and latency tests use 'standard', pg-boss's fastest.
import { readFileSync } from 'node:fs'
import { performance } from 'node:perf_hooks'
import PgBoss from 'pg-boss'

const arg = (name, dflt) => {
  const i = process.argv.indexOf(`--${name}`)
  return i >= 0 ? Number(process.argv[i + 1]) : dflt
}
const JOBS = arg('jobs', 20000)
const CONCURRENCY = arg('concurrency', 16)
const DRAIN_BATCH = arg('drain-batch', 256)
// The drain runs once per loop count and reports each and the fastest: pg-boss
// drains fastest with few loops (measured here 14,800 jobs/s with 2, 13,900 with
// 4, 10,700 with 8, 6,600 with 16: its fetches contend), and so does ours.
const DRAIN_LOOPS = (() => {
  const i = process.argv.indexOf('--drain-loops')
  return (i >= 0 ? process.argv[i + 1] : '2,4,16').split(',').map(Number)
})()
const LATENCY_SENDS = arg('latency-sends', 300)
const LATENCY_GAP_MS = arg('latency-gap-ms', 20)

const version = JSON.parse(
  readFileSync(new URL('./node_modules/pg-boss/package.json', import.meta.url))
).version
const url = process.env.DATABASE_URL
if (!url) throw new Error('DATABASE_URL is not set')

const sleep = ms => new Promise(resolve => setTimeout(resolve, ms))
const round1 = x => Math.round(x * 10) / 10
const round3 = x => Math.round(x * 1000) / 1000
const quantile = (sorted, q) =>
  sorted[Math.min(sorted.length, Math.max(1, Math.ceil(q * sorted.length))) - 1]

const boss = new PgBoss({
  connectionString: url,
  max: CONCURRENCY + 4,
  // No background maintenance or cron during the timed runs (ours has none either
  // in the drain loop); its own workers still poll.
  supervise: false,
  schedule: false
})
boss.on('error', e => console.error('pg-boss error:', e.message))
await boss.start()
const db = boss.getDb()
const count = async (sql, params) => Number((await db.executeSql(sql, params)).rows[0].n)

// Fresh queues per run (each is its own partition in pg-boss 10); deleteQueue of
// a queue that still has jobs fails there.
const RUN = Date.now().toString(36)
async function freshQueue (name, policy) {
  const queue = `${name}_${RUN}`
  await boss.createQueue(queue, { policy })
  return queue
}

// (a) enqueue: send i uses key i mod JOBS/2, so the second half is refused.
const ENQUEUE = await freshQueue('bench_enqueue', 'short')
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

// (b) drain: bulk insert, VACUUM ANALYZE, then fetch(256)+complete loops; once per
// loop count, each on a fresh queue.
async function drain (loops) {
  const queue = await freshQueue(`bench_drain_${loops}`, 'standard')
  for (let i = 0; i < JOBS; i += 1000) {
    await boss.insert(Array.from({ length: Math.min(1000, JOBS - i) }, (_, k) => ({
      name: queue, data: { i: i + k }
    })))
  }
  await db.executeSql('VACUUM ANALYZE pgboss.job')
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
  const completed = await count(
    "SELECT count(*) AS n FROM pgboss.job WHERE name = $1 AND state = 'completed'", [queue])
  return { loops, drained, completed, perS }
}
const drains = []
for (const loops of DRAIN_LOOPS) drains.push(await drain(loops))
const fastest = drains.reduce((a, b) => (b.perS > a.perS ? b : a))

// (c) pickup latency to idle workers. pg-boss 10 has no LISTEN/NOTIFY: a worker
// polls, at least 0.5 s apart, so CONCURRENCY workers (as our concurrency) poll
// at that minimum, taking up to CONCURRENCY jobs each.
const LATENCY = await freshQueue('bench_latency', 'standard')
const started = new Map()
for (let w = 0; w < CONCURRENCY; w++) {
  await boss.work(LATENCY, { pollingIntervalSeconds: 0.5, batchSize: CONCURRENCY }, async jobs => {
    const now = performance.now()
    for (const job of jobs) started.set(job.id, now)
  })
  await sleep(500 / CONCURRENCY)
}
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
await boss.stop({ graceful: false, wait: true })

console.log(JSON.stringify({
  version,
  enqueue_policy: 'short',
  sends: JOBS,
  enqueue_per_s: round1(JOBS / enqueueS),
  duplicates_refused: refused,
  distinct_jobs_created: distinct,
  drain_jobs: fastest.drained,
  drain_completed_in_db: fastest.completed,
  drain_batch: DRAIN_BATCH,
  drain_loops: fastest.loops,
  drain_per_s: fastest.perS,
  ...Object.fromEntries(drains.map(d => [`drain_per_s_loops_${d.loops}`, d.perS])),
  drain_incomplete: drains.filter(d => d.drained !== JOBS || d.completed !== JOBS).map(d => d.loops),
  latency_samples: ms.length,
  latency_ms_p50: round3(quantile(ms, 0.5)),
  latency_ms_p99: round3(quantile(ms, 0.99))
}))
// A drain that lost or left jobs is not a measurement.
if (drains.some(d => d.drained !== JOBS || d.completed !== JOBS)) {
  console.error('pg-boss drain incomplete:', JSON.stringify(drains))
  process.exitCode = 1
}
