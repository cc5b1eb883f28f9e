//! What an LLM API answer says was spent, read from its body as it streams past: the model and
//! the token counts of OpenAI's chat completions and Responses API, Anthropic's messages and
//! Gemini's `generateContent`, as JSON or as server-sent events, each normalised to one meaning
//! per count ([`Tokens`]).
//!
//! A [`Reader`] sees every byte the application gets, in the order it gets them, and keeps only a
//! few hundred bytes of state whatever the body's size: no body is buffered, delayed or changed.
//! It gives up on what it does not understand (malformed JSON, a document past
//! [`DOCUMENT_MAX`] bytes, nesting past [`DEPTH_MAX`], a count that is not a non-negative
//! integer) and says why ([`Reason`]); after a give-up it costs a comparison per chunk.
//!
//! Why a scanner of our own: the JSON crates that parse incrementally (actson,
//! json-event-parser, struson) buffer what they have not yet emitted and build every string and
//! key they meet; what is needed here is a handful of integers and one short string at known
//! paths, in bounded state per response (a thousand concurrent streams must cost under a KiB
//! each), skipping the text of a completion at `memchr` speed.
//!
//! Not handled here: which responses are read and who spent them (`proxy::meter`), the counts
//! kept per app and model ([`ledger`]).

mod fields;
mod json;
pub mod ledger;
#[cfg(test)]
mod reader_tests;
mod sse;

use std::fmt;

/// The longest model name kept; a longer one is taken as no model.
pub const MODEL_MAX: usize = 96;
/// The most bytes one JSON document (a body, an event's data, an element of a streamed array)
/// may have before the reader gives up on the response.
pub const DOCUMENT_MAX: u64 = 16 << 20;
/// The deepest nesting read; deeper is given up.
pub const DEPTH_MAX: usize = 64;

/// Which providers' fields a reader takes (`llm.usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shapes {
    /// Every shape below.
    All,
    /// OpenAI's chat completions and Responses API (and Azure OpenAI's, the same).
    OpenAi,
    /// Anthropic's messages.
    Anthropic,
    /// Gemini's `generateContent` and `streamGenerateContent`.
    Gemini,
}

/// How a body carries its JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// One JSON document (`application/json`); a top-level array's elements are documents of
    /// their own (Gemini's streamed answer without `alt=sse`).
    Json,
    /// Server-sent events (`text/event-stream`): each event's `data` is a document.
    Sse,
}

impl Framing {
    /// The framing of a body with this `Content-Type`; `None` for one that is not read. Every
    /// upstream answer's type passes here: one byte tells most apart.
    pub fn of(content_type: &[u8]) -> Option<Framing> {
        let value = content_type.trim_ascii_start();
        let (essence, framing) = match value.first()? | 0x20 {
            b'a' => (&b"application/json"[..], Framing::Json),
            b't' => (&b"text/event-stream"[..], Framing::Sse),
            _ => return None,
        };
        let (head, rest) = value.split_at_checked(essence.len())?;
        let ends = rest.first().is_none_or(|b| *b == b';' || b.is_ascii_whitespace());
        (ends && head.eq_ignore_ascii_case(essence)).then_some(framing)
    }
}

/// Tokens one answer spent, one meaning per count whatever the provider.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tokens {
    /// Every prompt token, cached or not (OpenTelemetry's `gen_ai.usage.input_tokens`).
    pub input: u64,
    /// Every generated token, reasoning included.
    pub output: u64,
    /// The part of `input` served from a prompt cache.
    pub cache_read: u64,
    /// The part of `input` written to a prompt cache.
    pub cache_write: u64,
    /// The part of `output` spent reasoning.
    pub reasoning: u64,
}

impl Tokens {
    /// Input and output: what a provider's tokens-per-minute limit counts.
    pub fn total(&self) -> u64 {
        self.input.saturating_add(self.output)
    }
}

/// A model name as an answer (or a request) gave it: printable ASCII, at most [`MODEL_MAX`]
/// bytes, kept inline.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Model {
    len: u8,
    bytes: [u8; MODEL_MAX],
}

impl Model {
    /// `name` as a model, if it is one: 1 to [`MODEL_MAX`] bytes of printable ASCII.
    pub fn new(name: &[u8]) -> Option<Model> {
        if name.is_empty() || name.len() > MODEL_MAX || !name.iter().all(|b| b.is_ascii_graphic()) {
            return None;
        }
        let mut bytes = [0; MODEL_MAX];
        bytes[..name.len()].copy_from_slice(name);
        Some(Model {
            len: name.len() as u8,
            bytes,
        })
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        // Only printable ASCII is ever stored.
        std::str::from_utf8(&self.bytes[..usize::from(self.len)]).unwrap_or_default()
    }
}

impl fmt::Debug for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an answer spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// The counts.
    pub tokens: Tokens,
    /// The model the answer names, if it did.
    pub model: Option<Model>,
}

/// Why an answer's usage could not be read (`egress_llm_usage_unreadable_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Not JSON, or not the JSON of any shape read.
    Malformed,
    /// A document longer than [`DOCUMENT_MAX`].
    TooLarge,
    /// Nesting deeper than [`DEPTH_MAX`].
    TooDeep,
    /// A count that is not a non-negative integer (`-5`, `1e309`, `"12"`, `3.5`).
    InvalidValue,
    /// Well-formed, but no usage in it (an OpenAI stream without `include_usage`).
    NoUsage,
    /// The body ended early (the upstream or the application left) before any usage came.
    Cut,
    /// The body is compressed (`Content-Encoding`), and not read.
    Compressed,
}

impl Reason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Malformed => "malformed",
            Reason::TooLarge => "too_large",
            Reason::TooDeep => "too_deep",
            Reason::InvalidValue => "invalid_value",
            Reason::NoUsage => "no_usage",
            Reason::Cut => "cut",
            Reason::Compressed => "compressed",
        }
    }
}

/// What a reader made of a whole body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Usage was read.
    Read(Usage),
    /// None could be; the model, when one was read before the reader gave up or the body ended.
    Unreadable {
        /// Why.
        reason: Reason,
        /// The model, if seen.
        model: Option<Model>,
    },
}

pub use json::Reader;

/// The provider a well-known API host belongs to, for `llm.usage: auto`.
pub fn known_host(host: &str) -> Option<Shapes> {
    let host = host.trim_end_matches('.');
    let is = |name: &str| host.eq_ignore_ascii_case(name);
    let under = |suffix: &str| {
        host.len() > suffix.len()
            && host.is_char_boundary(host.len() - suffix.len())
            && host[host.len() - suffix.len()..].eq_ignore_ascii_case(suffix)
    };
    if is("api.openai.com") || under(".openai.azure.com") {
        Some(Shapes::OpenAi)
    } else if is("api.anthropic.com") {
        Some(Shapes::Anthropic)
    } else if is("generativelanguage.googleapis.com") {
        Some(Shapes::Gemini)
    } else {
        None
    }
}

/// The model a request's path names, where the API puts it there: Gemini's
/// `/v1beta/models/{model}:generateContent`.
pub fn model_in_path(path: &str) -> Option<Model> {
    let after = path.split("/models/").nth(1)?;
    let name = after.split([':', '/', '?']).next()?;
    Model::new(name.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_types_choose_the_framing() {
        assert_eq!(Framing::of(b"application/json"), Some(Framing::Json));
        assert_eq!(
            Framing::of(b"Application/JSON; charset=utf-8"),
            Some(Framing::Json)
        );
        assert_eq!(
            Framing::of(b"text/event-stream;charset=UTF-8"),
            Some(Framing::Sse)
        );
        assert_eq!(Framing::of(b"text/plain"), None);
        assert_eq!(Framing::of(b"application/jsonl"), None);
        assert_eq!(Framing::of(b""), None);
        assert_eq!(
            Framing::of(b" application/json ; charset=utf-8"),
            Some(Framing::Json)
        );
        assert_eq!(Framing::of(b"text/event-streams"), None);
        assert_eq!(Framing::of(b"application/problem+json"), None);
        assert_eq!(Framing::of(b"text/html"), None);
    }

    #[test]
    fn known_hosts_and_their_providers() {
        assert_eq!(known_host("api.openai.com"), Some(Shapes::OpenAi));
        assert_eq!(known_host("API.OpenAI.com."), Some(Shapes::OpenAi));
        assert_eq!(known_host("my-res.openai.azure.com"), Some(Shapes::OpenAi));
        assert_eq!(known_host("openai.azure.com"), None);
        assert_eq!(known_host("api.anthropic.com"), Some(Shapes::Anthropic));
        assert_eq!(
            known_host("generativelanguage.googleapis.com"),
            Some(Shapes::Gemini)
        );
        assert_eq!(known_host("example.com"), None);
        assert_eq!(known_host("evilapi.openai.com"), None);
    }

    #[test]
    fn gemini_paths_name_the_model() {
        let model = model_in_path("/v1beta/models/gemini-2.5-flash:streamGenerateContent").unwrap();
        assert_eq!(model.as_str(), "gemini-2.5-flash");
        assert_eq!(model_in_path("/v1/chat/completions"), None);
        assert_eq!(model_in_path("/v1beta/models/:x"), None);
    }

    #[test]
    fn models_are_short_printable_ascii() {
        assert_eq!(
            Model::new(b"gpt-4o-2024-08-06").unwrap().as_str(),
            "gpt-4o-2024-08-06"
        );
        assert!(Model::new(b"").is_none());
        assert!(Model::new(b"has space").is_none());
        assert!(Model::new(&[b'a'; MODEL_MAX + 1]).is_none());
        assert!(Model::new(&[b'a'; MODEL_MAX]).is_some());
        assert!(Model::new("modèle".as_bytes()).is_none());
    }
}
