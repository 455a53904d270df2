// The graphile-worker reference for `cargo xtask bench`: the queue tests of
// `idemstage bench queue` on the same server, printed as one JSON object.
//
// usage: DATABASE_URL=postgres://... node graphile.mjs [--jobs 20000] [--concurrency 16]
//        [--latency-sends 300] [--latency-gap-ms 20]
//
// graphile-worker 0.18 (https://worker.graphile.org/docs/), its library API:
// - enqueue: addJob with a jobKey and jobKeyMode 'unsafe_dedupe', the mode that
//   refuses a second job with the same key (the default 'replace' overwrites the
//   queued job instead; docs/job-key);
// - the backlog: addJobs in batches of 1,000;
// - worker_c16: run() with concurrency 16 and the defaults (each worker fetches
//   and completes its own job);
// - worker_c16_batched: the same with the batching of docs/performance#batching at
//   the size its option docs suggest to start from: localQueue.size =
//   concurrency + 1, completeJobBatchDelay 0, failJobBatchDelay 0;
// - fast: the configuration docs/performance gives for its quick stats
//   (concurrentJobs 24, maxPoolSize 25, localQueue.size 500,
//   completeJobBatchDelay 0, failJobBatchDelay 0);
// - latency: run() at concurrency 16, woken by its LISTEN/NOTIFY.
import { readFileSync } from 'node:fs'
import { performance } from 'node:perf_hooks'
import pg from 'pg'
import { Logger, makeWorkerUtils, run, runMigrations } from 'graphile-worker'
import {
  arg, databaseUrl, sleep, round1, round3, quantile, Ledger, timedDrain, drainViolations
} from './common.mjs'

const JOBS = arg('jobs', 20000)
const CONCURRENCY = arg('concurrency', 16)
const LATENCY_SENDS = arg('latency-sends', 300)
const LATENCY_GAP_MS = arg('latency-gap-ms', 20)

const version = JSON.parse(
  readFileSync(new URL('./node_modules/graphile-worker/package.json', import.meta.url))
).version
const connectionString = databaseUrl()
const violations = []
// Errors only, to stderr: its info lines would go to stdout, where xtask reads the JSON.
const logger = new Logger(() => (level, message) => {
  if (level === 'error') console.error('graphile-worker:', message)
})

const pool = new pg.Pool({ connectionString, max: CONCURRENCY + 4 })
pool.on('error', e => console.error('pg pool:', e.message))
await pool.query('DROP SCHEMA IF EXISTS graphile_worker CASCADE')
await runMigrations({ pgPool: pool, logger })
const utils = await makeWorkerUtils({ pgPool: pool, logger })
const count = async (sql, params) => Number((await pool.query(sql, params)).rows[0].n)
const left = task => count(
  'SELECT count(*) AS n FROM graphile_worker._private_jobs j JOIN graphile_worker._private_tasks t ON t.id = j.task_id WHERE t.identifier = $1',
  [task])
const RUN = Date.now().toString(36)

// (a) enqueue: send i uses key i mod JOBS/2, so the second half finds its key.
const ENQUEUE = `bench_enqueue_${RUN}`
const keys = Math.ceil(JOBS / 2)
let next = 0
const t0 = performance.now()
await Promise.all(Array.from({ length: CONCURRENCY }, async () => {
  for (let i = next++; i < JOBS; i = next++) {
    await utils.addJob(ENQUEUE, { i }, { jobKey: `k${i % keys}`, jobKeyMode: 'unsafe_dedupe' })
  }
}))
const enqueueS = (performance.now() - t0) / 1000
const distinct = await left(ENQUEUE)
if (distinct !== keys) violations.push(`enqueue created ${distinct} jobs, expected ${keys}`)
await pool.query('DELETE FROM graphile_worker._private_jobs')

// A backlog of JOBS jobs in batches of 1,000, then VACUUM ANALYZE (as ours).
async function backlog (task) {
  for (let i = 0; i < JOBS; i += 1000) {
    await utils.addJobs(Array.from({ length: Math.min(1000, JOBS - i) }, (_, k) => ({
      identifier: task, payload: { i: i + k }
    })))
  }
  await pool.query('VACUUM ANALYZE graphile_worker._private_jobs')
}

// (b) the backlog worked off by run() with a no-op task.
async function workerDrain (label, concurrency, worker) {
  const task = `bench_${label}_${RUN}`
  await backlog(task)
  const ledger = new Ledger()
  let runner
  const d = await timedDrain({
    jobs: JOBS,
    ledger,
    start: async () => {
      runner = await run({
        pgPool: worker.maxPoolSize ? undefined : pool,
        connectionString: worker.maxPoolSize ? connectionString : undefined,
        concurrency,
        noHandleSignals: true,
        logger,
        taskList: { [task]: async (_payload, helpers) => { ledger.handle(helpers.job.id) } },
        preset: { worker }
      })
    },
    completed: async () => JOBS - await left(task)
  })
  await runner.stop()
  violations.push(...drainViolations(label, JOBS, d))
  await pool.query('DELETE FROM graphile_worker._private_jobs')
  return d
}
const c16 = await workerDrain('worker_c16', CONCURRENCY, {})
const c16b = await workerDrain('worker_c16_batched', CONCURRENCY, {
  localQueue: { size: CONCURRENCY + 1 }, completeJobBatchDelay: 0, failJobBatchDelay: 0
})
// The fastest configuration in rounds, as ours (a drain lasts about a second):
// the median is reported.
const FAST_ROUNDS = 3
const fastRounds = []
for (let r = 0; r < FAST_ROUNDS; r++) {
  fastRounds.push(await workerDrain(`fast_${r}`, 24, {
    maxPoolSize: 25, localQueue: { size: 500 }, completeJobBatchDelay: 0, failJobBatchDelay: 0
  }))
}
const fast = [...fastRounds].sort((a, b) => a.perS - b.perS)[Math.floor(FAST_ROUNDS / 2)]

// (c) pickup latency to an idle runner, woken by NOTIFY.
const LATENCY = `bench_latency_${RUN}`
const started = new Map()
const runner = await run({
  pgPool: pool,
  concurrency: CONCURRENCY,
  noHandleSignals: true,
  logger,
  taskList: { [LATENCY]: async payload => { started.set(payload.i, performance.now()) } }
})
await sleep(1000)
const sent = []
for (let i = 0; i < LATENCY_SENDS; i++) {
  await utils.addJob(LATENCY, { i })
  sent.push([i, performance.now()])
  await sleep(LATENCY_GAP_MS)
}
const deadline = performance.now() + 10000
while (started.size < sent.length && performance.now() < deadline) await sleep(10)
await runner.stop()
const ms = sent.filter(([i]) => started.has(i))
  .map(([i, at]) => Math.max(0, started.get(i) - at))
  .sort((a, b) => a - b)
if (ms.length !== LATENCY_SENDS) violations.push(`latency: ${ms.length} of ${LATENCY_SENDS} jobs reached a handler`)
await utils.release()
await pool.end()

console.log(JSON.stringify({
  peer: 'graphile-worker',
  version,
  enqueue_mode: 'unsafe_dedupe',
  sends: JOBS,
  enqueue_per_s: round1(JOBS / enqueueS),
  distinct_jobs_created: distinct,
  worker_c16_per_s: c16.perS,
  worker_c16_config: `run() concurrency ${CONCURRENCY}, defaults`,
  worker_c16_batched_per_s: c16b.perS,
  worker_c16_batched_config: `run() concurrency ${CONCURRENCY}, localQueue.size ${CONCURRENCY + 1}, completeJobBatchDelay 0`,
  fast_per_s: fast.perS,
  fast_rounds: fastRounds.map(d => d.perS),
  fast_config: 'run() concurrentJobs 24, maxPoolSize 25, localQueue.size 500, completeJobBatchDelay 0, failJobBatchDelay 0',
  latency_samples: ms.length,
  latency_ms_p50: round3(quantile(ms, 0.5)),
  latency_ms_p99: round3(quantile(ms, 0.99)),
  violations
}))
if (violations.length > 0) {
  console.error('graphile-worker:', violations.join('; '))
  process.exitCode = 1
}
