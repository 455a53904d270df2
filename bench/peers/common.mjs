// What the Node.js peers of `cargo xtask bench` share: flags, rounding, quantiles,
// and the bookkeeping that makes a worker drain a measurement (every job handled
// once, every job completed in the database).
import { performance } from 'node:perf_hooks'

export const sleep = ms => new Promise(resolve => setTimeout(resolve, ms))
export const round1 = x => Math.round(x * 10) / 10
export const round3 = x => Math.round(x * 1000) / 1000
export const quantile = (sorted, q) =>
  sorted[Math.min(sorted.length, Math.max(1, Math.ceil(q * sorted.length))) - 1]

export function arg (name, dflt) {
  const i = process.argv.indexOf(`--${name}`)
  return i >= 0 ? Number(process.argv[i + 1]) : dflt
}

export function list (name, dflt) {
  const i = process.argv.indexOf(`--${name}`)
  return (i >= 0 ? process.argv[i + 1] : dflt).split(',').map(Number)
}

export function databaseUrl () {
  const url = process.env.DATABASE_URL
  if (!url) throw new Error('DATABASE_URL is not set')
  return url
}

// Counts handler calls per job id: `handle(id)` in the handler, `seen` distinct ids,
// `duplicates` calls for an id already handled.
export class Ledger {
  constructor () {
    this.ids = new Set()
    this.calls = 0
    this.duplicates = 0
  }

  handle (id) {
    this.calls++
    if (this.ids.has(id)) this.duplicates++
    else this.ids.add(id)
  }

  get seen () { return this.ids.size }
}

// A worker drain: `start()` starts the worker (the clock starts before it), then
// this waits until the handlers have seen `jobs` jobs and `completed()` (a count in
// the database) reaches `jobs`: the time to the last completion. Gives up after
// `timeoutMs`.
export async function timedDrain ({ jobs, ledger, start, completed, timeoutMs = 300000 }) {
  const t0 = performance.now()
  await start()
  const deadline = t0 + timeoutMs
  while (ledger.seen < jobs && performance.now() < deadline) await sleep(2)
  let done = await completed()
  while (done < jobs && performance.now() < deadline) {
    await sleep(2)
    done = await completed()
  }
  const seconds = (performance.now() - t0) / 1000
  return { perS: round1(done / seconds), completed: done, handled: ledger.calls, duplicates: ledger.duplicates }
}

// The violations of a drain: anything but `jobs` jobs handled once and completed.
export function drainViolations (label, jobs, d) {
  const v = []
  if (d.completed !== jobs) v.push(`${label}: ${d.completed} of ${jobs} jobs completed in the database`)
  if (d.handled !== jobs) v.push(`${label}: ${d.handled} handler calls for ${jobs} jobs`)
  if (d.duplicates > 0) v.push(`${label}: ${d.duplicates} jobs handled twice`)
  return v
}
