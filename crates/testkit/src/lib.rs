//! Test support, after sqlx's `#[sqlx::test]`: every test gets its own database,
//! cloned from a template that is migrated once per migration fingerprint.
//!
//! `DATABASE_URL` names any database on the server to use (`cargo xtask test` sets
//! it). A test's database is dropped when its `TestDb` drops, unless the test is
//! panicking (or `IDEMSTAGE_KEEP_TEST_DB=1`): then it is kept and its URL printed
//! for post-mortem.

//!
//! [`run_stage`] runs one stage of a team's pipeline for a job against the test
//! database, in process, and returns its outcome; [`check_pipeline`] reads the
//! core's invariants for any pipeline afterwards. (Our own fault harnesses,
//! PgBouncer and private or replicated clusters, are in `idemstage-harness`,
//! which a team does not link.)

pub mod check;
pub mod schema;
mod stage;

pub use check::{check_pipeline, Invariants};
pub use stage::{item_job, run_stage};

use std::time::Duration;

use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idemstage_persistence::{connect, connect_pool, PgPool, PoolConfig, MIGRATIONS_FINGERPRINT};
use tokio::sync::OnceCell;

/// Server-wide advisory lock key for template creation ("idemstag" in ASCII).
const TEMPLATE_LOCK_KEY: i64 = 0x6964_656d_7374_6167;

/// The templates this process made or found, by name: each is created (or found)
/// once per process, the first time a test asks for it.
static TEMPLATES: std::sync::Mutex<Vec<(String, std::sync::Arc<OnceCell<()>>)>> =
    std::sync::Mutex::new(Vec::new());

pub struct TestDb {
    name: String,
    url: String,
    admin_url: String,
}

/// The server URL tests run against. Panics with instructions when unset.
pub fn server_url() -> String {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => panic!(
            "DATABASE_URL is not set. Run the tests with `cargo xtask test` (it starts a \
             disposable PostgreSQL), or set DATABASE_URL to a server where this user may \
             CREATE DATABASE."
        ),
    }
}

/// Replaces the database name in a URL (`scheme://auth@host:port/db?params`).
pub fn url_with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.find('?') {
        Some(q) => (&url[..q], &url[q..]),
        None => (url, ""),
    };
    let after_scheme = base.find("://").map(|i| i + 3).unwrap_or(0);
    let host_end = base[after_scheme..]
        .find('/')
        .map(|i| after_scheme + i)
        .unwrap_or(base.len());
    format!("{}/{db}{query}", &base[..host_end])
}

/// The tests' worker login role: `LOGIN IN ROLE idemstage_worker`, its password
/// its name. Created once per server by the first [`TestDb`] (or
/// [`ensure_test_roles`]).
pub const TEST_WORKER: &str = "idemstage_test_worker";

/// The tests' operator login role: `LOGIN IN ROLE idemstage_operator`.
pub const TEST_OPERATOR: &str = "idemstage_test_operator";

/// `url` (any database URL of a server with the core's migrations) as
/// [`TEST_WORKER`].
pub fn worker_url(url: &str) -> String {
    url_with_user(url, TEST_WORKER)
}

/// Replaces the user (and password) in a URL by `role`, whose password is its name.
pub fn url_with_user(url: &str, role: &str) -> String {
    let after_scheme = url.find("://").map(|i| i + 3).unwrap_or(0);
    let host_start = url[after_scheme..]
        .find(['@', '/'])
        .filter(|&i| url.as_bytes()[after_scheme + i] == b'@')
        .map(|i| after_scheme + i + 1)
        .unwrap_or(after_scheme);
    format!(
        "{}{role}:{role}@{}",
        &url[..after_scheme],
        &url[host_start..]
    )
}

/// Creates the login roles [`TEST_WORKER`] and [`TEST_OPERATOR`] on the server of
/// `admin_url` if missing (roles are per server). The group roles come from the
/// core's migrations: call this after migrating one database of the server (a
/// [`TestDb`] does it itself; an `idemstage_harness::PrivateCluster` test after its `migrate`).
pub async fn ensure_test_roles(admin_url: &str) {
    let mut admin = connect(admin_url).await.expect("connect to DATABASE_URL");
    for (role, group) in [
        (TEST_WORKER, idemstage_persistence::roles::WORKER_ROLE),
        (TEST_OPERATOR, idemstage_persistence::roles::OPERATOR_ROLE),
    ] {
        admin
            .batch_execute(&format!(
                "DO $$ BEGIN
                     IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN
                         CREATE ROLE {role} LOGIN PASSWORD '{role}' IN ROLE {group};
                     END IF;
                 EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
                 END $$"
            ))
            .await
            .unwrap_or_else(|e| panic!("create the test role {role}: {e}"));
    }
}

impl TestDb {
    /// A fresh database for this test with the core's migrations.
    pub async fn new() -> TestDb {
        Self::from_template(
            format!("idemstage_tpl_{MIGRATIONS_FINGERPRINT}"),
            Vec::new(),
        )
        .await
    }

    /// A fresh database as [`TestDb::new`], with a team's migrations applied on top
    /// of the core's (see `idemstage_persistence::migrate_with`), in this test's
    /// database: always current, at the cost of running them for every test. See
    /// [`TestDb::with_template`] for the cached form.
    pub async fn with_migrations(team: Vec<diesel_migrations::EmbeddedMigrations>) -> TestDb {
        let db = TestDb::new().await;
        idemstage_persistence::migrate_with(db.url(), team)
            .await
            .unwrap_or_else(|e| panic!("team migrations on {}: {e}", db.name));
        db
    }

    /// A fresh database with the core's and a team's migrations, cloned from a
    /// template that is migrated once per server and `fingerprint`. The
    /// fingerprint must change whenever the team's migrations change (e.g. a
    /// hash of the migration files, computed by the team crate's `build.rs` as
    /// `idemstage_example::MIGRATIONS_FINGERPRINT` is); an unchanged fingerprint
    /// over edited migrations reuses the old template. `[0-9a-z_]`, at most 20
    /// characters.
    pub async fn with_template(
        team: Vec<diesel_migrations::EmbeddedMigrations>,
        fingerprint: &str,
    ) -> TestDb {
        assert!(
            !fingerprint.is_empty()
                && fingerprint.len() <= 20
                && fingerprint
                    .bytes()
                    .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase() || b == b'_'),
            "TestDb::with_template: fingerprint {fingerprint:?} is not 1 to 20 of [0-9a-z_]"
        );
        Self::from_template(
            format!("idemstage_tpl_{MIGRATIONS_FINGERPRINT}_{fingerprint}"),
            team,
        )
        .await
    }

    async fn from_template(
        template: String,
        team: Vec<diesel_migrations::EmbeddedMigrations>,
    ) -> TestDb {
        let admin_url = server_url();
        let cell = {
            let mut templates = TEMPLATES.lock().unwrap();
            match templates.iter().find(|(name, _)| *name == template) {
                Some((_, cell)) => cell.clone(),
                None => {
                    let cell = std::sync::Arc::new(OnceCell::new());
                    templates.push((template.clone(), cell.clone()));
                    cell
                }
            }
        };
        cell.get_or_init(|| ensure_template(admin_url.clone(), template.clone(), team))
            .await;
        let name = test_database_name();
        let mut admin = connect(&admin_url).await.expect("connect to DATABASE_URL");
        admin
            .batch_execute(&format!(
                "CREATE DATABASE \"{name}\" TEMPLATE \"{template}\""
            ))
            .await
            .unwrap_or_else(|e| panic!("create test database {name}: {e}"));
        let url = url_with_database(&admin_url, &name);
        TestDb {
            name,
            url,
            admin_url,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// This database as the login role [`TEST_WORKER`] (a member of
    /// `idemstage_worker`, created once per server): how a deployed worker
    /// connects (README, "Deploying").
    pub fn worker_url(&self) -> String {
        worker_url(&self.url)
    }

    /// This database as the login role [`TEST_OPERATOR`] (a member of
    /// `idemstage_operator`).
    pub fn operator_url(&self) -> String {
        url_with_user(&self.url, TEST_OPERATOR)
    }

    /// A new connection of its own (separate sessions for concurrency tests).
    pub async fn conn(&self) -> AsyncPgConnection {
        connect(&self.url).await.expect("connect to test database")
    }

    pub async fn pool(&self, max_size: u32) -> PgPool {
        connect_pool(
            &self.url,
            PoolConfig::default()
                .with_max_size(max_size)
                .with_connection_timeout(Duration::from_secs(30)),
        )
        .await
        .expect("pool for test database")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let keep = std::env::var("IDEMSTAGE_KEEP_TEST_DB").is_ok_and(|v| v == "1");
        if std::thread::panicking() || keep {
            eprintln!(
                "test database kept for post-mortem: {} (drop it with: DROP DATABASE \"{}\")",
                self.url, self.name
            );
            return;
        }
        // Drop runs inside the test's runtime; a fresh thread with its own runtime
        // can block on the DROP without stalling it.
        let (admin_url, name) = (self.admin_url.clone(), self.name.clone());
        let dropped = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(async move {
                    let mut admin = connect(&admin_url).await?;
                    admin
                        .batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                        .await
                        .map_err(idemstage_persistence::map_diesel_error)
                })
        })
        .join();
        if let Ok(Err(e)) = dropped {
            eprintln!("could not drop test database {}: {e}", self.name);
        }
    }
}

/// `t_<test name>_<ulid>`: the test's name (cargo test names its threads after the
/// test) makes a kept database easy to find; the ULID keeps it unique.
fn test_database_name() -> String {
    let thread = std::thread::current();
    let test: String = thread
        .name()
        .unwrap_or("test")
        .rsplit("::")
        .next()
        .unwrap_or("test")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(30)
        .collect();
    format!("t_{test}_{}", ulid::Ulid::new().to_string().to_lowercase())
}

/// Creates the database `template` (the core's migrations, then `team`'s) once per
/// server, under an advisory lock so that parallel test processes do not race.
/// Migrated under a temporary name and renamed, so a crash never leaves a
/// half-migrated template behind the real name.
async fn ensure_template(
    admin_url: String,
    template: String,
    team: Vec<diesel_migrations::EmbeddedMigrations>,
) {
    let mut admin = connect(&admin_url).await.expect("connect to DATABASE_URL");
    diesel::sql_query(format!("SELECT pg_advisory_lock({TEMPLATE_LOCK_KEY})"))
        .execute(&mut admin)
        .await
        .expect("template lock");
    let exists = database_exists(&mut admin, &template).await;
    if !exists {
        let building = format!("{template}_building");
        admin
            .batch_execute(&format!(
                "DROP DATABASE IF EXISTS \"{building}\" WITH (FORCE)"
            ))
            .await
            .expect("drop stale template build");
        admin
            .batch_execute(&format!("CREATE DATABASE \"{building}\""))
            .await
            .expect("create template database");
        idemstage_persistence::migrate_with(&url_with_database(&admin_url, &building), team)
            .await
            .expect("migrate template database");
        admin
            .batch_execute(&format!(
                "ALTER DATABASE \"{building}\" RENAME TO \"{template}\"; \
                 ALTER DATABASE \"{template}\" WITH ALLOW_CONNECTIONS false IS_TEMPLATE true"
            ))
            .await
            .expect("publish template database");
    }
    ensure_test_roles(&admin_url).await;
    diesel::sql_query(format!("SELECT pg_advisory_unlock({TEMPLATE_LOCK_KEY})"))
        .execute(&mut admin)
        .await
        .expect("template unlock");
}

async fn database_exists(conn: &mut AsyncPgConnection, name: &str) -> bool {
    #[derive(diesel::QueryableByName)]
    struct Count {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let row: Count = diesel::sql_query("SELECT count(*) AS n FROM pg_database WHERE datname = $1")
        .bind::<diesel::sql_types::Text, _>(name)
        .get_result(conn)
        .await
        .expect("query pg_database");
    row.n > 0
}

/// `SELECT count(*)` of any query, for invariant checks in plain SQL.
pub async fn count(conn: &mut AsyncPgConnection, sql: &str) -> i64 {
    #[derive(diesel::QueryableByName)]
    struct Count {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    diesel::sql_query(format!("SELECT count(*) AS n FROM ({sql}) q"))
        .get_result::<Count>(conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .n
}

#[cfg(test)]
mod tests {
    use super::{url_with_database, url_with_user};

    #[test]
    fn a_multi_host_url_keeps_every_host_and_its_parameters() {
        let url = "postgres://postgres@127.0.0.1:5001,127.0.0.1:5002/postgres?target_session_attrs=read-write";
        assert_eq!(
            url_with_user(url, "w"),
            "postgres://w:w@127.0.0.1:5001,127.0.0.1:5002/postgres?target_session_attrs=read-write"
        );
        assert_eq!(
            url_with_database(url, "app"),
            "postgres://postgres@127.0.0.1:5001,127.0.0.1:5002/app?target_session_attrs=read-write"
        );
    }

    #[test]
    fn a_url_without_user_or_with_a_password_gets_the_role() {
        assert_eq!(
            url_with_user("postgres://a,b/db", "w"),
            "postgres://w:w@a,b/db"
        );
        assert_eq!(
            url_with_user("postgres://u:secret@h:1/db", "w"),
            "postgres://w:w@h:1/db"
        );
    }
}
