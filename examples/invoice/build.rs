//! Re-embeds `migrations/` when a migration is added or changed.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
