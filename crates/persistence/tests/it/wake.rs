//! When a sent job wakes its listeners: in the sending commit, or after it through
//! the `Notifier` (so that busy committers do not queue on PostgreSQL's notify lock).

use std::time::Duration;

use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use futures_util::future::BoxFuture;
use futures_util::{FutureExt, StreamExt};
use idemstage_domain::{CompleteOutcome, JobToSend, SendOptions, SendResult, StageError};
use idemstage_persistence::queue::{self, Notifier, Wake};
use idemstage_persistence::{FencedTx, PgRunRepository};
use serde_json::json;

use crate::support::*;

fn job(queue: &str) -> JobToSend {
    JobToSend {
        tenant: None,
        queue: queue.into(),
        payload: json!({}),
        options: SendOptions::default(),
    }
}

async fn listening(db: &idemstage_testkit::TestDb) -> AsyncPgConnection {
    let mut listener = db.conn().await;
    listener
        .batch_execute("LISTEN idemstage_jobs")
        .await
        .unwrap();
    listener
}

/// The queue name of the next notification on `listener`. The timeout only turns
/// a hang into a failure; the tests assert on the payloads and their order.
async fn next_notification(listener: &mut AsyncPgConnection) -> String {
    let mut stream = std::pin::pin!(listener.notifications_stream());
    tokio::time::timeout(Duration::from_secs(30), stream.next())
        .await
        .expect("no notification")
        .expect("stream ended")
        .expect("notification error")
        .payload
}

#[tokio::test]
async fn an_after_commit_send_is_silent_until_the_notifier_names_its_queue() {
    let db = idemstage_testkit::TestDb::new().await;
    let mut listener = listening(&db).await;
    let mut conn = db.conn().await;

    let quiet = queue::send_in_waking(&mut conn, &job("quiet"), Wake::AfterCommit)
        .await
        .unwrap();
    assert!(matches!(quiet, SendResult::Sent(_)), "{quiet:?}");
    // Notifications arrive in commit order: had the quiet send notified, its
    // queue would come first.
    queue::send_in(&mut conn, &job("marker")).await.unwrap();
    assert_eq!(next_notification(&mut listener).await, "marker");

    let notifier = Notifier::new(db.pool(1).await);
    notifier.notify("quiet");
    assert_eq!(next_notification(&mut listener).await, "quiet");
}

#[tokio::test]
async fn the_notifier_coalesces_a_burst_into_one_notification_per_queue() {
    let db = idemstage_testkit::TestDb::new().await;
    let mut listener = listening(&db).await;
    let notifier = Notifier::new(db.pool(1).await);
    for _ in 0..50 {
        notifier.notify("a");
        notifier.notify("b");
    }
    // Then a marker through the same notifier: everything named before it went out
    // in this or earlier notifications, so counting up to the marker counts them all.
    notifier.notify("end");
    let mut seen = Vec::new();
    loop {
        let q = next_notification(&mut listener).await;
        if q == "end" {
            break;
        }
        seen.push(q);
    }
    assert!(
        seen.len() <= 4,
        "100 requests were not coalesced: {} notifications",
        seen.len()
    );
    for q in ["a", "b"] {
        assert!(
            seen.iter().any(|s| s == q),
            "{q} was never notified: {seen:?}"
        );
    }
}

fn send_next<'t>(tx: &'t mut FencedTx<'_>) -> BoxFuture<'t, Result<(), StageError>> {
    async move {
        // In the fenced transaction a job is the scope's tenant's (the baseline migration).
        let next = JobToSend {
            tenant: Some(tx.token().tenant.clone()),
            ..job("next_stage")
        };
        let sent = tx.send_job(&next).await?;
        assert!(matches!(sent, SendResult::Sent(_)), "{sent:?}");
        Ok(())
    }
    .boxed()
}

/// A fenced completion of a repository that wakes after the commit: its commit
/// sends no NOTIFY, the notifier then names the queue of the job it sent.
#[tokio::test]
async fn a_fenced_completion_with_after_commit_wakes_the_next_queue_once_committed() {
    let db = idemstage_harness::example::db().await;
    let repo = PgRunRepository::new(db.pool(4).await).with_wake(Wake::AfterCommit);
    assert_eq!(repo.wake(), Wake::AfterCommit);
    let mut conn = db.conn().await;
    let t = tenant("t1");
    let req = request(&t, new_item(&mut conn, &t).await, "intake");
    let token = token_of(&req, &repo.claim(&req).await.unwrap());
    let mut listener = listening(&db).await;

    let write = send_next;
    assert_eq!(
        repo.complete(&token, &write).await.unwrap(),
        CompleteOutcome::Committed
    );
    assert_eq!(next_notification(&mut listener).await, "next_stage");
    // Once: had the commit notified as well as the notifier, a second `next_stage`
    // would come before the marker (the first arrived before the marker was sent).
    queue::send_in(&mut conn, &job("marker")).await.unwrap();
    assert_eq!(next_notification(&mut listener).await, "marker");
    let fetched = queue::fetch(&mut conn, &["next_stage".to_owned()], 10)
        .await
        .unwrap();
    assert_eq!(fetched.len(), 1);
}
