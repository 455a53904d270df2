//! Guards that clean up after an execution whose future was dropped mid-way.

use std::sync::Arc;

use idemstage_domain::ClaimToken;
use idemstage_persistence::PgRunRepository;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

/// Releases the claim (`PgRunRepository::release`: lease ended now, the attempt
/// `abandoned` and given back to the budget) if dropped while armed. The release
/// is fenced on the token, so it changes nothing if the transaction had committed
/// or someone had taken the stage over.
pub(super) struct ReleaseOnDrop {
    pub(super) repo: Arc<PgRunRepository>,
    pub(super) token: Option<ClaimToken>,
    pub(super) tracker: TaskTracker,
    /// The execution's span, for the release's log lines (it is dropped outside it).
    pub(super) span: tracing::Span,
}

impl ReleaseOnDrop {
    pub(super) fn disarm(&mut self) {
        self.token = None;
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        let Some(token) = self.token.take() else {
            return;
        };
        // No runtime (it is shutting down): the lease runs out instead.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let repo = self.repo.clone();
        self.tracker.spawn_on(
            async move {
                match repo.release(&token, "released by a worker shutting down").await {
                    Ok(_) => tracing::info!(stage = %token.stage, item = %token.item, "abandoned stage released"),
                    Err(e) => tracing::warn!(error = %e, "releasing an abandoned stage failed; its lease will run out"),
                }
            }
            .instrument(self.span.clone()),
            &runtime,
        );
    }
}

/// Aborts the task when dropped (a tokio `JoinHandle` only detaches).
pub(super) struct AbortOnDrop(pub(super) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
