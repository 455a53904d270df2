//! The invoice pipeline against a real PostgreSQL (`DATABASE_URL`; every test has
//! a database of its own with the core's and this crate's migrations).

mod bound;
mod flows;
mod support;
