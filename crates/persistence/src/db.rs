//! Connections, the pool, and the embedded migrations.

use std::time::Duration;

use diesel::Connection;
use diesel_async::async_connection_wrapper::AsyncConnectionWrapper;
use diesel_async::pooled_connection::{
    AsyncDieselConnectionManager, ManagerConfig, PoolableConnection, RecyclingMethod,
};
use diesel_async::{AsyncConnection, AsyncPgConnection};
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};
use futures_util::future::BoxFuture;
use idemstage_domain::RepoError;

/// The core's migrations (the workspace's `migrations/`), embedded at compile time:
/// what [`migrate`] applies and [`revert_all_migrations`] reverts.
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("../../migrations");

/// Changes whenever any migration file changes (computed by build.rs).
pub const MIGRATIONS_FINGERPRINT: &str = env!("IDEMSTAGE_MIGRATIONS_HASH");

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

/// Applies the pending embedded migrations ([`MIGRATIONS`]); returns how many ran.
/// Uses a connection of its own (not a pool) on a blocking thread. An unreachable
/// server is `Unavailable`, a failed migration `Database`.
pub async fn migrate(url: &str) -> Result<usize, RepoError> {
    migrate_with(url, Vec::new()).await
}

/// Applies the core's pending migrations, then each of `team`'s in order (a team's
/// migrations may use what the core's create, e.g. `idemstage_tenant_table`);
/// returns how many ran in all. Versions are tracked in one table, so a team's
/// migration directories need names (versions) of their own. Pass the team's own
/// `embed_migrations!` constant by value: `migrate_with(url, vec![TEAM_MIGRATIONS])`.
/// Errors as [`migrate`].
pub async fn migrate_with(url: &str, team: Vec<EmbeddedMigrations>) -> Result<usize, RepoError> {
    with_sync_connection(url, move |conn| {
        refuse_pre_baseline(conn)?;
        let mut applied = 0;
        for source in std::iter::once(MIGRATIONS).chain(team) {
            applied += conn
                .run_pending_migrations(source)
                .map(|done| done.len())
                .map_err(|e| RepoError::Database(format!("migration failed: {e}").into()))?;
        }
        Ok(applied)
    })
    .await
}

/// The versions of the core's migrations before they were squashed into the
/// baseline (`2026-11-30-000000_baseline`, 0.x). A database that holds one was
/// migrated by an earlier 0.x and has the old names (`anfragen`,
/// `pipeline_runs`): the baseline cannot run on it, and diesel would say only
/// that a type already exists.
const PRE_BASELINE_VERSIONS: [&str; 25] = [
    "20261130000001",
    "20261130000010",
    "20261130000020",
    "20261130000030",
    "20261130000040",
    "20261130000050",
    "20261130000060",
    "20261201000070",
    "20261201000080",
    "20261201000090",
    "20261201000100",
    "20261201000110",
    "20261201000120",
    "20261201000130",
    "20261201000140",
    "20261201000150",
    "20261203000160",
    "20261203000170",
    "20261203000171",
    "20261203000172",
    "20261203000180",
    "20261203000200",
    "20261203000210",
    "20261203000220",
    "20261203000230",
];

/// Refuses, changing nothing, a database migrated before the baseline.
fn refuse_pre_baseline(
    conn: &mut AsyncConnectionWrapper<AsyncPgConnection>,
) -> Result<(), RepoError> {
    let applied = conn
        .applied_migrations()
        .map_err(|e| RepoError::Database(format!("migration failed: {e}").into()))?;
    if let Some(old) = applied
        .iter()
        .map(|v| v.to_string())
        .find(|v| PRE_BASELINE_VERSIONS.contains(&v.as_str()))
    {
        return Err(RepoError::Database(
            format!(
                "migration refused: this database holds idemstage's migration {old}, from before \
                 the 0.x baseline (2026-11-30-000000_baseline, which renamed anfragen to items \
                 and pipeline_runs to stage_runs); nothing was changed. Migrate a new database \
                 (or drop this one and migrate it anew)"
            )
            .into(),
        ));
    }
    Ok(())
}

/// Reverts every applied migration of the core (used by the round-trip test);
/// returns how many were reverted. If any applied migration is not the core's (a
/// team's), it reverts nothing and fails naming that version: revert those with
/// [`revert_all_with`].
pub async fn revert_all_migrations(url: &str) -> Result<usize, RepoError> {
    revert_all_with(url, Vec::new()).await
}

/// Reverts every applied migration, the core's and `team`'s, newest version first
/// (each `down.sql` in its own transaction); returns how many were reverted. An
/// applied version found in neither set is looked for first: then nothing is
/// reverted, and the error names the version.
pub async fn revert_all_with(url: &str, team: Vec<EmbeddedMigrations>) -> Result<usize, RepoError> {
    with_sync_connection(url, move |conn| {
        let sources = Sources(std::iter::once(MIGRATIONS).chain(team).collect());
        let failed = |e: Box<dyn std::error::Error + Send + Sync>| {
            RepoError::Database(format!("migration revert failed: {e}").into())
        };
        // Checked before anything is reverted: diesel would revert the newer
        // versions and stop at the unknown one, leaving the schema half down (a
        // team's migration older than a core upgrade's is the usual case).
        let known: std::collections::HashSet<String> =
            diesel::migration::MigrationSource::<diesel::pg::Pg>::migrations(&sources)
                .map_err(failed)?
                .iter()
                .map(|m| m.name().version().to_string())
                .collect();
        let applied = conn.applied_migrations().map_err(failed)?;
        if let Some(unknown) = applied.iter().find(|v| !known.contains(&v.to_string())) {
            return Err(RepoError::Database(
                format!(
                    "migration revert refused: applied version {unknown} is in none of the \
                 migration sets given (pass its team's to revert_all_with); nothing was reverted"
                )
                .into(),
            ));
        }
        conn.revert_all_migrations(sources)
            .map(|reverted| reverted.len())
            .map_err(failed)
    })
    .await
}

/// Several migration sets as one, so that diesel orders them by version together.
struct Sources(Vec<EmbeddedMigrations>);

impl diesel::migration::MigrationSource<diesel::pg::Pg> for Sources {
    fn migrations(
        &self,
    ) -> diesel::migration::Result<Vec<Box<dyn diesel::migration::Migration<diesel::pg::Pg>>>> {
        let mut all = Vec::new();
        for source in &self.0 {
            all.extend(diesel::migration::MigrationSource::<diesel::pg::Pg>::migrations(source)?);
        }
        Ok(all)
    }
}

/// diesel_migrations is synchronous: run it on a blocking thread through diesel-async's
/// wrapper, which works on every tokio runtime flavour (unlike block_in_place).
async fn with_sync_connection<T: Send + 'static>(
    url: &str,
    f: impl FnOnce(&mut AsyncConnectionWrapper<AsyncPgConnection>) -> Result<T, RepoError>
        + Send
        + 'static,
) -> Result<T, RepoError> {
    drop(connect(url).await?);
    let url = url.to_owned();
    tokio::task::spawn_blocking(move || {
        let mut conn = <AsyncConnectionWrapper<AsyncPgConnection> as Connection>::establish(&url)
            .map_err(|e| {
            RepoError::Unavailable(
                format!("cannot connect to PostgreSQL at {}: {e}", redact_url(&url)).into(),
            )
        })?;
        f(&mut conn)
    })
    .await
    .map_err(|e| RepoError::Database(format!("migration task failed: {e}").into()))?
}
