//! `idemstage enqueue`: register an item and send the job of its pipeline's first stage, atomically.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use diesel_async::AsyncConnection;
use idemstage::items::{validate_input, MAX_INPUT_BYTES};
use idemstage::runs::TxError;
use idemstage::{ids::ItemId, ids::TenantId, queue::SendResult};
use idemstage::{pipeline::first_job, pipeline::start_in, pipeline::Pipeline};

use super::BadInput;

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["text", "file"])))]
pub struct Args {
    /// Tenant slug, e.g. acme-gmbh
    #[arg(long)]
    tenant: String,
    /// Item id: a ULID chosen by the caller
    #[arg(long)]
    item: String,
    /// The item's text
    #[arg(long)]
    text: Option<String>,
    /// Read the item's text from this file (UTF-8)
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

pub async fn run(db: &super::Db, args: Args, pipeline: Pipeline) -> anyhow::Result<ExitCode> {
    // Everything is validated before the first connection: bad input writes nothing.
    let tenant = TenantId::parse(&args.tenant)?;
    let item = ItemId::parse(&args.item)?;
    let text = read_input(&args)?;
    validate_input(&text)?;
    let mut conn = db.connect().await?;
    // The same input again for an item whose first stage already succeeded on
    // it: a send would make a job that only finds the stage done. Nothing is sent.
    let hash = idemstage::ids::input_hash_of(text.as_bytes());
    let first_stage = first_job(&pipeline, tenant.clone(), item, hash.clone()).queue;
    if first_stage_succeeded(&mut conn, &tenant, &item, &first_stage, &hash).await? {
        println!("finished");
        eprintln!(
            "item {item} of tenant {tenant}: stage {first_stage} already succeeded on this \
             input; nothing was sent"
        );
        return Ok(ExitCode::SUCCESS);
    }
    let started = conn
        .transaction::<_, TxError, _>(async |conn| {
            // Another input than the stored one is refused under `Reject` (the
            // default) and replaces it under `Rerun`, with the send, atomically.
            Ok(start_in(conn, &pipeline, &tenant, &item, &text).await?)
        })
        .await
        .map_err(|e| e.into_repo())
        .context("enqueue failed; nothing was written")?;
    match started.sent {
        SendResult::Sent(id) => println!("{id}"),
        SendResult::Duplicate => {
            println!("duplicate");
            eprintln!(
                "item {item} of tenant {tenant}: a job for stage {first_stage} is live \
                 already; no job was sent"
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Whether `stage` of the item succeeded on the input `input_hash` (read in the
/// tenant's scope, as any role may).
async fn first_stage_succeeded(
    conn: &mut diesel_async::AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    stage: &str,
    input_hash: &str,
) -> anyhow::Result<bool> {
    use diesel::prelude::*;
    use diesel_async::RunQueryDsl;
    use idemstage::schema::stage_runs::dsl as r;
    let item_id = item.to_string();
    let found = idemstage::fenced::tenant_transaction(conn, tenant, async |conn| {
        r::stage_runs
            .filter(r::tenant_id.eq(tenant.as_str()))
            .filter(r::item_id.eq(&item_id))
            .filter(r::stage.eq(stage))
            .filter(r::input_hash.eq(input_hash))
            .filter(r::status.eq(idemstage::runs::RunStatus::Success.as_str()))
            .select(r::id)
            .first::<String>(conn)
            .await
            .optional()
    })
    .await
    .map_err(idemstage::db::map_diesel_error)?;
    Ok(found.is_some())
}
