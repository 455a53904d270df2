//! Queue maintenance, run periodically by every worker (one at a time per
//! database), and the sampling of the queue gauges.

use std::time::Duration;

use idemstage_persistence::queue::{self, MaintenanceConfig, MaintenanceOutcome};
use idemstage_persistence::PgPool;
use tokio_util::sync::CancellationToken;

/// Runs maintenance every `interval` (the first right away, to recover leases left
/// by crashed workers). Only one worker per database runs it at a time.
pub(super) async fn maintenance_loop(
    pool: PgPool,
    config: MaintenanceConfig,
    interval: Duration,
    stop: CancellationToken,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let ran = async {
            let mut conn = idemstage_persistence::get(&pool).await?;
            queue::maintain(&mut conn, &config).await
        }
        .await;
        match ran {
            Ok(MaintenanceOutcome::Ran(r)) => {
                if r.expired_retried + r.expired_failed + r.deleted > 0 {
                    tracing::info!(?r, "queue maintenance");
                }
            }
            Ok(MaintenanceOutcome::Skipped) => {}
            Err(e) => tracing::warn!(error = %e, "queue maintenance failed"),
        }
    }
}

/// Runs [`queue::advance_floors`] every `interval`, keeping each run's mark for
/// the next, until `stop`. A failed run keeps the mark it had: an older mark only
/// keeps floors lower.
pub(super) async fn floors_loop(pool: PgPool, interval: Duration, stop: CancellationToken) {
    let mut ticker = floors_ticker(interval);
    let mut mark = None;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let ran = async {
            let mut conn = idemstage_persistence::get(&pool).await?;
            queue::advance_floors(&mut conn, mark, interval).await
        }
        .await;
        match ran {
            Ok(next) => mark = next.or(mark),
            Err(e) => tracing::warn!(error = %e, "advancing the ready floors failed"),
        }
    }
}

/// The floors' ticker: its first tick one `interval` after the start, not at
/// once. A run at a worker's start competed with the first fetches (its own
/// connection, the function's first call; which of them costs most was not
/// measured apart): the `QueueWorker` drain of `idemstage bench queue` was
/// 15-20 % slower with it (BENCHMARKS.md). Nothing needs a run at the start:
/// a floor rises only in a run, and a job sent meanwhile is above it; a ready
/// job below a floor waits for another worker's run or this one's first.
fn floors_ticker(interval: Duration) -> tokio::time::Interval {
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker
}

/// Samples the depth of `queues` every `interval` into the queue gauges, until
/// `stop`. A failed sample leaves the gauges as they were.
pub(super) async fn queue_gauges_loop(
    pool: PgPool,
    queues: Vec<String>,
    interval: Duration,
    stop: CancellationToken,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let sampled = async {
            let mut conn = idemstage_persistence::get(&pool).await?;
            queue::queue_depths(&mut conn, &queues).await
        }
        .await;
        match sampled {
            Ok(depths) => crate::telemetry::set_queue_gauges(&depths),
            Err(e) => tracing::debug!(error = %e, "sampling the queue gauges failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn the_first_floors_run_is_one_interval_after_the_start() {
        let start = tokio::time::Instant::now();
        let mut ticker = super::floors_ticker(Duration::from_secs(1));
        ticker.tick().await;
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        ticker.tick().await;
        assert_eq!(start.elapsed(), Duration::from_secs(2));
    }
}
