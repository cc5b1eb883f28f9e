//! The `llm` keys, per upstream and in `defaults`: whether the token usage an LLM API reports in
//! its answers is read, and whose shapes.

use serde::Serialize;

use super::problems::Problems;
use super::schema::FileLlm;

/// What `llm.usage` reads of an upstream's answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum UsageMode {
    /// JSON and event-stream answers: all of a known provider's host, and any other whose
    /// body turns out to have a provider's shape.
    #[default]
    Auto,
    /// OpenAI's (and Azure OpenAI's) shapes only, in every JSON or event-stream answer.
    OpenAi,
    /// Anthropic's shapes only.
    Anthropic,
    /// Gemini's shapes only.
    Gemini,
    /// Nothing is read.
    Off,
}

impl UsageMode {
    fn parse(text: &str) -> Option<UsageMode> {
        Some(match text {
            "auto" => UsageMode::Auto,
            "openai" => UsageMode::OpenAi,
            "anthropic" => UsageMode::Anthropic,
            "gemini" => UsageMode::Gemini,
            "off" => UsageMode::Off,
            _ => return None,
        })
    }
}

/// An upstream's `llm` settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
pub struct LlmConfig {
    /// Whose usage fields are read (`auto`, `openai`, `anthropic`, `gemini`, `off`).
    pub usage: UsageMode,
}

/// `llm` under `prefix`, over `base`.
pub(super) fn merge_llm(base: &LlmConfig, raw: &FileLlm, prefix: &str, problems: &mut Problems) -> LlmConfig {
    let usage = match raw.usage.as_deref() {
        None => base.usage,
        Some(text) => UsageMode::parse(text).unwrap_or_else(|| {
            problems.add(
                format!("{prefix}.usage"),
                format!("{text:?} is not auto, openai, anthropic, gemini or off"),
            );
            base.usage
        }),
    };
    LlmConfig { usage }
}
