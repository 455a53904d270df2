//! The claim path's cost, printed (no timed assertion): 2,000 sequential claims of
//! fresh keys on one pooled connection. Run with `--nocapture` to see the numbers
//! (RELIABILITY.md quotes them: the row-level-security scope adds round trips).

use std::time::Instant;

use idemstage_domain::ClaimOutcome;
use idemstage_testkit::TestDb;

use crate::support::*;

#[tokio::test]
async fn two_thousand_claims_of_fresh_keys_all_claim() {
    let db = TestDb::new().await;
    let repo = repo(&db, 1).await;
    let t = tenant("t1");
    let item = new_item(&mut db.conn().await, &t).await;
    let requests: Vec<_> = (0..2000)
        .map(|i| request(&t, item, &format!("s{i}")))
        .collect();
    // Warm the connection and its prepared statements.
    repo.claim(&request(&t, item, "warmup")).await.unwrap();
    let started = Instant::now();
    let mut claimed = 0;
    for req in &requests {
        if let ClaimOutcome::Claimed { .. } = repo.claim(req).await.unwrap() {
            claimed += 1;
        }
    }
    let elapsed = started.elapsed();
    eprintln!(
        "claim path: 2000 claims in {elapsed:?} ({:.1} µs/claim)",
        elapsed.as_secs_f64() * 1e6 / 2000.0
    );
    assert_eq!(claimed, 2000);
}
