//! Tenant isolation of the team's tables (`idemstage_tenant_table`), seen from a
//! stage (a probe stage of tenant B looks through its fenced transaction, which
//! the executor scopes to B) and from the team's own code outside a stage
//! (`idemstage::fenced::tenant_transaction`).

use std::sync::{Arc, Mutex};

use diesel::prelude::*;
use idemstage::diesel_async::RunQueryDsl;
use idemstage::{
    async_trait, fenced::FencedTx, pipeline::Pipeline, stage::Done, stage::ExecutionOutcome,
    stage::PrepareContext, stage::Stage, stage::StageError,
};
use ocr_translate::pipeline;
use ocr_translate::schema::{ocr_pages, translations};

use crate::failures::{PAGES_1, PAGES_2, TEXT_1, TEXT_2};
use crate::support::*;

/// What the probe saw.
#[derive(Debug, Default)]
struct Seen {
    page_tenants: Vec<String>,
    translation_tenants: Vec<String>,
    a_pages_by_id: i64,
    a_pages_updated: usize,
    a_translations_deleted: usize,
    insert_as_a: Option<String>,
}

/// Tenant B's probe: reads the team's tables with no tenant filter, then tries to
/// change tenant A's rows (by A's item id), then to write a row as tenant A.
/// Ends in an error, so that its transaction rolls back in any case.
struct Probe {
    a_item: String,
    seen: Mutex<Seen>,
}

fn db(e: diesel::result::Error) -> StageError {
    StageError::Repo(idemstage::db::map_diesel_error(e))
}

#[async_trait]
impl Stage for Probe {
    const NAME: &'static str = "probe";
    type Input = String;
    type Prepared = ();
    type Output = ();
    async fn prepare(&self, _: &PrepareContext<'_, String>) -> Result<(), StageError> {
        Ok(())
    }
    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        _: &String,
        _: &(),
    ) -> Result<Done<()>, StageError> {
        use ocr_pages::dsl as p;
        use translations::dsl as t;
        let mut seen = Seen {
            page_tenants: p::ocr_pages
                .select(p::tenant_id)
                .order(p::page)
                .load(tx.conn())
                .await
                .map_err(db)?,
            translation_tenants: t::translations
                .select(t::tenant_id)
                .order(t::page)
                .load(tx.conn())
                .await
                .map_err(db)?,
            a_pages_by_id: p::ocr_pages
                .filter(p::item_id.eq(&self.a_item))
                .count()
                .get_result(tx.conn())
                .await
                .map_err(db)?,
            a_pages_updated: diesel::update(p::ocr_pages.filter(p::item_id.eq(&self.a_item)))
                .set(p::text.eq("overwritten by b"))
                .execute(tx.conn())
                .await
                .map_err(db)?,
            a_translations_deleted: diesel::delete(
                t::translations.filter(t::item_id.eq(&self.a_item)),
            )
            .execute(tx.conn())
            .await
            .map_err(db)?,
            insert_as_a: None,
        };
        // Last: a refused statement aborts the transaction.
        let insert = diesel::insert_into(p::ocr_pages)
            .values((
                p::id.eq(idemstage::ids::RowId::new().to_string()),
                p::tenant_id.eq("tenant-a"),
                p::item_id.eq(&self.a_item),
                p::page.eq(99),
                p::text.eq("planted by b"),
            ))
            .execute(tx.conn())
            .await;
        seen.insert_as_a = Some(match insert {
            Ok(n) => format!("inserted {n}"),
            Err(e) => e.to_string(),
        });
        *self.seen.lock().unwrap() = seen;
        Err(StageError::Permanent("probe done".into()))
    }
}

#[tokio::test]
async fn a_stage_of_tenant_b_sees_and_changes_none_of_tenant_as_rows() {
    let mut f = fixture().await;
    let pipeline = pipeline();
    let exec = f.executor();
    let a = f.item(&pipeline, &tenant("tenant-a"), TEXT_1).await;
    let b = f.item(&pipeline, &tenant("tenant-b"), TEXT_2).await;
    for job in [&a, &b] {
        for stage in pipeline.stages() {
            assert!(matches!(
                exec.run(&pipeline, stage, job).await.unwrap(),
                ExecutionOutcome::Succeeded { .. }
            ));
        }
    }
    let probe = Arc::new(Probe {
        a_item: a.item_id.to_string(),
        seen: Mutex::default(),
    });
    let probing = Pipeline::builder(probe.clone()).build().unwrap();
    let probe_job = f.item(&probing, &tenant("tenant-b"), "probe").await;
    let outcome = exec
        .run(&probing, probing.first_stage(), &probe_job)
        .await
        .unwrap();
    assert!(
        matches!(outcome, ExecutionOutcome::Failed { dead: true, ref error, .. } if error.contains("probe done")),
        "{outcome:?}"
    );

    let seen = std::mem::take(&mut *probe.seen.lock().unwrap());
    // B sees its own rows, and only those.
    assert_eq!(
        seen.page_tenants,
        vec!["tenant-b"; PAGES_2.len()],
        "{seen:?}"
    );
    assert_eq!(
        seen.translation_tenants,
        vec!["tenant-b"; PAGES_2.len()],
        "{seen:?}"
    );
    assert_eq!(seen.a_pages_by_id, 0, "{seen:?}");
    assert_eq!(
        (seen.a_pages_updated, seen.a_translations_deleted),
        (0, 0),
        "{seen:?}"
    );
    let refused = seen.insert_as_a.as_deref().unwrap();
    assert!(
        refused.contains("row-level security policy"),
        "a row of tenant A written by B: {refused}"
    );

    // A's rows are as A's stages wrote them.
    assert_eq!(f.pages(&a).await, expected_pages(&PAGES_1, 1));
    assert_eq!(
        f.translations(&a).await,
        expected_translations(&PAGES_1, 1, 1)
    );
}

/// The team's own read outside a stage, as its API would do it: scoped to
/// tenant B, it finds none of A's pages, even by A's item id, and all of B's.
#[tokio::test]
async fn a_tenant_transaction_of_the_team_sees_only_its_tenants_rows() {
    let mut f = fixture().await;
    let pipeline = pipeline();
    let exec = f.executor();
    let a = f.item(&pipeline, &tenant("tenant-a"), TEXT_1).await;
    let b = f.item(&pipeline, &tenant("tenant-b"), TEXT_2).await;
    for job in [&a, &b] {
        assert!(matches!(
            exec.run(&pipeline, pipeline.first_stage(), job)
                .await
                .unwrap(),
            ExecutionOutcome::Succeeded { .. }
        ));
    }
    let a_item = a.item_id.to_string();
    let (all, a_by_id) = idemstage::fenced::tenant_transaction::<_, diesel::result::Error, _>(
        &mut f.conn,
        &tenant("tenant-b"),
        async |conn| {
            let all: Vec<String> = ocr_pages::table
                .select(ocr_pages::tenant_id)
                .load(conn)
                .await?;
            let a_by_id: i64 = ocr_pages::table
                .filter(ocr_pages::item_id.eq(&a_item))
                .count()
                .get_result(conn)
                .await?;
            Ok((all, a_by_id))
        },
    )
    .await
    .unwrap();
    assert_eq!(all, vec!["tenant-b"; PAGES_2.len()]);
    assert_eq!(a_by_id, 0);
    // The same connection outside the scope (the superuser) sees both again.
    assert_eq!(f.pages(&a).await, expected_pages(&PAGES_1, 1));
}
