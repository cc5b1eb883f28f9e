//! The token-accounting metrics (`llm`): tokens and answers by upstream, app and model, answers
//! whose usage could not be read, and the time a stream takes to its first event.

use std::sync::{Arc, Mutex, OnceLock};

use rustc_hash::FxHashMap;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::per_upstream::{by_upstream, UpstreamFamily};
use crate::llm::ledger::{Entry, Ledger};
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
    status: &'static str,
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

by_upstream!(TokenLabels, AnswerLabels, UnreadableLabels, ModelLabels);

type FirstTokenFamily = UpstreamFamily<ModelLabels, Histogram, fn() -> Histogram>;

fn first_token_histogram() -> Histogram {
    // 5 ms .. ~80 s: a cached answer starts in milliseconds, a reasoning model may think for a
    // minute before its first event.
    Histogram::new(exponential_buckets(0.005, 2.0, 15))
}

/// The token-accounting families, and the ledger behind `/debug/usage`.
#[derive(Debug)]
pub(super) struct LlmFamilies {
    tokens: UpstreamFamily<TokenLabels, Counter>,
    requests: UpstreamFamily<AnswerLabels, Counter>,
    unreadable: UpstreamFamily<UnreadableLabels, Counter>,
    first_token: FirstTokenFamily,
    pub(super) ledger: Arc<Ledger>,
}

impl Default for LlmFamilies {
    fn default() -> Self {
        LlmFamilies {
            tokens: UpstreamFamily::default(),
            requests: UpstreamFamily::default(),
            unreadable: UpstreamFamily::default(),
            first_token: FirstTokenFamily::new_with_constructor(first_token_histogram),
            ledger: Arc::default(),
        }
    }
}

impl LlmFamilies {
    /// Removes every series of the upstream labelled `upstream` (`/debug/usage` keeps its rows).
    pub(super) fn forget(&self, upstream: &str) {
        self.tokens.forget(upstream);
        self.requests.forget(upstream);
        self.unreadable.forget(upstream);
        self.first_token.forget(upstream);
    }

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
    /// The handles of each (app, model) counted, by the labels' addresses: labels are interned
    /// by the ledger (one `Arc` per name), so an answer is counted with no hash of a label set
    /// and no family lookup (they cost 3,000 instructions an answer, callgrind).
    rows: Arc<Mutex<Rows>>,
}

/// The rows of an upstream, by the addresses of their app and model labels.
type Rows = FxHashMap<(usize, usize), Arc<Row>>;

/// The counters of one upstream, app and model.
#[derive(Debug)]
struct Row {
    app: Arc<str>,
    model: Arc<str>,
    /// `input`, `output`, `cache_read`, `cache_write`, `reasoning`: made with the first answer
    /// whose usage was read, so the series appear with a count.
    tokens: OnceLock<[Counter; 5]>,
    /// `egress_llm_requests_total` by status, as met.
    answers: Mutex<Vec<(u16, Counter)>>,
    /// `egress_llm_time_to_first_token_seconds` of the model, made with its first stream.
    first_token: OnceLock<Histogram>,
    ledger: Arc<Entry>,
}

const TOKEN_TYPES: [&str; 5] = ["input", "output", "cache_read", "cache_write", "reasoning"];

/// The `status` label: the code for the statuses LLM APIs answer with, else its class, so an
/// upstream cannot make a series per code it invents.
fn status_label(code: u16) -> &'static str {
    const NAMED: [(u16, &str); 15] = [
        (200, "200"),
        (400, "400"),
        (401, "401"),
        (403, "403"),
        (404, "404"),
        (408, "408"),
        (409, "409"),
        (413, "413"),
        (422, "422"),
        (429, "429"),
        (500, "500"),
        (502, "502"),
        (503, "503"),
        (504, "504"),
        (529, "529"),
    ];
    if let Some((_, label)) = NAMED.iter().find(|(named, _)| *named == code) {
        return label;
    }
    match code {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

impl LlmMetrics {
    pub(super) fn new(upstream: String, families: Arc<LlmFamilies>) -> Self {
        LlmMetrics {
            upstream: upstream.into(),
            families,
            rows: Arc::default(),
        }
    }

    /// The app and model labels, and the usage table.
    pub fn ledger(&self) -> &Ledger {
        &self.families.ledger
    }

    /// The handles of `app` and `model` (labels the ledger gave), made when new.
    fn row(&self, app: &Arc<str>, model: &Arc<str>) -> Arc<Row> {
        let key = (
            Arc::as_ptr(app).cast::<u8>() as usize,
            Arc::as_ptr(model).cast::<u8>() as usize,
        );
        let mut rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
        rows.entry(key)
            .or_insert_with(|| {
                Arc::new(Row {
                    app: app.clone(),
                    model: model.clone(),
                    tokens: OnceLock::new(),
                    answers: Mutex::default(),
                    first_token: OnceLock::new(),
                    ledger: self.families.ledger.row(&self.upstream, app, model),
                })
            })
            .clone()
    }

    /// Counts one answer with `status` for `app` and `model`: its tokens when read, its
    /// reason when its usage was unreadable (`None`: not counted as unreadable), and for a
    /// stream the seconds from its head to its first event.
    pub fn answer(
        &self,
        app: &Arc<str>,
        model: &Arc<str>,
        status: u16,
        read: Result<&Tokens, Option<Reason>>,
        first_event: Option<f64>,
    ) {
        let row = self.row(app, model);
        row.answered(status, &self.families, &self.upstream);
        if let Some(seconds) = first_event {
            let first_token = row.first_token.get_or_init(|| {
                let labels = ModelLabels {
                    upstream: self.upstream.clone(),
                    model: row.model.clone(),
                };
                self.families.first_token.get_or_create_owned(&labels)
            });
            first_token.observe(seconds);
        }
        match read {
            Ok(tokens) => {
                let counts = [
                    tokens.input,
                    tokens.output,
                    tokens.cache_read,
                    tokens.cache_write,
                    tokens.reasoning,
                ];
                let counters = row.tokens.get_or_init(|| {
                    TOKEN_TYPES.map(|kind| {
                        let labels = TokenLabels {
                            upstream: self.upstream.clone(),
                            app: row.app.clone(),
                            model: row.model.clone(),
                            r#type: kind,
                        };
                        self.families.tokens.get_or_create_owned(&labels)
                    })
                });
                for (counter, count) in counters.iter().zip(counts) {
                    counter.inc_by(count);
                }
                row.ledger.record(Some(tokens));
            }
            Err(reason) => {
                if let Some(reason) = reason {
                    let labels = UnreadableLabels {
                        upstream: self.upstream.clone(),
                        reason: reason.as_str(),
                    };
                    self.families.unreadable.get_or_create_owned(&labels).inc();
                }
                row.ledger.record(None);
            }
        }
    }
}

impl Row {
    /// Counts an answer with `status`.
    fn answered(&self, status: u16, families: &LlmFamilies, upstream: &Arc<str>) {
        let mut answers = self.answers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, counter)) = answers.iter().find(|(code, _)| *code == status) {
            counter.inc();
            return;
        }
        let labels = AnswerLabels {
            upstream: upstream.clone(),
            app: self.app.clone(),
            model: self.model.clone(),
            status: status_label(status),
        };
        let counter = families.requests.get_or_create_owned(&labels);
        counter.inc();
        answers.push((status, counter));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unusual_statuses_are_labelled_by_class() {
        assert_eq!(status_label(200), "200");
        assert_eq!(status_label(529), "529");
        assert_eq!(status_label(299), "2xx");
        assert_eq!(status_label(418), "4xx");
        assert_eq!(status_label(999), "5xx");
        assert_eq!(status_label(101), "1xx");
    }

    #[test]
    fn answers_count_in_the_families_and_the_ledger_alike() {
        let metrics = crate::metrics::Metrics::new();
        let llm = metrics.llm("openai");
        let ledger = llm.ledger();
        let (app, model) = (ledger.app("billing"), ledger.model(Some("gpt-4o")));
        let tokens = Tokens {
            input: 10,
            output: 4,
            cache_read: 3,
            cache_write: 0,
            reasoning: 1,
        };
        llm.answer(&app, &model, 200, Ok(&tokens), Some(0.012));
        llm.answer(&app, &model, 200, Ok(&tokens), None);
        llm.answer(&app, &ledger.model(None), 429, Err(None), None);
        llm.answer(&app, &model, 200, Err(Some(Reason::NoUsage)), Some(0.03));
        let text = metrics.render();
        for line in [
            r#"egress_llm_tokens_total{upstream="openai",app="billing",model="gpt-4o",type="input"} 20"#,
            r#"egress_llm_tokens_total{upstream="openai",app="billing",model="gpt-4o",type="reasoning"} 2"#,
            r#"egress_llm_requests_total{upstream="openai",app="billing",model="gpt-4o",status="200"} 3"#,
            r#"egress_llm_requests_total{upstream="openai",app="billing",model="unknown",status="429"} 1"#,
            r#"egress_llm_usage_unreadable_total{upstream="openai",reason="no_usage"} 1"#,
            r#"egress_llm_time_to_first_token_seconds_count{upstream="openai",model="gpt-4o"} 2"#,
        ] {
            assert!(text.contains(line), "{line} not in\n{text}");
        }
        assert!(
            !text.contains(r#"egress_llm_tokens_total{upstream="openai",app="billing",model="unknown""#),
            "no token series for answers without usage:\n{text}"
        );
        let usage = metrics.usage();
        let row = usage.since_start.iter().find(|r| &*r.model == "gpt-4o").unwrap();
        assert_eq!((row.counts.requests, row.counts.input_tokens), (3, 20));
    }
}
