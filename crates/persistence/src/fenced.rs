//! The handle a stage body writes through: the connection of the fenced
//! transaction (already scoped to the run's tenant, already past the token check),
//! and the seed's write patterns as helpers that work on any table.
//!
//! Everything written through a `FencedTx` commits together with the stage's
//! `status = 'success'`, or not at all: if the body returns an error, panics, or
//! lost its lease, the transaction rolls back.

use diesel_async::methods::{ExecuteDsl, LoadQuery};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use futures_util::future::BoxFuture;
use idemstage_domain::{
    ClaimToken, DomainError, JobCompleteOutcome, JobId, JobToSend, RepoError, RowId, SendResult,
    StageError,
};
use serde::Serialize;

use crate::cached::CachedExt;
use crate::error::map_diesel_error;
use crate::queue::Wake;

mod any_connection;
pub use any_connection::{audit, insert_or_get};

/// How often insert-or-get retries when the row it conflicted with is gone again.
pub const INSERT_OR_GET_TRIES: u32 = 5;

/// The most bind parameters one statement may have: the protocol counts them in 16
/// bits, and the driver refuses a statement with more before sending it.
pub const MAX_BIND_PARAMETERS: usize = 65_535;

/// The stage's writes, run inside the fenced transaction. It is `Fn`, not `FnOnce`,
/// because a serialization failure or deadlock (or a connection lost before the
/// commit) re-runs the whole transaction.
pub type FencedWrite<'a> = dyn for<'t, 'c> Fn(&'t mut FencedTx<'c>) -> BoxFuture<'t, Result<(), StageError>>
    + Send
    + Sync
    + 'a;

/// The open fenced transaction of one stage attempt. Its connection is scoped to
/// the run's tenant (row-level security, role `idemstage_app`): a team writes its
/// own tables with its own Diesel schema through [`FencedTx::conn`], and uses the
/// helpers for the patterns that need care (replace children, insert-or-get with
/// an audit entry, audit, send a job).
pub struct FencedTx<'c> {
    conn: &'c mut AsyncPgConnection,
    token: ClaimToken,
    wake: Wake,
    /// Queues of jobs sent without a NOTIFY, to wake once the transaction committed.
    to_wake: Vec<String>,
}

/// What a replacement of child rows did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Replaced {
    /// Rows the delete removed (all of the parent's, or those past the new set).
    pub deleted: usize,
    /// Rows the insert (or upsert) wrote.
    pub written: usize,
}

/// The id insert-or-get found, and whether this call created its row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct InsertOrGet<Id> {
    /// The id of the row that exists now: the one inserted, or the one the insert
    /// conflicted with.
    pub id: Id,
    /// `true` if this call's insert created the row, `false` if it existed.
    pub inserted: bool,
}

impl<'c> FencedTx<'c> {
    pub(crate) fn new(conn: &'c mut AsyncPgConnection, token: ClaimToken, wake: Wake) -> Self {
        Self {
            conn,
            token,
            wake,
            to_wake: Vec::new(),
        }
    }

    /// The queues to wake after the commit (jobs sent with `Wake::AfterCommit`).
    pub(crate) fn into_to_wake(self) -> Vec<String> {
        self.to_wake
    }

    /// The claim this transaction commits for: run, tenant, item, stage, attempt.
    pub fn token(&self) -> &ClaimToken {
        &self.token
    }

    /// The tenant-scoped connection of the fenced transaction, for the team's own
    /// tables. Do not commit, roll back or change the role on it: the transaction is
    /// the executor's.
    pub fn conn(&mut self) -> &mut AsyncPgConnection {
        self.conn
    }

    /// DELETE-before-INSERT of a parent's child rows: `delete` (all children of the
    /// parent), then `insert` (the new set). Safe only here: the fence's row lock
    /// serializes every replacer of the same run, so two cannot both survive.
    /// `insert` is one statement, of at most [`MAX_BIND_PARAMETERS`]: for a set
    /// whose size the input decides, use [`FencedTx::replace_children_chunked`].
    pub async fn replace_children<'q, D, I>(
        &mut self,
        delete: D,
        insert: I,
    ) -> Result<Replaced, RepoError>
    where
        D: ExecuteDsl<AsyncPgConnection> + Send + 'q,
        I: ExecuteDsl<AsyncPgConnection> + Send + 'q,
    {
        let deleted = delete.execute(self.conn).await.map_err(map_diesel_error)?;
        let written = insert.execute(self.conn).await.map_err(map_diesel_error)?;
        Ok(Replaced { deleted, written })
    }

    /// The per-row variant for large child sets: `upsert` every row of the new set
    /// (`INSERT … ON CONFLICT (parent, position) DO UPDATE`), then `delete_rest`
    /// (the parent's rows whose position is not in the new set). Ends in the same
    /// state as [`FencedTx::replace_children`]. For a set whose size the input
    /// decides, use [`FencedTx::upsert_children_chunked`].
    pub async fn upsert_children<'q, U, D>(
        &mut self,
        upsert: U,
        delete_rest: D,
    ) -> Result<Replaced, RepoError>
    where
        U: ExecuteDsl<AsyncPgConnection> + Send + 'q,
        D: ExecuteDsl<AsyncPgConnection> + Send + 'q,
    {
        let written = upsert.execute(self.conn).await.map_err(map_diesel_error)?;
        let deleted = delete_rest
            .execute(self.conn)
            .await
            .map_err(map_diesel_error)?;
        Ok(Replaced { deleted, written })
    }

    /// [`FencedTx::replace_children`] for a child set of any size: `delete`, then
    /// `insert(chunk)` for consecutive chunks of `rows`, each chunk small enough
    /// that its statement stays under [`MAX_BIND_PARAMETERS`] when one row binds at
    /// most `binds_per_row` parameters (the columns one row's insert sets). One
    /// multi-row INSERT of every row breaks that limit from 65,535 / columns rows
    /// on (7,281 rows of 9 columns), and fails the same way on every attempt.
    ///
    /// No rows: only the delete runs. `binds_per_row` 0 or above the limit is
    /// refused (`Invalid`) before anything is written.
    pub async fn replace_children_chunked<'r, R, D, I>(
        &mut self,
        delete: D,
        rows: &'r [R],
        binds_per_row: usize,
        insert: impl Fn(&'r [R]) -> I + Send,
    ) -> Result<Replaced, RepoError>
    where
        R: Sync,
        D: ExecuteDsl<AsyncPgConnection> + Send,
        I: ExecuteDsl<AsyncPgConnection> + Send,
    {
        let chunk = rows_per_statement(binds_per_row)?;
        let deleted = delete.execute(self.conn).await.map_err(map_diesel_error)?;
        let written = self.write_chunks(rows, chunk, insert).await?;
        Ok(Replaced { deleted, written })
    }

    /// [`FencedTx::upsert_children`] for a child set of any size: `upsert(chunk)`
    /// for consecutive chunks of `rows` (sized as in
    /// [`FencedTx::replace_children_chunked`]), then `delete_rest`. Its filter on
    /// the positions kept should bind them as one array (Diesel's `eq_any` does).
    pub async fn upsert_children_chunked<'r, R, U, D>(
        &mut self,
        rows: &'r [R],
        binds_per_row: usize,
        upsert: impl Fn(&'r [R]) -> U + Send,
        delete_rest: D,
    ) -> Result<Replaced, RepoError>
    where
        R: Sync,
        U: ExecuteDsl<AsyncPgConnection> + Send,
        D: ExecuteDsl<AsyncPgConnection> + Send,
    {
        let chunk = rows_per_statement(binds_per_row)?;
        let written = self.write_chunks(rows, chunk, upsert).await?;
        let deleted = delete_rest
            .execute(self.conn)
            .await
            .map_err(map_diesel_error)?;
        Ok(Replaced { deleted, written })
    }

    /// Runs `write(chunk)` for consecutive chunks of `rows`; the rows written.
    async fn write_chunks<'r, R, W>(
        &mut self,
        rows: &'r [R],
        chunk: usize,
        write: impl Fn(&'r [R]) -> W + Send,
    ) -> Result<usize, RepoError>
    where
        R: Sync,
        W: ExecuteDsl<AsyncPgConnection> + Send,
    {
        let mut written = 0;
        for part in rows.chunks(chunk) {
            written += write(part)
                .execute(self.conn)
                .await
                .map_err(map_diesel_error)?;
        }
        Ok(written)
    }

    /// Insert-or-get: `insert()` is an `INSERT … ON CONFLICT DO NOTHING RETURNING
    /// id`; when it returns nothing, `select()` reads the id of the row it
    /// conflicted with. If that row was deleted in between, both run again, a
    /// bounded number of times, then `InsertOrGetExhausted` names `what`. There is
    /// no SELECT-then-INSERT: the insert comes first.
    pub async fn insert_or_get<'q, Id, I, S>(
        &mut self,
        what: &str,
        insert: impl Fn() -> I,
        select: impl Fn() -> S,
    ) -> Result<InsertOrGet<Id>, RepoError>
    where
        Id: Send + 'static,
        I: LoadQuery<'q, AsyncPgConnection, Id> + Send + 'q,
        S: LoadQuery<'q, AsyncPgConnection, Id> + Send + 'q,
    {
        insert_or_get(self.conn, what, insert, select).await
    }

    /// [`FencedTx::insert_or_get`], then an audit entry whose `entity_id` is the
    /// id that exists (its `Display`: the one returned, inserted or found), with
    /// `details` and the action `actions.0` if this call created the row, else
    /// `actions.1` (e.g. `("datei.created", "datei.reused")`).
    pub async fn insert_or_get_audited<'q, Id, I, S>(
        &mut self,
        what: &str,
        actions: (&str, &str),
        details: serde_json::Value,
        insert: impl Fn() -> I,
        select: impl Fn() -> S,
    ) -> Result<InsertOrGet<Id>, RepoError>
    where
        Id: std::fmt::Display + Send + 'static,
        I: LoadQuery<'q, AsyncPgConnection, Id> + Send + 'q,
        S: LoadQuery<'q, AsyncPgConnection, Id> + Send + 'q,
    {
        let found = self.insert_or_get(what, insert, select).await?;
        let (action_created, action_reused) = actions;
        let action = if found.inserted {
            action_created
        } else {
            action_reused
        };
        self.audit(&found.id.to_string(), action, details).await?;
        Ok(found)
    }

    /// Appends an audit entry of this attempt (`run_id`, `attempt` set).
    pub async fn audit(
        &mut self,
        entity_id: &str,
        action: &str,
        details: serde_json::Value,
    ) -> Result<RowId, RepoError> {
        audit(
            self.conn,
            &self.token.tenant,
            entity_id,
            action,
            Some(&self.token),
            details,
        )
        .await
    }

    /// Sends a job in this transaction: it exists (and wakes workers) only if the
    /// completion commits; the wake-up is the repository's [`Wake`].
    pub async fn send_job(&mut self, job: &JobToSend) -> Result<SendResult, RepoError> {
        let sent = crate::queue::send_in_waking(self.conn, job, self.wake).await?;
        if matches!(sent, SendResult::Sent(_)) {
            self.note_sent(&job.queue);
        }
        Ok(sent)
    }

    /// Sends many jobs in this transaction, in one round trip (as
    /// `queue::send_batch`): they exist (and wake workers) only if the
    /// completion commits. Results in input order.
    pub async fn send_jobs(&mut self, jobs: &[JobToSend]) -> Result<Vec<SendResult>, RepoError> {
        crate::queue::send_batch(self.conn, jobs).await
    }

    /// Completes the queue job this execution runs for, in this transaction, fenced
    /// on the job's token: the job is completed if and only if the stage's success
    /// commits. `Fenced` (the job was taken over) does not stop the commit.
    pub async fn complete_job(
        &mut self,
        job: JobId,
        attempt: i32,
    ) -> Result<JobCompleteOutcome, RepoError> {
        crate::queue::complete(self.conn, job, attempt, None).await
    }

    /// The end of an execution's transaction in one round trip: sends `next` (as
    /// [`send_job`](Self::send_job)) and completes the job `(id, attempt)` (as
    /// [`complete_job`](Self::complete_job)), the two statements pipelined, in
    /// this order. Either may be `None`. The executor calls it after the body;
    /// a body may too, for its own last send.
    pub async fn send_and_complete(
        &mut self,
        next: Option<&JobToSend>,
        job: Option<(JobId, i32)>,
    ) -> Result<(Option<SendResult>, Option<JobCompleteOutcome>), RepoError> {
        self.finish(None, next, job).await
    }

    /// The end of an execution of the typed contract: as
    /// [`send_and_complete`](Self::send_and_complete), with the stage's `output`
    /// recorded first (kept with this attempt, the run's `success_attempt` now),
    /// the three statements pipelined. `output`'s flag: the attempt wrote or
    /// reused a checkpoint, which the success deletes. The executor calls it.
    #[doc(hidden)]
    pub async fn finish(
        &mut self,
        output: Option<(&serde_json::Value, bool)>,
        next: Option<&JobToSend>,
        job: Option<(JobId, i32)>,
    ) -> Result<(Option<SendResult>, Option<JobCompleteOutcome>), RepoError> {
        let conn: &AsyncPgConnection = self.conn;
        let wake = self.wake;
        let token = &self.token;
        let record = async {
            let Some((output, clear_checkpoint)) = output else {
                return Ok(());
            };
            let statement = if clear_checkpoint {
                crate::runs::sql::RECORD_OUTPUT_CLEAR_CHECKPOINT
            } else {
                crate::runs::sql::RECORD_OUTPUT
            };
            let mut pipelined = conn;
            diesel::sql_query(statement)
                .bind::<diesel::sql_types::Text, _>(token.run_id.to_string())
                .bind::<diesel::sql_types::Integer, _>(token.attempt)
                .bind::<diesel::sql_types::Jsonb, _>(output)
                .cached()
                .execute(&mut pipelined)
                .await
                .map(|_| ())
                .map_err(map_diesel_error)
        };
        let send = async {
            match next {
                Some(next) => crate::queue::send_pipelined(conn, next, wake)
                    .await
                    .map(Some),
                None => Ok(None),
            }
        };
        let complete = async {
            match job {
                Some((id, attempt)) => crate::queue::complete_pipelined(conn, id, attempt)
                    .await
                    .map(Some),
                None => Ok(None),
            }
        };
        let ((), sent, completed) = futures_util::try_join!(record, send, complete)?;
        if let (Some(next), Some(SendResult::Sent(_))) = (next, &sent) {
            self.note_sent(&next.queue);
        }
        Ok((sent, completed))
    }

    /// A queue to wake after the commit (with [`Wake::AfterCommit`]).
    fn note_sent(&mut self, queue: &str) {
        if self.wake == Wake::AfterCommit && !self.to_wake.iter().any(|q| q == queue) {
            self.to_wake.push(queue.to_owned());
        }
    }

    /// Reads the input this run is bound to (same transaction, same tenant): the
    /// text whose hash the claim bound (`stage_runs.input_hash`; for a later
    /// stage, the hash its upstream's success read). That is the item's stored
    /// input while it is current, else the replaced input kept for it: a stage
    /// computed after the input was replaced still reads what its lineage names.
    pub async fn item_text(&mut self) -> Result<String, RepoError> {
        crate::runs::bound_input_text(self.conn, &self.token).await
    }

    /// How the run's last wait on this attempt's binding ended: the signal
    /// delivered with its payload, or its deadline (`None`: it has not waited
    /// on this binding). A stage that waits (`StageError::Wait`) reads here,
    /// when it runs again, what it waited for.
    pub async fn signal(&mut self) -> Result<Option<idemstage_domain::Signal>, RepoError> {
        crate::runs::signal_in(self.conn, &self.token).await
    }
}

/// The rows of one statement of a chunked write whose rows bind at most
/// `binds_per_row` parameters each: as many as stay under [`MAX_BIND_PARAMETERS`].
/// `Invalid` for 0 or more than the limit (no row would fit).
pub fn rows_per_statement(binds_per_row: usize) -> Result<usize, RepoError> {
    if binds_per_row == 0 || binds_per_row > MAX_BIND_PARAMETERS {
        return Err(RepoError::Invalid(DomainError::InvalidOption(format!(
            "binds_per_row must be 1 to {MAX_BIND_PARAMETERS}, not {binds_per_row}"
        ))));
    }
    Ok(MAX_BIND_PARAMETERS / binds_per_row)
}
