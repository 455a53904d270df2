//! Pure types and rules of idemstage: identifiers, run states, claim outcomes,
//! per-stage policies, errors, and the repository traits the stage layer depends on.
//!
//! Invariant: this crate does no I/O. It names no table and opens no connection
//! (it depends on Diesel for its error type only, to classify it).

#![warn(missing_docs)]

mod diesel_error;
pub mod error;
pub mod fanout;
pub mod ids;
pub mod outcome;
pub mod policy;
pub mod queue;
pub mod repo;
pub mod wait;

pub use error::{
    map_diesel_error, sanitize_error_text, DomainError, RepoError, RepoMessage, StageError,
    MAX_ERROR_TEXT_BYTES,
};
pub use fanout::{
    child_item_id, Child, ChildFailure, Children, GatherPolicy, Gathered, GatheredChild,
};
pub use ids::{input_hash_of, BulkId, ItemId, JobId, RowId, RunId, StageName, TenantId, WorkerId};
pub use outcome::{
    ClaimOutcome, CompleteOutcome, FailOutcome, RejectReason, RenewOutcome, RunStatus, SkipReason,
};
pub use policy::{InputChangePolicy, StagePolicy};
pub use queue::{
    FailKind, FetchedJob, JobCancelOutcome, JobCompleteOutcome, JobFailOutcome, JobRetryOutcome,
    JobState, JobToSend, PayloadError, QueueStats, SendOptions, SendResult, StateCounts,
};
pub use repo::{AttemptRecord, ClaimRequest, ClaimToken, RunRecord};
pub use wait::{OnTimeout, Signal, WaitFor};
