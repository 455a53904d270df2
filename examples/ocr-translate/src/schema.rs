//! The Diesel schema of the team's own tables (see `migrations/`), written as
//! `diesel print-schema` would.
#![allow(missing_docs)] // the macro's modules and column types

diesel::table! {
    ocr_pages (id) {
        id -> Text,
        tenant_id -> Text,
        item_id -> Text,
        page -> Int4,
        text -> Text,
        created_at -> Timestamptz,
    }
}

diesel::table! {
    translations (tenant_id, item_id, page) {
        tenant_id -> Text,
        item_id -> Text,
        page -> Int4,
        text -> Text,
        created_at -> Timestamptz,
    }
}

diesel::allow_tables_to_appear_in_same_query!(ocr_pages, translations);

/// `diesel` (this crate's direct dependency, for `table!`) and the facade's
/// `idemstage::diesel` must be one crate: otherwise this schema's queries would not
/// run on the facade's connections. Fails to compile if they ever differ.
const _: fn(idemstage::diesel::pg::Pg) -> diesel::pg::Pg = |pg| pg;
