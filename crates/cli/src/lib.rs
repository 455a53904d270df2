//! The command line of a team's pipeline as a library function, so that a team's
//! binary is one call for *its* pipeline and migrations:
//!
//! ```no_run
//! # fn my_pipeline() -> idemstage::pipeline::Pipeline { panic!("the team's pipeline") }
//! # const MIGRATIONS: diesel_migrations::EmbeddedMigrations =
//! #     idemstage::diesel_migrations::embed_migrations!("../../migrations");
//! fn main() -> std::process::ExitCode {
//!     idemstage_cli::run_app(idemstage_cli::App::new(my_pipeline()).with_migrations(vec![MIGRATIONS]))
//! }
//! ```
//!
//! That binary has `migrate` (the core's migrations, then the team's), `enqueue`,
//! `worker`, `status`, the stage controls `pause`, `resume` and `limit`, the
//! operator commands `inspect`, `retry`, `cancel` and `dead`, and the web
//! `console`. A binary that adds commands or flags of its own extends
//! [`extend::command`] and runs the rest with [`extend::run_matches`]. Exit codes: 0
//! success, 1 failure (an invariant broken, an unexpected error), 2 bad input or
//! usage, 3 database unavailable.

mod cli;
pub mod extend;

use std::process::ExitCode;

use diesel_migrations::EmbeddedMigrations;
use idemstage::pipeline::Pipeline;

/// What the command line runs: a team's pipeline and its migrations.
pub struct App {
    pipeline: Pipeline,
    migrations: Vec<EmbeddedMigrations>,
    name: Option<(&'static str, &'static str)>,
}

impl App {
    /// The commands for a team's `pipeline` (its stages' policies as they are).
    pub fn new(pipeline: Pipeline) -> Self {
        Self {
            pipeline,
            migrations: Vec::new(),
            name: None,
        }
    }

    /// The binary's own name and version, for `--version` and the usage lines
    /// (default: `idemstage` and this crate's version). Usually
    /// `.with_name(env!("CARGO_PKG_NAME"), env!("CARGO_PKG_VERSION"))`.
    pub fn with_name(mut self, name: &'static str, version: &'static str) -> Self {
        self.name = Some((name, version));
        self
    }

    /// The team's migrations, applied by `migrate` after the core's, in order.
    pub fn with_migrations(mut self, migrations: Vec<EmbeddedMigrations>) -> Self {
        self.migrations = migrations;
        self
    }
}

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "idemstage",
    version,
    about = "Run pipeline stages on PostgreSQL at most once per (tenant, item, stage)"
)]
struct Cli {
    #[command(flatten)]
    global: extend::GlobalArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Apply the embedded migrations.
    Migrate,
    /// Register an item (if new) and send the job of the pipeline's first stage.
    Enqueue(cli::enqueue::Args),
    /// Work the stage queues until SIGINT/SIGTERM.
    Worker(cli::worker::Args),
    /// Stage x status counts and queue state counts.
    Status(cli::status::Args),
    /// Stop fetching a stage's jobs (or one tenant's): durable, seen by every
    /// worker at its next fetch; running jobs finish.
    Pause(cli::controls::PauseArgs),
    /// Undo `pause`; idle workers are woken at once.
    Resume(cli::controls::PauseArgs),
    /// Set or show a stage's concurrency cap, rate limit and tenant weights,
    /// enforced by the fetch across all workers.
    Limit(cli::controls::LimitArgs),
    /// The timeline of one item: every stage's runs and attempts, its jobs.
    Inspect(cli::ops::InspectArgs),
    /// Give a dead stage (or every dead stage of an item) a fresh attempt
    /// budget and a new job; without --item, of every item the filters select.
    Retry(cli::ops::RetryArgs),
    /// Run a finished stage again on its current input (every stage after it
    /// is invalidated and runs again after it); without --item, of every item
    /// the filters select, in batches, resumable.
    Rerun(cli::ops::RerunArgs),
    /// Cancel an item: its live jobs, and its unfinished stages (`cancelled`,
    /// final; a running attempt is fenced); without --item, every item the
    /// filters select.
    Cancel(cli::ops::CancelArgs),
    /// Deliver the signal a waiting stage waits for (once: a second delivery
    /// changes nothing); the stage runs again and reads it.
    Signal(cli::ops::SignalArgs),
    /// The dead-letter list: dead stages and failed jobs with their last errors.
    Dead(cli::ops::DeadArgs),
    /// The web console: overview, item timelines, dead letters, retry, cancel,
    /// pause and resume in a browser (token: $IDEMSTAGE_CONSOLE_TOKEN or
    /// --token-file).
    Console(cli::console::Args),
}

/// Parses the process's arguments and runs the command for `app` on a
/// multi-threaded tokio runtime of its own; returns the exit code (see the crate
/// docs). Installs a tracing subscriber (`RUST_LOG`, to stderr) unless one is set,
/// and a panic hook that logs a panic as one line, so call it once, from `main`,
/// outside any tokio runtime.
pub fn run_app(app: App) -> ExitCode {
    let mut command = extend::command();
    if let Some((name, version)) = app.name {
        command = command.name(name).bin_name(name).version(version);
    }
    let matches = command.get_matches();
    extend::block_on(async move {
        extend::init_logging("warn");
        extend::run_matches(app, &matches).await
    })
}

/// Runs the command of `matches` (parsed by [`extend::command`], possibly extended)
/// for `app`; returns its exit code. Logging is the caller's
/// ([`extend::init_logging`]).
pub(crate) async fn run_parsed(mut app: App, matches: &clap::ArgMatches) -> ExitCode {
    use clap::FromArgMatches;
    let cli = match Cli::from_arg_matches(matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let result = async {
        let db = cli.global.db()?;
        let url = &db.url;
        let pipeline = app.pipeline;
        match cli.command {
            Command::Migrate => {
                db.direct_only("migrate")?;
                cli::migrate(url, std::mem::take(&mut app.migrations)).await
            }
            Command::Enqueue(args) => cli::enqueue::run(&db, args, pipeline).await,
            Command::Worker(args) => cli::worker::run(&db, args, pipeline).await,
            Command::Status(args) => cli::status::run(&db, args).await,
            Command::Pause(args) => cli::controls::pause(&db, args, true, pipeline).await,
            Command::Resume(args) => cli::controls::pause(&db, args, false, pipeline).await,
            Command::Limit(args) => cli::controls::limit(&db, args, pipeline).await,
            Command::Inspect(args) => cli::ops::inspect(&db, args, pipeline).await,
            Command::Retry(args) => cli::ops::retry(&db, args, pipeline).await,
            Command::Rerun(args) => cli::ops::rerun(&db, args, pipeline).await,
            Command::Cancel(args) => cli::ops::cancel(&db, args, pipeline).await,
            Command::Signal(args) => cli::ops::signal(&db, args, pipeline).await,
            Command::Dead(args) => cli::ops::dead(&db, args, pipeline).await,
            Command::Console(args) => cli::console::run(&db, args, pipeline).await,
        }
    }
    .await;
    extend::exit_code(result)
}
