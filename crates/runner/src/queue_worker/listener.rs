//! The LISTEN connection that wakes the fetch loop.

use std::sync::Arc;
use std::time::Duration;

use idemstage_persistence::queue::JobListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Turns notifications for our queues into wake-ups; reconnects with backoff. After
/// every (re)connect it wakes the loop once, since notifications sent while it was
/// away are lost.
pub(super) async fn listen_loop(
    url: String,
    queues: Vec<String>,
    wake: Arc<Notify>,
    backoff_min: Duration,
    backoff_max: Duration,
    stop: CancellationToken,
) {
    let mut backoff = backoff_min;
    loop {
        let connected = tokio::select! {
            _ = stop.cancelled() => return,
            c = JobListener::connect(&url) => c,
        };
        match connected {
            Ok(mut listener) => {
                backoff = backoff_min;
                wake.notify_one();
                loop {
                    let next = tokio::select! {
                        _ = stop.cancelled() => return,
                        n = listener.next() => n,
                    };
                    match next {
                        Ok(q) if queues.contains(&q) => wake.notify_one(),
                        Ok(_) => {}
                        Err(e) => {
                            tracing::warn!(error = %e, "job listener lost; reconnecting");
                            break;
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?backoff, "job listener cannot connect");
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(backoff_max);
    }
}
