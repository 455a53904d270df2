//! `embed_migrations!` reads `migrations/` at compile time, but cargo does not
//! know that: without this line a new or edited migration is not picked up until
//! something else changes.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
