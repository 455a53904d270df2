//! The README's recipe for a crate outside this workspace ("A crate outside this
//! workspace"), built: its `Cargo.toml` and `build.rs`, read from the README,
//! with `examples/minimal`'s `src/main.rs` and `migrations/`, in a directory of
//! their own; `cargo build --offline` on the workspace's target directory (so the
//! dependencies built already are reused). Then a new migration, a second build,
//! and `migrate` must apply both: the `build.rs` made cargo embed it.

use std::path::{Path, PathBuf};
use std::process::Command;

use idemstage_testkit::TestDb;

/// Where the README's recipe expects idemstage's checkout.
const RECIPE_CHECKOUT: &str = "../idemstage/";

/// The fenced block after the README's marker `<!-- recipe: {name}`.
fn recipe(readme: &str, name: &str) -> String {
    let marker = format!("<!-- recipe: {name}");
    let start = readme
        .find(&marker)
        .unwrap_or_else(|| panic!("README.md has no {marker:?}"));
    let after = &readme[start..];
    let open = after.find("```").expect("a fenced block after the marker");
    let body = &after[open..];
    let body = &body[body.find('\n').unwrap() + 1..];
    body[..body.find("```").expect("the block ends")].to_owned()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// This test's target directory (`<target>/debug/deps/outside-…`).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.ancestors().nth(3).unwrap().to_path_buf()
}

/// `cargo build --offline` of the crate in `dir`; its stderr.
fn build(dir: &Path) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["build", "--offline"])
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", target_dir())
        .output()
        .expect("run cargo");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!(
        "{}",
        stderr
            .lines()
            .filter(|l| l.contains("Compiling"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(out.status.success(), "cargo build failed:\n{stderr}");
    stderr
}

#[tokio::test]
async fn the_readme_recipe_builds_a_crate_outside_the_workspace() {
    let minimal = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = minimal.join("../..").canonicalize().unwrap();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();

    let dir = std::env::temp_dir().join(format!(
        "idemstage-outside-{}-{}",
        std::process::id(),
        idemstage::ids::RowId::new()
    ));
    let krate = dir.join("my-pipeline");
    std::fs::create_dir_all(krate.join("src")).unwrap();

    let manifest = recipe(&readme, "Cargo.toml");
    assert!(manifest.contains(RECIPE_CHECKOUT), "{manifest}");
    let manifest = manifest.replace(RECIPE_CHECKOUT, &format!("{}/", root.display()));
    // Not the recipe's: the workspace's dev profile (its members with full debug
    // info, the rest without), so that the artifacts built for the workspace
    // are reused here rather than built again.
    let mut profile = String::from("\n[profile.dev.package.\"*\"]\ndebug = false\n");
    let workspace = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    for line in workspace.lines() {
        if let Some((name, spec)) = line.split_once(" = { path = ") {
            if name.starts_with("idemstage") && !spec.contains("..") {
                profile.push_str(&format!("[profile.dev.package.{name}]\ndebug = true\n"));
            }
        }
    }
    std::fs::write(krate.join("Cargo.toml"), manifest + &profile).unwrap();
    std::fs::write(krate.join("build.rs"), recipe(&readme, "build.rs")).unwrap();
    // The versions the workspace builds with (and has in its target directory).
    std::fs::copy(root.join("Cargo.lock"), krate.join("Cargo.lock")).unwrap();
    std::fs::copy(minimal.join("src/main.rs"), krate.join("src/main.rs")).unwrap();
    copy_dir(&minimal.join("migrations"), &krate.join("migrations"));

    build(&krate);

    // A new migration: the recipe's build.rs makes the next build embed it.
    let added = krate.join("migrations/2026-12-10-000002_farewells");
    std::fs::create_dir_all(&added).unwrap();
    std::fs::write(
        added.join("up.sql"),
        "CREATE TABLE farewells (tenant_id tenant_slug NOT NULL, note text NOT NULL);\n\
         SELECT idemstage_tenant_table('farewells');\n",
    )
    .unwrap();
    std::fs::write(added.join("down.sql"), "DROP TABLE farewells;\n").unwrap();
    let rebuilt = build(&krate);
    assert!(rebuilt.contains("Compiling my-pipeline"), "{rebuilt}");

    // The binary applies the core's migrations (TestDb::new has them), then both of
    // the crate's.
    let db = TestDb::new().await;
    let migrated = Command::new(target_dir().join("debug/my-pipeline"))
        .arg("migrate")
        .env("DATABASE_URL", db.url())
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert!(migrated.status.success(), "{migrated:?}");
    assert_eq!(
        String::from_utf8_lossy(&migrated.stdout).trim(),
        "applied 2 migration(s)"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
