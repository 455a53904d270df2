//! What a handler is: the trait the worker calls per job, its results, and
//! `handler_fn` for closures.

use std::future::Future;
use std::marker::PhantomData;
use std::time::Duration;

use idemstage_domain::{FetchedJob, StageError};
use serde::de::DeserializeOwned;

/// What a handler reports when a job did not succeed. `Transient` and
/// `Permanent` mean what they mean for a stage ([`StageError::is_retryable`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandlerError {
    /// A passing problem: retried while the job has retries left.
    #[error("{0}")]
    Transient(String),
    /// Retrying cannot help: the job fails now (and goes to its dead-letter queue).
    #[error("{0}")]
    Permanent(String),
    /// Not now: fetch the job again after `until` (database clock; `None` = at
    /// once), without counting a failure.
    #[error("deferred: {reason}")]
    Defer {
        /// When the job may be fetched again.
        until: Option<chrono::DateTime<chrono::Utc>>,
        /// Why, for logs (not recorded on the job).
        reason: String,
    },
    /// Not now: fetch the job again `after` this long (measured by the database),
    /// without counting a failure. For waiting out a database problem with backoff.
    #[error("deferred for {after:?}: {reason}")]
    DeferFor {
        /// How long the job waits before it may be fetched again.
        after: Duration,
        /// Why, for logs (not recorded on the job).
        reason: String,
    },
}

impl HandlerError {
    /// A [`HandlerError::Transient`] with `e`'s text.
    pub fn transient(e: impl std::fmt::Display) -> Self {
        HandlerError::Transient(e.to_string())
    }
    /// A [`HandlerError::Permanent`] with `e`'s text.
    pub fn permanent(e: impl std::fmt::Display) -> Self {
        HandlerError::Permanent(e.to_string())
    }
}

impl From<StageError> for HandlerError {
    fn from(e: StageError) -> Self {
        if e.is_retryable() {
            HandlerError::Transient(e.to_string())
        } else {
            HandlerError::Permanent(e.to_string())
        }
    }
}

/// What a handler reports when a job succeeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// The worker completes the job (fenced on its token).
    Complete,
    /// The handler already completed the job under its token, in the transaction
    /// of its own writes (`FencedTx::complete_job`); the worker records it only.
    AlreadyCompleted,
}

/// Handles the jobs of the worker's queues. The worker deserializes the payload
/// first; a payload that does not fit `Payload` fails the job (permanently, with
/// serde's reason) without calling the handler. Use `serde_json::Value` to take
/// any payload.
///
/// The handler's own clock does not matter: while it runs, the worker renews the
/// job's lease (with the leases of all the jobs it holds, each at least every third
/// of its `expire_in`); if the lease is taken over anyway, the handler is aborted
/// (its future dropped) and nothing is recorded. A panic fails the job
/// (retryable).
pub trait JobHandler: Send + Sync + 'static {
    /// The payload type the job's JSON is deserialized into.
    type Payload: DeserializeOwned + Send + 'static;
    /// Handles one job; the result decides what happens to it (see [`Handled`],
    /// [`HandlerError`]).
    fn handle(
        &self,
        job: FetchedJob,
        payload: Self::Payload,
    ) -> impl Future<Output = Result<Handled, HandlerError>> + Send;
}

/// A closure as a handler: `handler_fn(|job, payload: MyPayload| async move { .. })`;
/// `Ok(())` has the worker complete the job.
pub struct FnHandler<P, F> {
    f: F,
    _payload: PhantomData<fn(P)>,
}

/// Makes a [`JobHandler`] of the closure `f`, which gets the fetched job and its
/// payload deserialized as `P`. See [`QueueWorker`](super::QueueWorker) for an example.
pub fn handler_fn<P, F, Fut>(f: F) -> FnHandler<P, F>
where
    P: DeserializeOwned + Send + 'static,
    F: Fn(FetchedJob, P) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    FnHandler {
        f,
        _payload: PhantomData,
    }
}

impl<P, F, Fut> JobHandler for FnHandler<P, F>
where
    P: DeserializeOwned + Send + 'static,
    F: Fn(FetchedJob, P) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    type Payload = P;
    fn handle(
        &self,
        job: FetchedJob,
        payload: P,
    ) -> impl Future<Output = Result<Handled, HandlerError>> + Send {
        let handled = (self.f)(job, payload);
        async move { handled.await.map(|()| Handled::Complete) }
    }
}
