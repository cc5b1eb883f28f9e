//! The token-accounting metrics (`llm`): tokens and answers by upstream, app and model, answers
//! whose usage could not be read, and the time a stream takes to its first event.

use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::llm::ledger::Ledger;
use crate::llm::{Reason, Tokens};

/// `upstream`, `app`, `model`, `type`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct TokenLabels {
    upstream: Arc<str>,
    app: Arc<str>,
    model: Arc<str>,
    r#type: &'static str,
}

/// `upstream`, `app`, `model`, `status`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct AnswerLabels {
    upstream: Arc<str>,
    app: Arc<str>,
    model: Arc<str>,
    status: u16,
}

/// `upstream`, `reason`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct UnreadableLabels {
    upstream: Arc<str>,
    reason: &'static str,
}

/// `upstream`, `model`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct ModelLabels {
    upstream: Arc<str>,
    model: Arc<str>,
}

type FirstTokenFamily = Family<ModelLabels, Histogram, fn() -> Histogram>;

fn first_token_histogram() -> Histogram {
    // 5 ms .. ~80 s: a cached answer starts in milliseconds, a reasoning model may think for a
    // minute before its first event.
    Histogram::new(exponential_buckets(0.005, 2.0, 15))
}

/// The token-accounting families, and the ledger behind `/debug/usage`.
#[derive(Debug)]
pub(super) struct LlmFamilies {
    tokens: Family<TokenLabels, Counter>,
    requests: Family<AnswerLabels, Counter>,
    unreadable: Family<UnreadableLabels, Counter>,
    first_token: FirstTokenFamily,
    pub(super) ledger: Arc<Ledger>,
}

impl Default for LlmFamilies {
    fn default() -> Self {
        LlmFamilies {
            tokens: Family::default(),
            requests: Family::default(),
            unreadable: Family::default(),
            first_token: FirstTokenFamily::new_with_constructor(first_token_histogram),
            ledger: Arc::default(),
        }
    }
}

impl LlmFamilies {
    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "llm_tokens",
            "Tokens LLM answers reported, by app and model; type: input (every prompt token, cached or not), output (reasoning included), cache_read and cache_write (parts of input), reasoning (part of output)",
            self.tokens.clone(),
        );
        registry.register(
            "llm_requests",
            "LLM answers, by app, model and HTTP status",
            self.requests.clone(),
        );
        registry.register(
            "llm_usage_unreadable",
            "Successful LLM answers whose usage could not be read, by reason",
            self.unreadable.clone(),
        );
        registry.register(
            "llm_time_to_first_token_seconds",
            "Streamed LLM answers: time from the response head to the end of the first event",
            self.first_token.clone(),
        );
    }
}

/// One upstream's token-accounting handles.
#[derive(Debug, Clone)]
pub struct LlmMetrics {
    upstream: Arc<str>,
    families: Arc<LlmFamilies>,
}

impl LlmMetrics {
    pub(super) fn new(upstream: String, families: Arc<LlmFamilies>) -> Self {
        LlmMetrics {
            upstream: upstream.into(),
            families,
        }
    }

    /// The app and model labels, and the usage table.
    pub fn ledger(&self) -> &Ledger {
        &self.families.ledger
    }

    /// Counts one answer with `status` for `app` and `model`: its tokens when read, its
    /// reason when its usage was unreadable.
    pub fn answer(
        &self,
        app: &Arc<str>,
        model: &Arc<str>,
        status: u16,
        read: Result<&Tokens, Option<Reason>>,
    ) {
        let f = &self.families;
        let labels = AnswerLabels {
            upstream: self.upstream.clone(),
            app: app.clone(),
            model: model.clone(),
            status,
        };
        f.requests.get_or_create(&labels).inc();
        match read {
            Ok(tokens) => {
                let AnswerLabels {
                    upstream, app, model, ..
                } = labels;
                let mut labels = TokenLabels {
                    upstream,
                    app,
                    model,
                    r#type: "input",
                };
                for (kind, count) in [
                    ("input", tokens.input),
                    ("output", tokens.output),
                    ("cache_read", tokens.cache_read),
                    ("cache_write", tokens.cache_write),
                    ("reasoning", tokens.reasoning),
                ] {
                    labels.r#type = kind;
                    f.tokens.get_or_create(&labels).inc_by(count);
                }
                f.ledger
                    .record(&self.upstream, &labels.app, &labels.model, Some(tokens));
            }
            Err(reason) => {
                if let Some(reason) = reason {
                    let labels = UnreadableLabels {
                        upstream: self.upstream.clone(),
                        reason: reason.as_str(),
                    };
                    f.unreadable.get_or_create(&labels).inc();
                }
                f.ledger.record(&self.upstream, app, model, None);
            }
        }
    }

    /// A stream's first event came `seconds` after its head.
    pub fn first_token(&self, model: &Arc<str>, seconds: f64) {
        let labels = ModelLabels {
            upstream: self.upstream.clone(),
            model: model.clone(),
        };
        self.families.first_token.get_or_create(&labels).observe(seconds);
    }
}
