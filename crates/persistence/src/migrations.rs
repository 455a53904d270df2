//! The core's migrations and a team's: applied, reverted, and refused on a
//! database migrated before the 0.x baseline. diesel_migrations is synchronous,
//! so each runs on a blocking thread with a connection of its own.

use diesel::Connection;
use diesel_async::async_connection_wrapper::AsyncConnectionWrapper;
use diesel_async::AsyncPgConnection;
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};
use idemstage_domain::RepoError;

use crate::db::{connect, redact_url};

/// The core's migrations (the workspace's `migrations/`), embedded at compile time:
/// what [`migrate`] applies and [`revert_all_migrations`] reverts.
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("../../migrations");

/// Changes whenever any migration file changes (computed by build.rs).
pub const MIGRATIONS_FINGERPRINT: &str = env!("IDEMSTAGE_MIGRATIONS_HASH");

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
