//! The fields read, per provider (stub).
