//! The tenant scope of a transaction, for row-level security (migration
//! `2026-11-30-000010_rls`): `SET LOCAL ROLE idemstage_app` (NOBYPASSRLS, owns
//! nothing) and `app.tenant_id`, both transaction-local, in one round trip. Every
//! tenant-scoped transaction of this crate starts with it, so a statement can only
//! see and write rows of the tenant it runs for, whatever the connecting user is.

use diesel::sql_types::Text;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::TenantId;

/// The role the policies apply to.
pub const APP_ROLE: &str = "idemstage_app";

/// `idle_in_transaction_session_timeout` of every scoped transaction. A worker that
/// stops (SIGSTOP, a VM pause, a network partition) inside a claim or a fenced
/// completion holds row locks that the next claimant of the same stage would wait
/// for forever; the server ends such a session after this long, its transaction
/// rolls back, and the lock is free. Stage bodies do their slow work in `prepare`,
/// outside the transaction, so a healthy transaction is never idle this long.
pub const IDLE_IN_TRANSACTION_TIMEOUT_MS: u32 = 10_000;

/// The scope statement: binds `$1` tenant (text), `$2` the idle-in-transaction
/// timeout in ms (text). Transaction-local (`set_config(.., true)`).
pub(crate) const SCOPE_SQL: &str = "\
SELECT set_config('role', 'idemstage_app', true), \
       set_config('app.tenant_id', $1, true), \
       set_config('idle_in_transaction_session_timeout', $2, true)";

/// Scopes the open transaction to `tenant`. Outside a transaction it would last for
/// one statement only: call it first inside `conn.transaction(..)`.
pub async fn scope(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
) -> Result<(), diesel::result::Error> {
    crate::cached::Cached(
        diesel::sql_query(SCOPE_SQL)
            .bind::<Text, _>(tenant.as_str())
            .bind::<Text, _>(IDLE_IN_TRANSACTION_TIMEOUT_MS.to_string()),
    )
    .execute(conn)
    .await
    .map(|_| ())
}
