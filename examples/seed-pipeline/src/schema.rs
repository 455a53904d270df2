//! The Diesel schema of the example's own tables, as `diesel print-schema` writes
//! them. The tables are still created by the core's migrations (and so also in
//! `idemstage-persistence`'s `schema.rs`, which must match the migrations); this
//! crate's code names only these.
#![allow(missing_docs)] // the macro's modules and column types

diesel::table! {
    anfrage_extraktionen (id) {
        id -> Text,
        tenant_id -> Text,
        item_id -> Text,
        position_index -> Int4,
        description -> Text,
        quantity -> Nullable<Float8>,
        unit -> Nullable<Text>,
        run_id -> Text,
        attempt -> Int4,
        created_at -> Timestamptz,
    }
}

diesel::table! {
    calculation_results (tenant_id, item_id) {
        tenant_id -> Text,
        item_id -> Text,
        total_cents -> Int8,
        currency -> Text,
        lines -> Jsonb,
        run_id -> Text,
        attempt -> Int4,
        created_at -> Timestamptz,
    }
}

diesel::table! {
    dateien (id) {
        id -> Text,
        tenant_id -> Text,
        item_id -> Text,
        sha256 -> Text,
        s3_key -> Text,
        size_bytes -> Int8,
        created_at -> Timestamptz,
    }
}

diesel::table! {
    feasibility_results (tenant_id, item_id) {
        tenant_id -> Text,
        item_id -> Text,
        feasible -> Bool,
        reasons -> Jsonb,
        run_id -> Text,
        attempt -> Int4,
        created_at -> Timestamptz,
    }
}

diesel::allow_tables_to_appear_in_same_query!(
    anfrage_extraktionen,
    calculation_results,
    dateien,
    feasibility_results,
);

/// `diesel` (this crate's direct dependency, for `table!`) and the facade's
/// `idemstage::diesel` must be one crate: otherwise this schema's queries would not
/// run on the facade's connections. Fails to compile if they ever differ.
const _: fn(idemstage::diesel::pg::Pg) -> diesel::pg::Pg = |pg| pg;
