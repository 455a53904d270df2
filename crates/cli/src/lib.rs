//! The `idemstage` command line as a library function, so that a team's binary is
//! one call for *its* pipeline and migrations:
//!
//! ```no_run
//! # fn my_pipeline() -> idemstage::Pipeline { panic!("the team's pipeline") }
//! # const MIGRATIONS: idemstage::diesel_migrations::EmbeddedMigrations =
//! #     idemstage::diesel_migrations::embed_migrations!("../../migrations");
//! fn main() -> std::process::ExitCode {
//!     idemstage_cli::run_app(idemstage_cli::App::new(my_pipeline()).with_migrations(vec![MIGRATIONS]))
//! }
//! ```
//!
//! That binary has `migrate` (the core's migrations, then the team's), `enqueue`,
//! `worker`, `status`, the stage controls `pause`, `resume` and `limit`, and the
//! operator commands `inspect`, `retry`, `cancel` and `dead`, and the web `console`. This crate's own `idemstage` binary is [`run`]: the same
//! for the built-in example pipeline, plus `demo` and `bench`. Exit codes: 0
//! success, 1 failure (an invariant broken, an unexpected error), 2 bad input or
//! usage, 3 database unavailable.

mod cli;

use std::process::ExitCode;

use diesel_migrations::EmbeddedMigrations;
use idemstage::Pipeline;

/// What the command line runs: a team's pipeline and its migrations, or the
/// built-in example.
pub struct App {
    /// `None`: the built-in example pipeline (and its `demo` and `bench`).
    pipeline: Option<Pipeline>,
    migrations: Vec<EmbeddedMigrations>,
}

impl App {
    /// The commands for a team's `pipeline` (its stages' policies as they are).
    pub fn new(pipeline: Pipeline) -> Self {
        Self {
            pipeline: Some(pipeline),
            migrations: Vec::new(),
        }
    }

    /// The built-in example pipeline (intake → extract → feasibility → calculate)
    /// and its migrations.
    pub fn example() -> Self {
        Self {
            pipeline: None,
            migrations: vec![idemstage_example::MIGRATIONS],
        }
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
    about = "Run pipeline stages on PostgreSQL at most once per (tenant, anfrage, stage)"
)]
struct Cli {
    /// PostgreSQL URL, e.g. postgres://user@host:5432/db
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// Whether the URL leads through a connection pooler in transaction mode
    /// (PgBouncer `pool_mode = transaction`): statements are then not cached and
    /// each runs in a transaction, and the worker takes LISTEN from --listen-url
    /// (or polls). migrate, demo and bench need a direct URL
    #[arg(long, env = "IDEMSTAGE_POOLER", global = true, value_enum, default_value_t = cli::PoolerArg::None)]
    pooler: cli::PoolerArg,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Apply the embedded migrations.
    Migrate,
    /// Register an anfrage (if new) and send its intake job.
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
    /// The timeline of one anfrage: every stage's runs and attempts, its jobs.
    Inspect(cli::ops::InspectArgs),
    /// Give a dead stage (or every dead stage of an anfrage) a fresh attempt
    /// budget and a new job.
    Retry(cli::ops::RetryArgs),
    /// Cancel an anfrage: its live jobs, and its unfinished stages (`cancelled`,
    /// final; a running attempt is fenced).
    Cancel(cli::ops::CancelArgs),
    /// The dead-letter list: dead stages and failed jobs with their last errors.
    Dead(cli::ops::DeadArgs),
    /// The web console: overview, anfrage timelines, dead letters, retry, cancel,
    /// pause and resume in a browser (token: $IDEMSTAGE_CONSOLE_TOKEN or
    /// --token-file).
    Console(cli::console::Args),
    /// The main job: duplicate sends, many workers, injected crashes; then a report
    /// checked against the database.
    Demo(cli::demo::Args),
    /// Benchmarks: claim, queue or pipeline throughput (see BENCHMARKS.md). Empties
    /// every table: runs only on a database whose name contains "bench".
    Bench(cli::bench::Args),
}

/// The `idemstage` binary: [`run_app`] with the built-in example pipeline.
pub fn run() -> ExitCode {
    run_app(App::example())
}

/// Parses the process's arguments and runs the command for `app` on a
/// multi-threaded tokio runtime of its own; returns the exit code (see the crate
/// docs). Installs a tracing subscriber (`RUST_LOG`, to stderr) unless one is set,
/// and a panic hook that logs a panic as one line, so call it once, from `main`,
/// outside any tokio runtime.
pub fn run_app(app: App) -> ExitCode {
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime.block_on(run_async(app)),
        Err(e) => {
            eprintln!("idemstage: cannot start the tokio runtime: {e}");
            ExitCode::from(1)
        }
    }
}

async fn run_async(mut app: App) -> ExitCode {
    let cli = Cli::parse();
    // The demo injects crashes on purpose: its warnings would drown the report.
    let default_filter = match cli.command {
        Command::Demo(_) | Command::Bench(_) => "error",
        _ => "warn",
    };
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
    // A panicking stage body is a failed attempt, handled and recorded; log it as one
    // line instead of the default hook's dump.
    std::panic::set_hook(Box::new(|info| {
        tracing::warn!(panic = %info, "stage body panicked");
    }));
    let result = async {
        let db = cli::Db {
            url: cli::database_url(cli.database_url.as_deref())?,
            pooler: cli.pooler.into(),
        };
        let url = &db.url;
        match cli.command {
            Command::Migrate => {
                db.direct_only("migrate")?;
                cli::migrate(url, std::mem::take(&mut app.migrations)).await
            }
            Command::Enqueue(args) => cli::enqueue::run(&db, args, app.pipeline).await,
            Command::Worker(args) => cli::worker::run(&db, args, app.pipeline).await,
            Command::Status(args) => cli::status::run(&db, args).await,
            Command::Pause(args) => cli::controls::pause(&db, args, true, app.pipeline).await,
            Command::Resume(args) => cli::controls::pause(&db, args, false, app.pipeline).await,
            Command::Limit(args) => cli::controls::limit(&db, args, app.pipeline).await,
            Command::Inspect(args) => cli::ops::inspect(&db, args, app.pipeline).await,
            Command::Retry(args) => cli::ops::retry(&db, args, app.pipeline).await,
            Command::Cancel(args) => cli::ops::cancel(&db, args).await,
            Command::Dead(args) => cli::ops::dead(&db, args, app.pipeline).await,
            Command::Console(args) => cli::console::run(&db, args, app.pipeline).await,
            Command::Demo(_) | Command::Bench(_) if app.pipeline.is_some() => Err(cli::BadInput(
                "demo and bench run the built-in example pipeline only".into(),
            )
            .into()),
            Command::Demo(args) => {
                db.direct_only("demo")?;
                cli::demo::run(url, args).await
            }
            Command::Bench(args) => {
                db.direct_only("bench")?;
                cli::bench::run(url, args).await
            }
        }
    }
    .await;
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idemstage: {e:#}");
            cli::exit_code_for(&e)
        }
    }
}
