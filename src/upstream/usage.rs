//! What an upstream's answers are read for: the token usage an LLM API reports (`llm.usage`),
//! decided once per upstream from its settings and host.

use std::sync::Arc;

use super::Upstream;
use crate::config::{Authority, UsageMode};
use crate::llm::{self, Shapes};
use crate::metrics::{LlmMetrics, Metrics};

/// How one upstream's answers are read for usage; none when `llm.usage` is `off`.
#[derive(Debug)]
pub struct Reading {
    /// Whose fields are read.
    pub shapes: Shapes,
    /// Every JSON and event-stream answer is an LLM answer (a known provider's host, or a
    /// provider named in `llm.usage`), counted even when it reports no usage; otherwise only
    /// those whose body turns out to have a provider's shape count.
    pub always: bool,
    /// Requests name their model in the path (Gemini's API): the fallback for an answer that
    /// names none.
    pub model_in_path: bool,
    /// Where it is counted.
    pub metrics: LlmMetrics,
}

impl Reading {
    /// The reading `mode` asks of the upstream `label` at `authority`.
    pub(super) fn new(
        mode: UsageMode,
        label: &str,
        authority: &Authority,
        metrics: &Metrics,
    ) -> Option<Arc<Self>> {
        let known = llm::known_host(&authority.host);
        let (shapes, always) = match mode {
            UsageMode::Off => return None,
            UsageMode::Auto => (Shapes::All, known.is_some()),
            UsageMode::OpenAi => (Shapes::OpenAi, true),
            UsageMode::Anthropic => (Shapes::Anthropic, true),
            UsageMode::Gemini => (Shapes::Gemini, true),
        };
        let gemini = shapes == Shapes::Gemini || known == Some(Shapes::Gemini);
        Some(Arc::new(Reading {
            shapes,
            always,
            model_in_path: gemini,
            metrics: metrics.llm(label),
        }))
    }
}

impl Upstream {
    /// How this upstream's answers are read for usage; `None` when they are not.
    pub fn usage(&self) -> Option<&Arc<Reading>> {
        self.usage.as_ref()
    }
}
