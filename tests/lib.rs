//! Workspace-level tests live in `it/`; this library is empty.
