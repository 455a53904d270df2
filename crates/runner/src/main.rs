//! The `idemstage` command line.

use anyhow::Context;
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
}

fn database_url(cli: &Cli) -> anyhow::Result<String> {
    cli.database_url
        .clone()
        .context("no database: set DATABASE_URL or pass --database-url")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Migrate => {
            let url = database_url(&cli)?;
            let applied = idemstage_persistence::migrate(&url).await?;
            println!("applied {applied} migration(s)");
        }
    }
    Ok(())
}
