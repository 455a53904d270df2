//! For a binary that extends [`run_app`](crate::run_app)'s command line with
//! commands or flags of its own: [`command`] is its clap command (add
//! subcommands, or flags to one with `mut_subcommand`), [`run_matches`] runs a
//! command of it, and the rest is what a command of its own needs to behave as
//! ours do (the database arguments, exit codes, logging).
//!
//! ```no_run
//! use std::process::ExitCode;
//!
//! # fn my_pipeline() -> idemstage::pipeline::Pipeline { panic!("the team's pipeline") }
//! fn main() -> ExitCode {
//!     let matches = idemstage_cli::extend::command()
//!         .subcommand(clap::Command::new("hello").about("Greets"))
//!         .get_matches();
//!     idemstage_cli::extend::block_on(async move {
//!         idemstage_cli::extend::init_logging("warn");
//!         match matches.subcommand_name() {
//!             Some("hello") => {
//!                 println!("hello");
//!                 ExitCode::SUCCESS
//!             }
//!             _ => {
//!                 let app = idemstage_cli::App::new(my_pipeline());
//!                 idemstage_cli::extend::run_matches(app, &matches).await
//!             }
//!         }
//!     })
//! }
//! ```

use std::future::Future;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};

pub use crate::cli::{exit_code_for, BadInput, Db, PoolerArg, WakeArg};

/// The command line of [`run_app`](crate::run_app): the global arguments
/// ([`GlobalArgs`]) and the generic commands.
pub fn command() -> clap::Command {
    crate::Cli::command()
}

/// Runs the command of `matches` (parsed by [`command`], possibly extended) for
/// `app` and returns its exit code; an error is printed on stderr. A subcommand
/// that [`command`] does not have is a usage error (exit 2): run a command of
/// your own before calling this. Logging is the caller's ([`init_logging`]).
pub async fn run_matches(app: crate::App, matches: &clap::ArgMatches) -> ExitCode {
    crate::run_parsed(app, matches).await
}

/// The arguments of every command: where the database is and how it is reached.
#[derive(clap::Args, Clone, Debug)]
pub struct GlobalArgs {
    /// PostgreSQL URL, e.g. postgres://user@host:5432/db
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub database_url: Option<String>,
    /// Whether the URL leads through a connection pooler in transaction mode
    /// (PgBouncer `pool_mode = transaction`): statements are then not cached and
    /// each runs in a transaction, and the worker takes LISTEN from --listen-url
    /// (or polls). migrate needs a direct URL
    #[arg(long, env = "IDEMSTAGE_POOLER", global = true, value_enum, default_value_t = PoolerArg::None)]
    pub pooler: PoolerArg,
}

impl GlobalArgs {
    /// The global arguments of `matches` (parsed by [`command`], possibly extended).
    pub fn from_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
        Self::from_arg_matches(matches)
    }

    /// Where a command connects (bad input, exit 2, without a URL).
    pub fn db(&self) -> anyhow::Result<Db> {
        Ok(Db {
            url: crate::cli::database_url(self.database_url.as_deref())?,
            pooler: self.pooler.into(),
        })
    }
}

/// The exit code of a command's result (0, or as [`exit_code_for`] says, the
/// error printed on stderr first).
pub fn exit_code(result: anyhow::Result<ExitCode>) -> ExitCode {
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idemstage: {e:#}");
            exit_code_for(&e)
        }
    }
}

/// Installs a tracing subscriber (`RUST_LOG`, else `default_filter`, to stderr)
/// unless one is set, and a panic hook that logs a panic as one line (a
/// panicking stage body is a failed attempt, handled and recorded).
pub fn init_logging(default_filter: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        // Colours for a person at a terminal; a file or a log collector gets text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init()
        .ok();
    std::panic::set_hook(Box::new(|info| {
        tracing::warn!(panic = %info, "stage body panicked");
    }));
}

/// Runs `main` on a multi-threaded tokio runtime of its own (exit 1 if none can
/// be started); call it once, from `main`, outside any tokio runtime.
pub fn block_on(main: impl Future<Output = ExitCode>) -> ExitCode {
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime.block_on(main),
        Err(e) => {
            eprintln!("idemstage: cannot start the tokio runtime: {e}");
            ExitCode::from(1)
        }
    }
}
