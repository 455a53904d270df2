//! # idemstage-example
//!
//! The seed's example pipeline, `intake → extract → feasibility → calculate`: the
//! library's first user, written the way a team outside our crates writes a
//! pipeline, on nothing of ours but the facade `idemstage`. Deterministic and
//! offline: the "LLM" is a line parser over the item's text.
//! The seed calls an item an *Anfrage* (a customer's request); its German words
//! (`dateien`, `anfrage_extraktionen`, Stk) stay in this crate, the core's are
//! generic (`ItemId`, `items`, `stage_runs`).
//!
//! - [`Intake`] stores the item's input as a `dateien` row (insert-or-get) and
//!   audits it.
//! - [`Extract`] replaces the item's `anfrage_extraktionen`
//!   ([`extract_positions`]).
//! - [`Feasibility`] records whether every position can be priced
//!   ([`feasibility_reasons`]) and stops the item if not.
//! - [`Calculate`] prices the positions ([`price_positions`]).
//!
//! Its tables are written through [`ExampleTables`], an extension trait on the
//! fenced transaction, with this crate's own Diesel [`schema`]; [`check`] is the
//! invariant checker that `idemstage demo`, `idemstage bench` and the fault tests
//! run against the database after the fact. The tables are created by this crate's
//! own [`MIGRATIONS`], run after the core's. The `idemstage` binary of
//! `idemstage-dev` (our `idemstage` binary) runs this pipeline.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let url = "postgres://localhost/app";
//! idemstage::db::migrate_with(url, vec![idemstage_example::MIGRATIONS]).await?;
//! let pool = idemstage::db::connect_pool(url, Default::default()).await?;
//! let pipeline = idemstage_example::pipeline(idemstage_example::Chaos::default());
//! let tenant = idemstage::ids::TenantId::parse("acme")?;
//! let item = idemstage::ids::ItemId::new();
//! idemstage::pipeline::start(&pool, &pipeline, &tenant, &item, "10 Stk Schrauben").await?;
//! // ... and a `PipelineWorker` over `pipeline` works it.
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

use idemstage::diesel_migrations::{self, embed_migrations, EmbeddedMigrations};

pub mod check;
mod fan_out;
pub mod llm;
pub mod schema;
mod stages;
mod tables;

pub use check::{check_example_pipeline, PipelineCheck};
pub use fan_out::{
    fan_out_pipeline, ExtractPositions, GatherCalculate, PositionFeasibility, PositionVerdict,
};
pub use stages::{
    extract_positions, feasibility_reasons, pipeline, pipeline_with, pipeline_with_llm,
    pipeline_with_options, price_positions, Calculate, Chaos, Extract, Feasibility, Intake,
    PriceError, MAX_QUANTITY, PRICES,
};
pub use tables::{insert_or_get_datei, DateiRef, ExampleTables, Extraktion};

/// This pipeline's migrations (`dateien`, `anfrage_extraktionen`,
/// `feasibility_results`, `calculation_results`, each under the core's tenant
/// isolation), to run after the core's:
/// `idemstage::db::migrate_with(url, vec![MIGRATIONS])`. Their versions
/// (`2026-12-01-2000xx`) cannot collide with the core's or another example's.
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations");

/// A hash of the files of [`MIGRATIONS`] (16 hex digits): it changes whenever they
/// change, so test templates keyed on it are rebuilt
/// (`idemstage_testkit::TestDb::with_template`).
pub const MIGRATIONS_FINGERPRINT: &str = env!("IDEMSTAGE_EXAMPLE_MIGRATIONS_HASH");
