//! `idemstage enqueue`: register an anfrage and send its intake job, atomically.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use diesel_async::AsyncConnection;
use idemstage_domain::{AnfrageId, SendResult, TenantId};
use idemstage_example::{self as example, Chaos};
use idemstage_persistence::anfragen::{validate_input, MAX_INPUT_BYTES};
use idemstage_persistence::TxError;
use idemstage_stage::{start_in, Pipeline};

use super::BadInput;

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["text", "file"])))]
pub struct Args {
    /// Tenant slug, e.g. acme-gmbh
    #[arg(long)]
    tenant: String,
    /// Anfrage id: a ULID chosen by the caller
    #[arg(long)]
    anfrage: String,
    /// The anfrage's text
    #[arg(long)]
    text: Option<String>,
    /// Read the anfrage's text from this file (UTF-8)
    #[arg(long)]
    file: Option<PathBuf>,
}

fn read_input(args: &Args) -> anyhow::Result<String> {
    if let Some(text) = &args.text {
        return Ok(text.clone());
    }
    let path = args.file.as_ref().expect("clap requires --text or --file");
    let file = std::fs::File::open(path)
        .map_err(|e| BadInput(format!("cannot read {}: {e}", path.display())))?;
    // Read at most one byte past the limit: a huge file is refused without loading it.
    let mut bytes = Vec::new();
    file.take(MAX_INPUT_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| BadInput(format!("cannot read {}: {e}", path.display())))?;
    if bytes.len() > MAX_INPUT_BYTES {
        return Err(BadInput(format!(
            "{} is larger than the limit of {MAX_INPUT_BYTES} bytes",
            path.display()
        ))
        .into());
    }
    String::from_utf8(bytes)
        .map_err(|_| BadInput(format!("{} is not UTF-8 text", path.display())).into())
}

pub async fn run(db: &super::Db, args: Args, team: Option<Pipeline>) -> anyhow::Result<ExitCode> {
    // Everything is validated before the first connection: bad input writes nothing.
    let tenant = TenantId::parse(&args.tenant)?;
    let anfrage = AnfrageId::parse(&args.anfrage)?;
    let text = read_input(&args)?;
    validate_input(&text)?;
    let pipeline = team.unwrap_or_else(|| example::pipeline(Chaos::default()));
    let mut conn = db.connect().await?;
    let started = conn
        .transaction::<_, TxError, _>(async |conn| {
            // Another input than the stored one is refused under `Reject` (the
            // default) and replaces it under `Rerun`, with the send, atomically.
            Ok(start_in(conn, &pipeline, &tenant, &anfrage, &text).await?)
        })
        .await
        .map_err(|e| e.into_repo())
        .context("enqueue failed; nothing was written")?;
    match started.sent {
        SendResult::Sent(id) => println!("{id}"),
        SendResult::Duplicate => println!("duplicate"),
    }
    Ok(ExitCode::SUCCESS)
}
