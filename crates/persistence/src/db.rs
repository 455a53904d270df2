//! Connections, the pool, and the embedded migrations.

use std::time::Duration;

use diesel_async::pooled_connection::{
    AsyncDieselConnectionManager, ManagerConfig, PoolableConnection, RecyclingMethod,
};
use diesel_async::{AsyncConnection, AsyncPgConnection};
use futures_util::future::BoxFuture;
use idemstage_domain::RepoError;

/// The bb8 connection manager of [`PgPool`] (diesel-async's, for
/// `AsyncPgConnection`).
pub type Manager = AsyncDieselConnectionManager<AsyncPgConnection>;
/// The connection pool the repository and the pool-taking functions use. Build it
/// with [`connect_pool`], which installs the checkout check without a round trip.
pub type PgPool = bb8::Pool<Manager>;
/// A connection borrowed from a [`PgPool`] (see [`get`]); it derefs to
/// `AsyncPgConnection` and goes back to the pool when dropped.
pub type PooledConn<'a> = bb8::PooledConnection<'a, Manager>;

/// A connection from the pool; a timeout or a refused connection is `Unavailable`
/// (retryable), with the driver's reason when there is one.
pub async fn get(pool: &PgPool) -> Result<PooledConn<'_>, RepoError> {
    pool.get().await.map_err(|e| match e {
        bb8::RunError::User(e) => RepoError::Unavailable(format!("cannot connect: {e}").into()),
        bb8::RunError::TimedOut => RepoError::Unavailable(
            "timed out waiting for a pooled connection (pool exhausted or server down)".into(),
        ),
    })
}

/// Size and wait of the pool [`connect_pool`] builds, and how its connections
/// reach the server; the default is 16 direct connections and a 10 s wait.
///
/// Built from the default with the `with_` methods, so that a setting added
/// later breaks no caller (the struct is `#[non_exhaustive]`):
///
/// ```
/// use std::time::Duration;
/// use idemstage::{db::PoolConfig, db::Pooler};
/// let config = PoolConfig::default()
///     .with_max_size(8)
///     .with_connection_timeout(Duration::from_secs(5))
///     .with_pooler(Pooler::Transaction);
/// assert_eq!(config.max_size, 8);
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct PoolConfig {
    /// The most connections the pool holds at once (bb8's `max_size`).
    pub max_size: u32,
    /// How long `get()` waits for a free connection before giving up.
    pub connection_timeout: Duration,
    /// Whether the URL leads through a pooler in transaction mode.
    pub pooler: Pooler,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            max_size: 16,
            connection_timeout: Duration::from_secs(10),
            pooler: Pooler::None,
        }
    }
}

impl PoolConfig {
    /// The same, holding at most `max_size` connections.
    pub fn with_max_size(mut self, max_size: u32) -> Self {
        self.max_size = max_size;
        self
    }

    /// The same, waiting at most `timeout` for a free connection.
    pub fn with_connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// The same, its connections reaching the server through `pooler`.
    pub fn with_pooler(mut self, pooler: Pooler) -> Self {
        self.pooler = pooler;
        self
    }
}

/// How a connection reaches PostgreSQL: straight, or through a pooler that hands
/// each transaction to whichever server session is free.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Pooler {
    /// Straight to the server, or through a pooler in session mode: a connection is
    /// one server session, so a statement is prepared once and kept.
    #[default]
    None,
    /// Through a pooler in transaction mode (PgBouncer's `pool_mode =
    /// transaction`; PgBouncer before 1.21 keeps no prepared statements): each
    /// transaction may run on another server session, so nothing may outlive one.
    /// The statement cache is off (each statement is prepared, run and closed in
    /// its transaction), the statements this crate runs outside a caller's
    /// transaction get one of their own ([`pinned`]), and LISTEN cannot work
    /// (take it from a direct URL, or poll). Session settings of this crate's are
    /// all `SET LOCAL`.
    Transaction,
}

/// The mark of a connection opened for [`Pooler::Transaction`], kept as its
/// (otherwise silent) instrumentation: the connection itself says how it must be
/// used, so no caller has to pass it along.
struct ThroughTransactionPooler;

impl diesel::connection::Instrumentation for ThroughTransactionPooler {
    fn on_connection_event(&mut self, _: diesel::connection::InstrumentationEvent<'_>) {}
}

/// Whether `conn` was opened for [`Pooler::Transaction`].
pub fn through_transaction_pooler(conn: &mut AsyncPgConnection) -> bool {
    conn.instrumentation().is::<ThroughTransactionPooler>()
}

/// Runs `body` on `conn` so that it survives a transaction pooler: as it is on a
/// direct connection or inside a transaction; in a transaction of its own on a
/// connection through a transaction pooler outside one, where each statement
/// would otherwise be prepared on one server session and executed on whichever
/// the pooler hands out next. Every function of this crate that takes a caller's
/// connection runs its statements this way; a team's own statements on a pooled
/// connection outside a transaction need it too.
///
/// ```no_run
/// use idemstage::diesel::{self, IntoSql};
/// use idemstage::diesel_async::RunQueryDsl;
/// use idemstage::{db::connect_pool, db::pinned, db::PoolConfig, db::Pooler, db::RepoError};
/// # async fn example() -> Result<(), RepoError> {
/// // Through PgBouncer in transaction mode.
/// let config = PoolConfig::default().with_pooler(Pooler::Transaction);
/// let pool = connect_pool("postgres://w:pw@pgbouncer:6432/app", config).await?;
/// let mut conn = idemstage::db::get(&pool).await?;
/// let one: i32 = pinned(&mut conn, async |conn| {
///     diesel::select(1.into_sql::<diesel::sql_types::Integer>()).get_result(conn).await
/// })
/// .await?; // a Diesel error is a RepoError
/// # let _ = one;
/// # Ok(()) }
/// ```
pub async fn pinned<R, E, F>(conn: &mut AsyncPgConnection, body: F) -> Result<R, E>
where
    for<'r> F: AsyncFnOnce(&'r mut AsyncPgConnection) -> Result<R, E>
        + crate::tenant::TenantBody<'r, R, E>
        + Send,
    E: From<diesel::result::Error> + Send,
    R: Send,
{
    if through_transaction_pooler(conn) && outside_transaction(conn) {
        conn.transaction(async move |conn| body(conn).await).await
    } else {
        body(conn).await
    }
}

/// Whether no transaction is open on `conn`; a broken transaction manager counts
/// as one open.
pub(crate) fn outside_transaction(conn: &mut AsyncPgConnection) -> bool {
    use diesel_async::TransactionManager;
    matches!(
        diesel_async::AnsiTransactionManager::transaction_manager_status_mut(conn)
            .transaction_depth(),
        Ok(None)
    )
}

/// The URL without its password, for error messages. Only a `user:password@`
/// before the host is masked: a password passed as a query parameter
/// (`?password=`) is left in.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let creds = &url[scheme_end + 3..at];
            match creds.find(':') {
                Some(colon) => format!(
                    "{}{}:***{}",
                    &url[..scheme_end + 3],
                    &creds[..colon],
                    &url[at..]
                ),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

/// One connection, with a readable error when the server cannot be reached.
pub async fn connect(url: &str) -> Result<AsyncPgConnection, RepoError> {
    connect_with(url, Pooler::None).await
}

/// One connection reaching the server as `pooler` says; errors as [`connect`].
pub async fn connect_with(url: &str, pooler: Pooler) -> Result<AsyncPgConnection, RepoError> {
    establish(url, pooler).await.map_err(|e| {
        RepoError::Unavailable(
            format!("cannot connect to PostgreSQL at {}: {e}", redact_url(url)).into(),
        )
    })
}

async fn establish(url: &str, pooler: Pooler) -> diesel::ConnectionResult<AsyncPgConnection> {
    match pooler {
        Pooler::None => AsyncPgConnection::establish(url).await,
        Pooler::Transaction => establish_through_transaction_pooler(url).await,
    }
}

/// A connection for [`Pooler::Transaction`]. diesel-async's setup runs two `SET`s
/// as prepared statements outside a transaction: opened inside one here (the
/// driver's own simple-protocol `BEGIN`, unseen by diesel's transaction manager),
/// each is prepared and run on one server session. The pooler keeps the settings
/// (time zone, client encoding) for the client and applies them to whichever
/// session it hands out.
async fn establish_through_transaction_pooler(
    url: &str,
) -> diesel::ConnectionResult<AsyncPgConnection> {
    use diesel::connection::CacheSize;
    use diesel::ConnectionError;
    use diesel_async::SimpleAsyncConnection;
    let bad = |e: tokio_postgres::Error| ConnectionError::BadConnection(e.to_string());
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .map_err(bad)?;
    // Ends when the client is dropped or the server goes away; the client then
    // reports itself closed, which is what the pool's checkout check looks at.
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client.batch_execute("BEGIN").await.map_err(bad)?;
    let mut conn = AsyncPgConnection::try_from(client).await?;
    conn.batch_execute("COMMIT")
        .await
        .map_err(ConnectionError::CouldntSetupConfiguration)?;
    conn.set_prepared_statement_cache_size(CacheSize::Disabled);
    conn.set_instrumentation(ThroughTransactionPooler);
    Ok(conn)
}

/// A pool. Connects once first, so that an unreachable server is reported with the
/// driver's own reason instead of a pool timeout (`Unavailable`).
///
/// A checkout costs no round trip: a connection the server closed is replaced once
/// its socket saw the end of the stream, but one that died a moment ago can still
/// be handed out, and its first statement then fails as `Unavailable`. Every
/// caller has to handle that anyway.
pub async fn connect_pool(url: &str, config: PoolConfig) -> Result<PgPool, RepoError> {
    drop(connect_with(url, config.pooler).await?);
    let mut manager_config = ManagerConfig::default();
    manager_config.recycling_method = RecyclingMethod::CustomFunction(Box::new(checkout_check));
    let pooler = config.pooler;
    manager_config.custom_setup = Box::new(move |url| Box::pin(establish(url, pooler)));
    let manager =
        AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(url, manager_config);
    Ok(bb8::Pool::builder()
        .max_size(config.max_size)
        .connection_timeout(config.connection_timeout)
        .build_unchecked(manager))
}

/// The check of a pooled connection before it is handed out: no round trip (the
/// default sends `SELECT 1` before every checkout, one round trip more than the
/// statement itself on every claim). A connection whose socket the server closed
/// (restart, `pg_terminate_backend`) is seen as closed once its background task
/// read the end of the stream, and is replaced here. One that died a moment ago can
/// still be handed out: its first statement then fails as `Unavailable`, which every
/// caller must handle anyway (a connection can die right after any check), and it
/// is dropped when it comes back to the pool.
fn checkout_check(conn: &mut AsyncPgConnection) -> BoxFuture<'_, diesel::QueryResult<()>> {
    let broken = conn.is_broken();
    Box::pin(async move {
        if broken {
            Err(diesel::result::Error::BrokenTransactionManager)
        } else {
            Ok(())
        }
    })
}
