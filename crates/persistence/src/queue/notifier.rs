//! Waking listening workers after a commit instead of inside it.
//!
//! PostgreSQL serializes the commits of transactions that NOTIFY: `PreCommit_Notify`
//! takes one lock for the whole database and holds it through the commit's WAL
//! flush. With many concurrent committers that lock, not the disk, sets the
//! throughput (measured in BENCHMARKS.md, "NOTIFY under load"). A [`Notifier`]
//! takes the NOTIFY out of the senders' transactions: after a commit, the sender
//! hands the queue names to one task per process, which coalesces them and
//! notifies in one short transaction of its own that does not wait for its WAL
//! flush (a lost notification costs latency, never a job).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use diesel::sql_types::{Array, Text};
use diesel_async::RunQueryDsl;
use tokio::sync::mpsc;

use crate::cached::CachedExt;
use crate::error::map_diesel_error;
use crate::PgPool;

/// When a job sent inside a fenced completion wakes the workers that listen on its
/// queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Wake {
    /// A NOTIFY inside the sending transaction: it fires exactly at commit, and the
    /// commit waits for the database-wide notify lock, held through every other
    /// notifying commit's WAL flush. Few committers: the lowest latency.
    InCommit,
    /// After the commit, through the process's [`Notifier`]: the committing
    /// transactions take no lock. A process that dies between the commit and the
    /// notification leaves the job to the workers' next poll.
    #[default]
    AfterCommit,
}

/// One NOTIFY per queue, in one statement (its own transaction) that does not wait
/// for its WAL flush: a notification is a hint, so losing it in a crash loses no
/// job. The local setting lasts until the statement's implicit commit, which reads
/// it. Binds `$1` the queue names (text[]).
pub(crate) const NOTIFY_QUEUES_SQL: &str = "\
SELECT set_config('synchronous_commit', 'off', true) AS sync,
       (SELECT count(pg_notify('idemstage_jobs', q)) FROM unnest($1::text[]) q) AS n";

/// Notifies the listeners of queues after their jobs committed, coalesced: while
/// one notification is in flight, the queues named meanwhile collect and go out
/// together in the next. Cheap to clone (a handle to one task); the task starts
/// with the first [`notify`](Notifier::notify) and ends when the last handle is
/// dropped.
#[derive(Clone)]
pub struct Notifier {
    shared: Arc<Shared>,
}

struct Shared {
    pool: PgPool,
    pending: Mutex<BTreeSet<String>>,
    /// The doorbell: one message wakes the task, which takes every pending queue.
    /// Capacity 1, so ringing a bell that is already ringing costs nothing.
    bell: mpsc::Sender<()>,
    task: Mutex<Option<mpsc::Receiver<()>>>,
}

impl std::fmt::Debug for Notifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notifier").finish_non_exhaustive()
    }
}

impl Notifier {
    /// A notifier that borrows a connection from `pool` for each notification.
    /// Nothing connects until the first [`notify`](Notifier::notify).
    pub fn new(pool: PgPool) -> Self {
        let (bell, rx) = mpsc::channel(1);
        Self {
            shared: Arc::new(Shared {
                pool,
                pending: Mutex::new(BTreeSet::new()),
                bell,
                task: Mutex::new(Some(rx)),
            }),
        }
    }

    /// Asks for a NOTIFY of `queue` soon; returns at once. Call it after the
    /// transaction that sent the job committed. Must be called within a Tokio
    /// runtime (the first call starts the notifying task on it).
    pub fn notify(&self, queue: &str) {
        if let Some(rx) = self.shared.task.lock().unwrap().take() {
            // The task holds the shared state only weakly, so that dropping the
            // last handle ends it.
            let shared = Arc::downgrade(&self.shared);
            tokio::spawn(run(shared, rx));
        }
        {
            let mut pending = self.shared.pending.lock().unwrap();
            if !pending.contains(queue) {
                pending.insert(queue.to_owned());
            }
        }
        // Full: a wake-up is already queued and will take this queue too.
        let _ = self.shared.bell.try_send(());
    }
}

async fn run(shared: std::sync::Weak<Shared>, mut rx: mpsc::Receiver<()>) {
    // The last handle's drop drops the sender: `recv` returns `None`.
    while rx.recv().await.is_some() {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let queues: Vec<String> = std::mem::take(&mut *shared.pending.lock().unwrap())
            .into_iter()
            .collect();
        if queues.is_empty() {
            continue;
        }
        if let Err(e) = notify_queues(&shared.pool, &queues).await {
            // The workers' poll finds the jobs; a retry here could only add load
            // to a database that is already failing.
            tracing::warn!(error = %e, ?queues, "after-commit notification failed; workers will poll");
        }
    }
}

async fn notify_queues(
    pool: &PgPool,
    queues: &[String],
) -> Result<(), idemstage_domain::RepoError> {
    let mut conn = crate::db::get(pool).await?;
    let query = diesel::sql_query(NOTIFY_QUEUES_SQL)
        .bind::<Array<Text>, _>(queues)
        .cached();
    crate::db::pinned(&mut conn, async move |conn| query.execute(conn).await)
        .await
        .map_err(map_diesel_error)?;
    Ok(())
}
