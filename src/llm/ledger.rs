//! Counts per app and model (stub).
