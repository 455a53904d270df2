//! The `idemstage` command line. Exit codes: 0 success, 1 failure (an invariant
//! broken, an unexpected error), 2 bad input or usage, 3 database unavailable.

mod cli;

use std::process::ExitCode;

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
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Apply the embedded migrations.
    Migrate,
    /// Register an anfrage (if new) and send its intake job.
    Enqueue(cli::enqueue::Args),
    /// Stage x status counts and queue state counts.
    Status(cli::status::Args),
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = async {
        let url = cli::database_url(cli.database_url.as_deref())?;
        match cli.command {
            Command::Migrate => cli::migrate(&url).await,
            Command::Enqueue(args) => cli::enqueue::run(&url, args).await,
            Command::Status(args) => cli::status::run(&url, args).await,
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
