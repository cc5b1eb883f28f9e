//! Server-sent events framing (stub).
