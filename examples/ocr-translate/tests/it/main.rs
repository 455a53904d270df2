//! The ocr-translate pipeline against a real PostgreSQL (`DATABASE_URL`; every test
//! has its own database with the core's and this crate's migrations).

mod binary;
mod end_to_end;
mod failures;
mod isolation;
mod rerun;
mod schema;
mod support;
