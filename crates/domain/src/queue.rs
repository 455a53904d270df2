//! Queue types shared by the stage layer (which sends the next stage's job) and
//! persistence (which stores jobs).

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::{DomainError, JobId, TenantId};

mod labels;
pub use labels::stage_singleton_key;

/// Options of one send. Defaults: priority 0, start now, 2 retries, no delay,
/// 15 minutes job lease, no dead-letter queue, no throttle.
///
/// Built from the default with the `with_` methods (or by setting a field of a
/// default value), so that an option added later breaks no caller (the struct is
/// `#[non_exhaustive]`):
///
/// ```
/// use std::time::Duration;
/// use idemstage::queue::SendOptions;
/// let options = SendOptions::default()
///     .with_singleton_key("invoice-42")
///     .with_retry_limit(5)
///     .with_retry_delay(Duration::from_secs(1))
///     .with_retry_backoff(true);
/// assert_eq!(options.singleton_key.as_deref(), Some("invoice-42"));
/// assert!(options.validate().is_ok());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SendOptions {
    /// At most one live (queued, retrying or active) job per (queue, key).
    pub singleton_key: Option<String>,
    /// With a key: at most one job per (queue, key) per window of this many seconds,
    /// whatever its state.
    pub singleton_seconds: Option<u32>,
    /// Higher runs first.
    pub priority: i32,
    /// Not fetchable before this long after the send (database clock).
    pub start_after: Option<Duration>,
    /// Retryable failures allowed after the first delivery before the job fails
    /// for good.
    pub retry_limit: i32,
    /// Wait before a retry (the base of the backoff, with `retry_backoff`).
    pub retry_delay: Duration,
    /// Exponential backoff with jitter, capped by `retry_delay_max`.
    pub retry_backoff: bool,
    /// The longest wait before a retry; `None`: no cap.
    pub retry_delay_max: Option<Duration>,
    /// The job lease: an active job not completed within this is retried.
    pub expire_in: Duration,
    /// Queue that receives a copy of the job when it fails for good.
    pub dead_letter: Option<String>,
}

impl Default for SendOptions {
    fn default() -> Self {
        Self {
            singleton_key: None,
            singleton_seconds: None,
            priority: 0,
            start_after: None,
            retry_limit: 2,
            retry_delay: Duration::ZERO,
            retry_backoff: false,
            retry_delay_max: None,
            expire_in: Duration::from_secs(15 * 60),
            dead_letter: None,
        }
    }
}

impl SendOptions {
    /// The same, with at most one live job per (queue, `key`).
    pub fn with_singleton_key(mut self, key: impl Into<String>) -> Self {
        self.singleton_key = Some(key.into());
        self
    }

    /// The same, with a key's window of `seconds` (needs a singleton key).
    pub fn with_singleton_seconds(mut self, seconds: u32) -> Self {
        self.singleton_seconds = Some(seconds);
        self
    }

    /// The same, at `priority` (higher runs first).
    pub fn with_priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }

    /// The same, not fetchable before `delay` after the send (database clock).
    pub fn with_start_after(mut self, delay: Duration) -> Self {
        self.start_after = Some(delay);
        self
    }

    /// The same, allowing `limit` retryable failures after the first delivery.
    pub fn with_retry_limit(mut self, limit: i32) -> Self {
        self.retry_limit = limit;
        self
    }

    /// The same, waiting `delay` before a retry (the backoff's base).
    pub fn with_retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// The same, with (or without) exponential backoff between retries.
    pub fn with_retry_backoff(mut self, backoff: bool) -> Self {
        self.retry_backoff = backoff;
        self
    }

    /// The same, waiting at most `max` before a retry.
    pub fn with_retry_delay_max(mut self, max: Duration) -> Self {
        self.retry_delay_max = Some(max);
        self
    }

    /// The same, with a job lease of `lease`.
    pub fn with_expire_in(mut self, lease: Duration) -> Self {
        self.expire_in = lease;
        self
    }

    /// The same, copying the job to `queue` when it fails for good.
    pub fn with_dead_letter(mut self, queue: impl Into<String>) -> Self {
        self.dead_letter = Some(queue.into());
        self
    }

    /// Refuses (`DomainError::InvalidOption`) a negative `retry_limit`, a zero
    /// `expire_in`, `singleton_seconds` without a key or of 0, a bad dead-letter
    /// queue name, a key outside 1..=512 bytes. Sends call it.
    pub fn validate(&self) -> Result<(), DomainError> {
        use DomainError::InvalidOption;
        if self.retry_limit < 0 {
            return Err(InvalidOption("retry_limit must not be negative".into()));
        }
        if self.expire_in.is_zero() {
            return Err(InvalidOption("expire_in must be positive".into()));
        }
        if self.singleton_seconds.is_some() && self.singleton_key.is_none() {
            return Err(InvalidOption(
                "singleton_seconds needs a singleton_key".into(),
            ));
        }
        if self.singleton_seconds == Some(0) {
            return Err(InvalidOption("singleton_seconds must be positive".into()));
        }
        // A bad name would only surface when the job fails for good, as a refused
        // dead-letter insert; refuse it at send time instead.
        if let Some(dl) = &self.dead_letter {
            validate_queue_name(dl)?;
        }
        if let Some(key) = &self.singleton_key {
            if key.is_empty() || key.len() > 512 {
                return Err(InvalidOption(
                    "singleton_key must have 1..=512 bytes".into(),
                ));
            }
        }
        Ok(())
    }
}

/// A job to send: queue name, serialized payload, options.
#[derive(Clone, Debug, PartialEq)]
pub struct JobToSend {
    /// The queue: `[A-Za-z0-9_.:-]{1,100}`; a stage's queue is its name.
    pub queue: String,
    /// The tenant it works for: fetches share a queue fairly between tenants
    /// (`None`: no tenant; such jobs share as one). A stage's job carries its
    /// item's tenant.
    pub tenant: Option<TenantId>,
    /// The job's JSON payload, handed to the handler.
    pub payload: serde_json::Value,
    /// Retries, lease, singleton key.
    pub options: SendOptions,
}

/// Validates a queue name: `[A-Za-z0-9_.:-]{1,100}` (same as the SQL CHECK).
pub fn validate_queue_name(name: &str) -> Result<(), DomainError> {
    let ok = !name.is_empty()
        && name.len() <= 100
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(DomainError::InvalidOption(format!(
            "invalid queue name {name:?}: expected [A-Za-z0-9_.:-]{{1,100}}"
        )))
    }
}

/// The result of a send: a duplicate is an outcome, never an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum SendResult {
    /// A new job with this id.
    Sent(JobId),
    /// A live job with the same singleton key exists (or one was sent within
    /// `singleton_seconds`): nothing was sent.
    Duplicate,
}

/// `jobs.state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Sent, not fetched yet.
    Created,
    /// Back in the queue after a failure or deferral, fetchable from `start_after`.
    Retry,
    /// Fetched and leased by a worker.
    Active,
    /// Final: done.
    Completed,
    /// Final: cancelled by its holder.
    Cancelled,
    /// Final: failed for good (permanent, or out of retries).
    Failed,
}

impl JobState {
    /// Every state.
    pub const ALL: [JobState; 6] = [
        JobState::Created,
        JobState::Retry,
        JobState::Active,
        JobState::Completed,
        JobState::Cancelled,
        JobState::Failed,
    ];
    /// The state as stored in `jobs.state`.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Created => "created",
            JobState::Retry => "retry",
            JobState::Active => "active",
            JobState::Completed => "completed",
            JobState::Cancelled => "cancelled",
            JobState::Failed => "failed",
        }
    }
}

impl JobState {
    /// The state stored as `s`, if any.
    pub fn parse(s: &str) -> Option<JobState> {
        JobState::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

/// A job handed to a worker by a fetch. `attempt` is the fencing token of its lease:
/// complete/fail/cancel/retry must present it.
#[derive(Clone, Debug, PartialEq)]
pub struct FetchedJob {
    /// The job's id.
    pub id: JobId,
    /// The queue it was fetched from.
    pub queue: String,
    /// The tenant it works for, if it was sent with one.
    pub tenant: Option<TenantId>,
    /// The payload as sent.
    pub payload: serde_json::Value,
    /// Its priority (higher is fetched first).
    pub priority: i32,
    /// Its singleton key, if it was sent with one.
    pub singleton_key: Option<String>,
    /// Fencing token: incremented on every fetch.
    pub attempt: i32,
    /// Retries used so far (0 on the first delivery).
    pub retry_count: i32,
    /// Retries allowed (`SendOptions::retry_limit`).
    pub retry_limit: i32,
    /// The job lease: maintenance retries the job once this is past (database clock).
    pub expire_in: Duration,
    /// When this delivery's lease runs out unless renewed (database clock).
    pub lease_expires_at: DateTime<Utc>,
    /// When the job was sent (database clock).
    pub created_at: DateTime<Utc>,
    /// Error of the previous delivery, if it failed.
    pub last_error: Option<String>,
}

impl FetchedJob {
    /// The payload as the handler's type; the error names the queue and serde's reason.
    pub fn payload_as<T: DeserializeOwned>(&self) -> Result<T, PayloadError> {
        T::deserialize(&self.payload).map_err(|e| PayloadError {
            queue: self.queue.clone(),
            reason: e.to_string(),
        })
    }
}

/// A payload that does not deserialize into the handler's type. Permanent: the same
/// bytes will not parse on a retry.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid payload for queue {queue}: {reason}")]
pub struct PayloadError {
    /// The job's queue.
    pub queue: String,
    /// serde's reason.
    pub reason: String,
}

/// Result of complete (and of each entry of complete_many).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum JobCompleteOutcome {
    /// The job is `completed`.
    Completed,
    /// The job is no longer active under this attempt: its lease was taken over.
    Fenced,
}

/// How a failure counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum FailKind {
    /// A passing problem: retry while retries are left (as `StageError::Transient`).
    Transient,
    /// Retrying cannot help (e.g. a payload that does not deserialize): fail now.
    Permanent,
}

/// Result of fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum JobFailOutcome {
    /// Back in the queue; fetchable from `start_after` (database clock).
    Retrying {
        /// When it may be fetched again.
        start_after: DateTime<Utc>,
    },
    /// Final. `dead_lettered` is the id of the copy sent to the dead-letter queue.
    Failed {
        /// The dead-letter copy's id, if the job has a dead-letter queue.
        dead_lettered: Option<JobId>,
    },
    /// The job is no longer active under this attempt: nothing was recorded.
    Fenced,
}

/// Result of cancel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum JobCancelOutcome {
    /// The job is `cancelled`.
    Cancelled,
    /// The job is no longer active under this attempt: nothing was recorded.
    Fenced,
}

/// Result of retry-now (giving an active job back without counting a failure).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum JobRetryOutcome {
    /// The job is back in the queue (`retry`), its retry count unchanged.
    Requeued,
    /// The job is no longer active under this attempt: nothing was recorded.
    Fenced,
}

/// Job counts of one queue by state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StateCounts {
    /// Jobs in [`JobState::Created`].
    pub created: i64,
    /// Jobs in [`JobState::Retry`].
    pub retry: i64,
    /// Jobs in [`JobState::Active`].
    pub active: i64,
    /// Jobs in [`JobState::Completed`] (until retention deletes them).
    pub completed: i64,
    /// Jobs in [`JobState::Cancelled`] (until retention deletes them).
    pub cancelled: i64,
    /// Jobs in [`JobState::Failed`] (until retention deletes them).
    pub failed: i64,
}

impl StateCounts {
    /// The count of `state`.
    pub fn get(&self, state: JobState) -> i64 {
        match state {
            JobState::Created => self.created,
            JobState::Retry => self.retry,
            JobState::Active => self.active,
            JobState::Completed => self.completed,
            JobState::Cancelled => self.cancelled,
            JobState::Failed => self.failed,
        }
    }
    /// The count of `state`, to add to.
    pub fn get_mut(&mut self, state: JobState) -> &mut i64 {
        match state {
            JobState::Created => &mut self.created,
            JobState::Retry => &mut self.retry,
            JobState::Active => &mut self.active,
            JobState::Completed => &mut self.completed,
            JobState::Cancelled => &mut self.cancelled,
            JobState::Failed => &mut self.failed,
        }
    }
}

/// Job counts per queue and state (for `idemstage status`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct QueueStats {
    /// Counts per queue name, in name order.
    pub queues: BTreeMap<String, StateCounts>,
}

impl QueueStats {
    /// Jobs still to be worked: created, retrying or active, over all queues.
    pub fn live(&self) -> i64 {
        self.queues
            .values()
            .map(|c| c.created + c.retry + c.active)
            .sum()
    }
}
