//! LISTEN for job notifications on a dedicated connection (a pooled connection
//! would hand its LISTEN to whoever borrows it next).

use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use futures_util::StreamExt;
use idemstage_domain::RepoError;

use super::NOTIFY_CHANNEL;
use crate::error::map_diesel_error;

/// A LISTEN on [`NOTIFY_CHANNEL`], on a connection of its own. A notification is
/// a hint, not a delivery: it carries a queue name (of any queue), may come for a
/// job another worker fetched first or that is not due yet, and none comes when a
/// delayed job becomes due or while the listener is disconnected. Fetch on a timer
/// as well.
pub struct JobListener {
    conn: AsyncPgConnection,
}

impl JobListener {
    /// Opens a connection of its own and LISTENs on `idemstage_jobs`.
    pub async fn connect(url: &str) -> Result<JobListener, RepoError> {
        let mut conn = crate::db::connect(url).await?;
        conn.batch_execute(&format!("LISTEN {NOTIFY_CHANNEL}"))
            .await
            .map_err(map_diesel_error)?;
        Ok(JobListener { conn })
    }

    /// The queue name of the next notification. Cancel-safe (notifications are
    /// buffered by the connection). An error means the connection is gone:
    /// reconnect, and assume notifications were missed meanwhile.
    pub async fn next(&mut self) -> Result<String, RepoError> {
        let mut stream = std::pin::pin!(self.conn.notifications_stream());
        match stream.next().await {
            Some(Ok(n)) => Ok(n.payload),
            Some(Err(e)) => Err(RepoError::Unavailable(
                format!("listener connection lost: {}", map_diesel_error(e)).into(),
            )),
            None => Err(RepoError::Unavailable("listener connection closed".into())),
        }
    }
}
