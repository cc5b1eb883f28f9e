//! Pacing to an upstream's advertised rate limits: what its responses say is left of each
//! pace key's quota, and holding requests (in order, by priority) until it may go, instead of
//! letting them collect 429s.

pub mod report;
