//! The smallest pipeline on idemstage, in one file: one stage (`greet`), one
//! table of its own (`greetings`, in `migrations/`), and the binary.
//!
//! ```sh
//! cargo run -p minimal-pipeline -- migrate
//! cargo run -p minimal-pipeline -- enqueue --tenant acme --item 01JDQ3W5AAAAAAAAAAAAAAAAAA --text world
//! cargo run -p minimal-pipeline -- worker --allow-owner   # Ctrl-C to stop
//! cargo run -p minimal-pipeline -- status
//! ```

use diesel::ExpressionMethods;
use idemstage::diesel_async::RunQueryDsl;
use idemstage::diesel_migrations::EmbeddedMigrations;
use idemstage::prelude::*;

/// The pipeline's own migrations, run after the core's by `migrate`.
pub const MIGRATIONS: EmbeddedMigrations = idemstage::embed_migrations!("migrations");

// The Diesel schema of the table in `migrations/` (as `diesel print-schema` writes it).
diesel::table! {
    greetings (tenant_id, item_id) {
        tenant_id -> Text,
        item_id -> Text,
        greeting -> Text,
        created_at -> Timestamptz,
    }
}

/// The one stage: greets the item's input and writes the greeting.
pub struct Greet;

#[async_trait]
impl Stage for Greet {
    const NAME: &'static str = "greet";
    /// The first stage reads the item's input text.
    type Input = String;
    /// What `prepare` computes and `commit` writes.
    type Prepared = String;
    /// What the stage hands on (kept with its successful attempt).
    type Output = String;

    /// Outside any transaction: the place for slow or paid work (an API call).
    /// Its result is checkpointed: a retry of this run does not compute it again.
    async fn prepare(&self, ctx: &PrepareContext<'_, String>) -> Result<String, StageError> {
        let name = ctx.input().trim();
        if name.is_empty() {
            return Err(StageError::Permanent("nobody to greet".into()));
        }
        Ok(format!("Hello, {name}!"))
    }

    /// Inside the fenced transaction, scoped to the run's tenant: the row commits
    /// together with the stage's success, or not at all.
    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        _input: &String,
        greeting: &String,
    ) -> Result<Done<String>, StageError> {
        let (tenant, item) = (tx.token().tenant.to_string(), tx.token().item.to_string());
        diesel::insert_into(greetings::table)
            .values((
                greetings::tenant_id.eq(tenant),
                greetings::item_id.eq(item),
                greetings::greeting.eq(greeting),
            ))
            .execute(tx.conn())
            .await?;
        Ok(Done::next(greeting.clone()))
    }
}

/// The pipeline: `greet`, alone.
pub fn pipeline() -> Pipeline {
    Pipeline::builder(Greet)
        .build()
        .expect("one stage is a valid pipeline")
}

fn main() -> std::process::ExitCode {
    idemstage_cli::run_app(
        idemstage_cli::App::new(pipeline())
            .with_name(env!("CARGO_PKG_NAME"), env!("CARGO_PKG_VERSION"))
            .with_migrations(vec![MIGRATIONS]),
    )
}
