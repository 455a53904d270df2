//! Subcommands, and the mapping of their errors to exit codes.

pub mod bulk;
pub mod console;
pub mod controls;
pub mod enqueue;
mod known;
pub mod ops;
mod prometheus;
pub mod status;
pub mod worker;

use std::process::ExitCode;

use anyhow::Context;
use idemstage::db::Pooler;
use idemstage::{db::RepoError, ids::DomainError};

/// An error the user can fix by changing the input (exit code 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadInput(pub String);

/// Where a command connects: the URL, and whether it leads through a pooler in
/// transaction mode (`--pooler transaction`).
#[derive(Clone, Debug)]
pub struct Db {
    /// The database URL (`--database-url`, `DATABASE_URL`).
    pub url: String,
    /// How the URL reaches the server.
    pub pooler: Pooler,
}

impl Db {
    /// One connection.
    pub async fn connect(&self) -> Result<diesel_async::AsyncPgConnection, RepoError> {
        idemstage::db::connect_with(&self.url, self.pooler).await
    }

    /// A pool sized and timed as `config` says, reaching the server as this URL
    /// does (`config.pooler` is replaced by [`Db::pooler`]).
    pub async fn pool(
        &self,
        config: idemstage::db::PoolConfig,
    ) -> Result<idemstage::db::PgPool, RepoError> {
        let config = config.with_pooler(self.pooler);
        idemstage::db::connect_pool(&self.url, config).await
    }

    /// Refuses a transaction pooler for `command`, which needs a session of its own.
    pub fn direct_only(&self, command: &str) -> anyhow::Result<()> {
        match self.pooler {
            Pooler::None => Ok(()),
            Pooler::Transaction => Err(BadInput(format!(
                "{command} needs a direct connection (its statements run outside \
                 transactions): give it the server's URL, not the pooler's, and no --pooler"
            ))
            .into()),
        }
    }
}

/// `--pooler`: [`Pooler`] on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PoolerArg {
    /// Straight to PostgreSQL, or through a pooler in session mode
    None,
    /// Through a pooler in transaction mode (PgBouncer `pool_mode = transaction`):
    /// no statement cache, every statement in a transaction, no LISTEN on this URL
    Transaction,
}

impl From<PoolerArg> for Pooler {
    fn from(p: PoolerArg) -> Self {
        match p {
            PoolerArg::None => Pooler::None,
            PoolerArg::Transaction => Pooler::Transaction,
        }
    }
}

/// The database URL of `--database-url` or `DATABASE_URL` (bad input without one).
pub fn database_url(flag: Option<&str>) -> anyhow::Result<String> {
    flag.filter(|u| !u.is_empty())
        .map(str::to_owned)
        .ok_or_else(|| BadInput("no database: set DATABASE_URL or pass --database-url".into()))
        .context("idemstage needs a PostgreSQL server")
}

/// The exit code of an error: 2 bad input, 3 database unavailable, else 1.
pub fn exit_code_for(e: &anyhow::Error) -> ExitCode {
    for cause in e.chain() {
        if cause.is::<BadInput>() || cause.is::<DomainError>() || cause.is::<known::Unknown>() {
            return ExitCode::from(2);
        }
        if let Some(ops) = cause.downcast_ref::<idemstage::ops::OpsError>() {
            return match ops {
                idemstage::ops::OpsError::Repo(RepoError::Unavailable(_)) => ExitCode::from(3),
                e if e.is_bad_request() => ExitCode::from(2),
                _ => ExitCode::from(1),
            };
        }
        if let Some(repo) = cause.downcast_ref::<RepoError>() {
            return match repo {
                RepoError::Invalid(_)
                | RepoError::ItemNotFound { .. }
                | RepoError::TenantMismatch { .. }
                | RepoError::InputChanged { .. } => ExitCode::from(2),
                RepoError::Unavailable(_) => ExitCode::from(3),
                _ => ExitCode::from(1),
            };
        }
    }
    ExitCode::from(1)
}

pub async fn migrate(
    url: &str,
    team: Vec<diesel_migrations::EmbeddedMigrations>,
) -> anyhow::Result<ExitCode> {
    let applied = idemstage::db::migrate_with(url, team).await?;
    println!("applied {applied} migration(s)");
    Ok(ExitCode::SUCCESS)
}

/// `--wake`: [`idemstage::queue::Wake`] on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WakeArg {
    /// NOTIFY inside the stage's commit
    InCommit,
    /// NOTIFY after the commit, from one notifier per process
    AfterCommit,
}

impl From<WakeArg> for idemstage::queue::Wake {
    fn from(w: WakeArg) -> Self {
        match w {
            WakeArg::InCommit => idemstage::queue::Wake::InCommit,
            WakeArg::AfterCommit => idemstage::queue::Wake::AfterCommit,
        }
    }
}
