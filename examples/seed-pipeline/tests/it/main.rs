//! The seed example's integration tests in one binary (`cargo test -p
//! idemstage-example --test it`). Those here need no database; the schema's test,
//! which does, is `tests/schema.rs`.

mod llm;
