//! Fingerprints this crate's migrations (`MIGRATIONS_FINGERPRINT`, the key of its
//! test template, `TestDb::with_template`), and tells cargo to re-embed them
//! (embed_migrations! alone does not notice edits).

use std::path::Path;

fn main() {
    // Read when the script runs, not baked in when it is built: a target
    // directory shared between two checkouts reuses the built script.
    let manifest_dir =
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let dir = Path::new(&manifest_dir).join("migrations");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut files = Vec::new();
    collect(&dir, &mut files);
    files.sort();
    // FNV-1a 64: stable across Rust versions, unlike DefaultHasher.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for file in files {
        println!("cargo:rerun-if-changed={}", file.display());
        let name = file
            .strip_prefix(&dir)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let body = std::fs::read(&file).unwrap();
        for byte in name.bytes().chain(body) {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    println!("cargo:rustc-env=IDEMSTAGE_EXAMPLE_MIGRATIONS_HASH={hash:016x}");
}

fn collect(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect(&path, out);
        } else {
            out.push(path);
        }
    }
}
