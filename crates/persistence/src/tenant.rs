//! The tenant scope of a transaction, for row-level security (migration
//! `2026-11-30-000000_baseline`): `SET LOCAL ROLE idemstage_app` (NOBYPASSRLS, owns
//! nothing) and `app.tenant_id`, both transaction-local, sent with the BEGIN
//! ([`transaction`]) or, in a transaction already open, as one statement
//! ([`scope`]). Every
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

/// Ends the scope [`scope`] set in the open transaction: the connecting user's
/// role again, no tenant. For a transaction that does a tenant's writes and
/// then writes as the operator it is (a bulk action's progress, in the same
/// commit as the batch it records).
pub(crate) async fn unscope(conn: &mut AsyncPgConnection) -> Result<(), diesel::result::Error> {
    diesel::sql_query(
        "SELECT set_config('role', 'none', true), set_config('app.tenant_id', '', true)",
    )
    .execute(conn)
    .await
    .map(|_| ())
}

/// Runs `body` in a transaction of its own on `conn` (a savepoint, if `conn` is
/// in a transaction already), scoped to `tenant`: BEGIN and the scope go to the
/// server as one message, so the scope costs no round trip of its own (inside a
/// transaction, [`scope`] sets it). Every statement of `body` sees and writes only `tenant`'s rows of
/// every table under tenant isolation (ours, and a team's set up with
/// `idemstage_tenant_table`), whatever user `conn` connected as. Commits when
/// `body` returns `Ok`, rolls back on `Err`. For a team's own reads and writes
/// outside a stage (an API reading its tenant's results) and for tests that
/// look at one tenant's view.
///
/// ```no_run
/// # use idemstage::{diesel, diesel_async};
/// # async fn t(conn: &mut diesel_async::AsyncPgConnection)
/// #     -> Result<(), diesel::result::Error> {
/// use idemstage::diesel_async::RunQueryDsl;
/// use idemstage::{fenced::tenant_transaction, ids::TenantId};
/// let tenant = TenantId::parse("acme").unwrap();
/// let visible: i64 = tenant_transaction(conn, &tenant, async |conn| {
///     diesel::sql_query("SELECT count(*) AS n FROM items")
///         .get_result::<Count>(conn)
///         .await
///         .map(|c| c.n)
/// })
/// .await?;
/// # Ok(()) }
/// # #[derive(diesel::QueryableByName)]
/// # struct Count { #[diesel(sql_type = diesel::sql_types::BigInt)] n: i64 }
/// ```
pub async fn transaction<R, E, F>(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    body: F,
) -> Result<R, E>
where
    // AsyncFnOnce drives the closure's signature inference; TenantBody names its
    // future so that it can be required to be Send (diesel-async's own bound,
    // whose trait is private to it).
    for<'r> F: AsyncFnOnce(&'r mut AsyncPgConnection) -> Result<R, E> + TenantBody<'r, R, E> + Send,
    E: From<diesel::result::Error> + Send,
    R: Send,
{
    use diesel_async::{AnsiTransactionManager, AsyncConnection, TransactionManager};
    type Manager = AnsiTransactionManager;
    if <Manager as TransactionManager<AsyncPgConnection>>::transaction_manager_status_mut(conn)
        .transaction_depth()?
        .is_some()
    {
        // Nested: a savepoint, scoped by its own statement (SET LOCAL cannot be
        // sent with a SAVEPOINT in one message through the transaction manager).
        let tenant = tenant.clone();
        return conn
            .transaction(async move |conn| {
                scope(conn, &tenant).await?;
                body(conn).await
            })
            .await;
    }
    begin(conn, tenant).await?;
    match body(&mut *conn).await {
        Ok(value) => {
            <Manager as TransactionManager<AsyncPgConnection>>::commit_transaction(conn).await?;
            Ok(value)
        }
        // As diesel-async's own `transaction`: the body's error, unless the
        // rollback failed for another reason than a manager already broken.
        Err(error) => {
            match <Manager as TransactionManager<AsyncPgConnection>>::rollback_transaction(conn)
                .await
            {
                Ok(()) | Err(diesel::result::Error::BrokenTransactionManager) => Err(error),
                Err(rollback) => Err(rollback.into()),
            }
        }
    }
}

/// `BEGIN` and the scope in one message, so one round trip: the simple-query
/// protocol runs the four statements in order, and the three `SET LOCAL` are
/// utility statements, cheaper for the server to parse than a round trip with the
/// prepared [`SCOPE_SQL`] costs it. The tenant is a literal here; its characters
/// (`[a-z0-9_-]`, [`TenantId::parse`]) need no quoting beyond the quotes.
fn begin_sql(tenant: &TenantId) -> String {
    debug_assert!(!tenant.as_str().contains(['\'', '\\']));
    format!(
        "BEGIN; SET LOCAL ROLE {APP_ROLE}; SET LOCAL app.tenant_id = '{tenant}'; \
         SET LOCAL idle_in_transaction_session_timeout = {IDLE_IN_TRANSACTION_TIMEOUT_MS}",
        tenant = tenant.as_str()
    )
}

/// Opens the scoped transaction (see [`begin_sql`]) through diesel-async's
/// transaction manager, which then knows it is open (and the pool discards the
/// connection if this is dropped half-way).
async fn begin(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
) -> Result<(), diesel::result::Error> {
    use diesel_async::{AnsiTransactionManager, SimpleAsyncConnection, TransactionManager};
    let Err(error) = AnsiTransactionManager::begin_transaction_sql(conn, &begin_sql(tenant)).await
    else {
        return Ok(());
    };
    // The BEGIN may have run and a SET LOCAL failed after it: the server is then in
    // an aborted transaction the manager does not know of. Close it; if that
    // fails too, mark the manager broken so that the pool drops the connection.
    if conn.batch_execute("ROLLBACK").await.is_err() {
        <AnsiTransactionManager as TransactionManager<AsyncPgConnection>>::transaction_manager_status_mut(conn)
            .set_in_error();
    }
    Err(error)
}

/// The body of a [`transaction`]: an async closure over the scoped connection
/// whose future is `Send` (implemented for every such closure; not to be
/// implemented by hand).
pub trait TenantBody<'r, R, E>: FnOnce(&'r mut AsyncPgConnection) -> Self::Fut {
    /// The body's future.
    type Fut: std::future::Future<Output = Result<R, E>> + Send;
}

impl<'r, F, Fut, R, E> TenantBody<'r, R, E> for F
where
    F: FnOnce(&'r mut AsyncPgConnection) -> Fut,
    Fut: std::future::Future<Output = Result<R, E>> + Send,
{
    type Fut = Fut;
}
