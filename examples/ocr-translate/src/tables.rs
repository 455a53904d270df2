//! The team's writes and reads of its own tables, as an extension trait on the
//! fenced transaction (the model: `idemstage-example`'s `tables.rs`). Every
//! statement runs on [`FencedTx::conn`], the tenant-scoped connection of the
//! stage's fenced transaction, so it commits with the stage's success or not at
//! all. The tenant filters are explicit although row-level security enforces
//! them too.

use diesel::prelude::*;
use diesel::upsert::excluded;
use idemstage::diesel_async::RunQueryDsl;
use idemstage::{
    async_trait, db::map_diesel_error, db::RepoError, fenced::FencedTx, fenced::Replaced,
    ids::RowId,
};

use crate::schema::{ocr_pages, translations};

/// A page as the ocr stage stored it.
#[derive(Clone, Debug, PartialEq, Eq, Queryable, Selectable)]
#[diesel(table_name = ocr_pages, check_for_backend(diesel::pg::Pg))]
pub struct OcrPage {
    /// The page number, from 1.
    pub page: i32,
    /// The page's text.
    pub text: String,
}

/// A translated page.
#[derive(Clone, Debug, PartialEq, Eq, Queryable, Selectable)]
#[diesel(table_name = translations, check_for_backend(diesel::pg::Pg))]
pub struct Translation {
    /// The ocr page it translates.
    pub page: i32,
    /// The translated text.
    pub text: String,
}

#[derive(Insertable)]
#[diesel(table_name = ocr_pages)]
struct NewPage<'a> {
    id: String,
    tenant_id: &'a str,
    item_id: String,
    page: i32,
    text: &'a str,
}

#[derive(Insertable)]
#[diesel(table_name = translations)]
struct NewTranslation<'a> {
    tenant_id: &'a str,
    item_id: String,
    page: i32,
    text: &'a str,
}

/// The ocr-translate tables, on the fenced transaction of one of its stages.
#[async_trait]
pub trait OcrTables {
    /// DELETE-before-INSERT of the item's `ocr_pages`: afterwards it has exactly
    /// `pages` (numbered from 1).
    async fn replace_ocr_pages(&mut self, pages: &[String]) -> Result<Replaced, RepoError>;

    /// The item's current ocr pages, in page order.
    async fn ocr_pages(&mut self) -> Result<Vec<OcrPage>, RepoError>;

    /// Per-row upsert of the item's `translations` (`texts`, one per page,
    /// numbered from 1), then a delete of those past the new set: afterwards it
    /// has exactly these pages.
    async fn upsert_translations(&mut self, texts: &[String]) -> Result<Replaced, RepoError>;

    /// The item's translations, in page order.
    async fn translations(&mut self) -> Result<Vec<Translation>, RepoError>;
}

#[async_trait]
impl OcrTables for FencedTx<'_> {
    async fn replace_ocr_pages(&mut self, pages: &[String]) -> Result<Replaced, RepoError> {
        use ocr_pages::dsl as p;
        let token = self.token().clone();
        let rows: Vec<NewPage<'_>> = pages
            .iter()
            .zip(1..)
            .map(|(text, page)| NewPage {
                id: RowId::new().to_string(),
                tenant_id: token.tenant.as_str(),
                item_id: token.item.to_string(),
                page,
                text,
            })
            .collect();
        let delete = diesel::delete(
            p::ocr_pages
                .filter(p::tenant_id.eq(token.tenant.as_str()))
                .filter(p::item_id.eq(token.item.to_string())),
        );
        let insert = diesel::insert_into(p::ocr_pages).values(rows);
        self.replace_children(delete, insert).await
    }

    async fn ocr_pages(&mut self) -> Result<Vec<OcrPage>, RepoError> {
        use ocr_pages::dsl as p;
        let token = self.token().clone();
        p::ocr_pages
            .filter(p::tenant_id.eq(token.tenant.as_str()))
            .filter(p::item_id.eq(token.item.to_string()))
            .order(p::page)
            .select(OcrPage::as_select())
            .load(self.conn())
            .await
            .map_err(map_diesel_error)
    }

    async fn upsert_translations(&mut self, texts: &[String]) -> Result<Replaced, RepoError> {
        use translations::dsl as t;
        let token = self.token().clone();
        let keep: Vec<i32> = (1..).take(texts.len()).collect();
        let delete_rest = diesel::delete(
            t::translations
                .filter(t::tenant_id.eq(token.tenant.as_str()))
                .filter(t::item_id.eq(token.item.to_string()))
                .filter(diesel::dsl::not(t::page.eq_any(keep))),
        );
        if texts.is_empty() {
            // An upsert of no rows is no statement; only the delete remains.
            let deleted = delete_rest
                .execute(self.conn())
                .await
                .map_err(map_diesel_error)?;
            return Ok(Replaced {
                deleted,
                written: 0,
            });
        }
        let rows: Vec<NewTranslation<'_>> = texts
            .iter()
            .zip(1..)
            .map(|(text, page)| NewTranslation {
                tenant_id: token.tenant.as_str(),
                item_id: token.item.to_string(),
                page,
                text,
            })
            .collect();
        let upsert = diesel::insert_into(t::translations)
            .values(rows)
            .on_conflict((t::tenant_id, t::item_id, t::page))
            .do_update()
            .set((
                t::text.eq(excluded(t::text)),
                t::created_at.eq(diesel::dsl::now),
            ));
        self.upsert_children(upsert, delete_rest).await
    }

    async fn translations(&mut self) -> Result<Vec<Translation>, RepoError> {
        use translations::dsl as t;
        let token = self.token().clone();
        t::translations
            .filter(t::tenant_id.eq(token.tenant.as_str()))
            .filter(t::item_id.eq(token.item.to_string()))
            .order(t::page)
            .select(Translation::as_select())
            .load(self.conn())
            .await
            .map_err(map_diesel_error)
    }
}
