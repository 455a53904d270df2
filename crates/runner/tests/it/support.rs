//! Helpers shared by the in-process worker tests: the example pipeline's (in the
//! testkit), and `count`. The helpers for `idemstage worker` processes are in
//! `crates/dev/tests/it/support.rs`.

pub use idemstage_harness::example::*;
pub use idemstage_testkit::count;
