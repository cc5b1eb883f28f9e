//! What LLM answers spent, by upstream, app and model, since start and over the last minute
//! (`/debug/usage`), and the bounded sets of app and model names that label them.
//!
//! Label values come from outside (a request header, an answer's body), so they are capped: the
//! first [`MAX_APPS`] apps and [`MAX_MODELS`] models seen keep their names, later ones are
//! `other`, in the metrics and here alike. The minute is kept per row as one bucket per second
//! that had answers, at most 60, so a quiet row costs nothing and a busy one a fixed amount.

use std::collections::{HashMap, VecDeque};
use std::num::NonZeroU16;

use rustc_hash::FxHashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::Serialize;

use super::Tokens;

/// Distinct apps labelled; later ones are `other`.
pub const MAX_APPS: usize = 64;
/// Distinct models labelled; later ones are `other`.
pub const MAX_MODELS: usize = 256;
/// The label of what is past a cap.
pub const OTHER: &str = "other";
/// The app of a request nothing names, and the model of an answer that names none.
pub const UNKNOWN: &str = "unknown";
/// The longest app name kept; a longer one is cut (at a character boundary).
pub const APP_MAX: usize = 64;
/// The recent window, in seconds.
const RECENT_SECS: u64 = 60;

/// Answers and tokens, as one row counts them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// Answers counted.
    pub requests: u64,
    /// `Tokens::input`.
    pub input_tokens: u64,
    /// `Tokens::output`.
    pub output_tokens: u64,
    /// `Tokens::cache_read`.
    pub cache_read_tokens: u64,
    /// `Tokens::cache_write`.
    pub cache_write_tokens: u64,
    /// `Tokens::reasoning`.
    pub reasoning_tokens: u64,
}

impl Counts {
    /// Adds `other`, saturating: an upstream's counts come from outside.
    fn add(&mut self, other: &Counts) {
        self.requests = self.requests.saturating_add(other.requests);
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
        self.cache_read_tokens = self.cache_read_tokens.saturating_add(other.cache_read_tokens);
        self.cache_write_tokens = self.cache_write_tokens.saturating_add(other.cache_write_tokens);
        self.reasoning_tokens = self.reasoning_tokens.saturating_add(other.reasoning_tokens);
    }

    fn of(tokens: Option<&Tokens>) -> Counts {
        let t = tokens.copied().unwrap_or_default();
        Counts {
            requests: 1,
            input_tokens: t.input,
            output_tokens: t.output,
            cache_read_tokens: t.cache_read,
            cache_write_tokens: t.cache_write,
            reasoning_tokens: t.reasoning,
        }
    }
}

/// One row of `/debug/usage`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Row {
    /// The upstream's label.
    #[serde(serialize_with = "text")]
    pub upstream: Arc<str>,
    /// Who spent it.
    #[serde(serialize_with = "text")]
    pub app: Arc<str>,
    /// The model.
    #[serde(serialize_with = "text")]
    pub model: Arc<str>,
    /// What was spent.
    #[serde(flatten)]
    pub counts: Counts,
}

fn text<S: serde::Serializer>(label: &Arc<str>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(label)
}

/// `/debug/usage`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// Since the sidecar started.
    pub since_start: Vec<Row>,
    /// Over the last 60 seconds.
    pub last_60s: Vec<Row>,
}

type RowKey = (Arc<str>, Arc<str>, Arc<str>);

/// One row's counts: what `/debug/usage` shows of an upstream, app and model. Held by whoever
/// counts into it (`metrics::LlmMetrics`), so an answer is counted without a lookup.
#[derive(Debug)]
pub struct Entry {
    start: Instant,
    counts: Mutex<Counted>,
}

#[derive(Debug, Default)]
struct Counted {
    total: Counts,
    /// (second since the ledger's start, what it counted), oldest first.
    recent: VecDeque<(u64, Counts)>,
}

impl Entry {
    /// Counts one answer, which spent `tokens` (`None`: its usage was not read).
    pub fn record(&self, tokens: Option<&Tokens>) {
        let second = self.start.elapsed().as_secs();
        self.record_at(second, tokens);
    }

    fn record_at(&self, second: u64, tokens: Option<&Tokens>) {
        let counts = Counts::of(tokens);
        let mut entry = lock(&self.counts);
        entry.total.add(&counts);
        match entry.recent.back_mut() {
            Some((at, bucket)) if *at == second => bucket.add(&counts),
            _ => entry.recent.push_back((second, counts)),
        }
        while entry
            .recent
            .front()
            .is_some_and(|(at, _)| *at + RECENT_SECS <= second)
        {
            entry.recent.pop_front();
        }
    }
}

/// A label given out by [`Ledger::app_id`] or [`Ledger::model_id`]: its index among the labels
/// plus one (the first is `other`), in two bytes with `Option`'s tag, for what a request
/// carries to its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LabelId(NonZeroU16);

/// `other`.
const OTHER_ID: LabelId = LabelId(NonZeroU16::MIN);

/// Names given labels so far, up to a cap; label 0 is `other`.
#[derive(Debug)]
struct Names {
    cap: usize,
    /// Fx, not SipHash: at most a few hundred names, so chosen collisions cost little.
    ids: FxHashMap<Box<str>, LabelId>,
    labels: Vec<Arc<str>>,
}

impl Names {
    fn new(cap: usize, other: &Arc<str>) -> Self {
        Names {
            cap,
            ids: FxHashMap::default(),
            labels: vec![other.clone()],
        }
    }

    fn id(&mut self, name: &str) -> LabelId {
        if let Some(id) = self.ids.get(name) {
            return *id;
        }
        let next = u16::try_from(self.labels.len() + 1)
            .ok()
            .and_then(NonZeroU16::new)
            .filter(|_| self.ids.len() < self.cap);
        let Some(next) = next else {
            return OTHER_ID;
        };
        self.labels.push(name.into());
        self.ids.insert(name.into(), LabelId(next));
        LabelId(next)
    }

    fn label(&self, id: LabelId) -> Arc<str> {
        let index = usize::from(id.0.get() - 1);
        self.labels.get(index).unwrap_or(&self.labels[0]).clone()
    }
}

/// The app and model labels, and the usage table behind `/debug/usage`.
#[derive(Debug)]
pub struct Ledger {
    start: Instant,
    apps: Mutex<Names>,
    models: Mutex<Names>,
    rows: Mutex<HashMap<RowKey, Arc<Entry>>>,
    unknown: Arc<str>,
}

impl Default for Ledger {
    fn default() -> Self {
        let other: Arc<str> = OTHER.into();
        Ledger {
            start: Instant::now(),
            apps: Mutex::new(Names::new(MAX_APPS, &other)),
            models: Mutex::new(Names::new(MAX_MODELS, &other)),
            rows: Mutex::default(),
            unknown: UNKNOWN.into(),
        }
    }
}

impl Ledger {
    /// The label of the app named `name` (cut to [`APP_MAX`] bytes): its name while fewer
    /// than [`MAX_APPS`] were seen, else `other`; `unknown` for an empty name.
    pub fn app(&self, name: &str) -> Arc<str> {
        match self.app_id(name) {
            Some(id) => lock(&self.apps).label(id),
            None => self.unknown.clone(),
        }
    }

    /// [`Ledger::app`] as an id; `None` for an empty name (`unknown`).
    pub fn app_id(&self, name: &str) -> Option<LabelId> {
        let name = app_name(name);
        (!name.is_empty()).then(|| lock(&self.apps).id(name))
    }

    /// The label of an app id.
    pub fn app_label(&self, id: LabelId) -> Arc<str> {
        lock(&self.apps).label(id)
    }

    /// The label of the model named `name`, capped as [`Ledger::app`] is; `unknown` for none.
    pub fn model(&self, name: Option<&str>) -> Arc<str> {
        match name {
            None => self.unknown.clone(),
            Some(name) => {
                let mut models = lock(&self.models);
                let id = models.id(name);
                models.label(id)
            }
        }
    }

    /// [`Ledger::model`] as an id.
    pub fn model_id(&self, name: &str) -> LabelId {
        lock(&self.models).id(name)
    }

    /// The label of a model id.
    pub fn model_label(&self, id: LabelId) -> Arc<str> {
        lock(&self.models).label(id)
    }

    /// `unknown`.
    pub fn unknown(&self) -> Arc<str> {
        self.unknown.clone()
    }

    /// The row of `upstream`, `app` and `model`, made when new.
    pub fn row(&self, upstream: &Arc<str>, app: &Arc<str>, model: &Arc<str>) -> Arc<Entry> {
        let mut rows = lock(&self.rows);
        rows.entry((upstream.clone(), app.clone(), model.clone()))
            .or_insert_with(|| {
                Arc::new(Entry {
                    start: self.start,
                    counts: Mutex::default(),
                })
            })
            .clone()
    }

    /// What was spent since start and over the last 60 s, rows sorted by upstream, app, model.
    pub fn report(&self) -> Report {
        self.report_at(self.second(Instant::now()))
    }

    fn report_at(&self, second: u64) -> Report {
        let rows = lock(&self.rows);
        let mut since_start = Vec::with_capacity(rows.len());
        let mut last_60s = Vec::new();
        for ((upstream, app, model), entry) in rows.iter() {
            let entry = lock(&entry.counts);
            let row = |counts| Row {
                upstream: upstream.clone(),
                app: app.clone(),
                model: model.clone(),
                counts,
            };
            since_start.push(row(entry.total));
            let mut recent = Counts::default();
            for (_, bucket) in entry.recent.iter().filter(|(at, _)| at + RECENT_SECS > second) {
                recent.add(bucket);
            }
            if recent.requests > 0 {
                last_60s.push(row(recent));
            }
        }
        let order = |a: &Row, b: &Row| (&a.upstream, &a.app, &a.model).cmp(&(&b.upstream, &b.app, &b.model));
        since_start.sort_by(order);
        last_60s.sort_by(order);
        Report {
            since_start,
            last_60s,
        }
    }

    fn second(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.start).as_secs()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// An app's name as every count takes it: trimmed, cut to [`APP_MAX`] bytes (empty: none).
pub fn app_name(name: &str) -> &str {
    cut(name.trim(), APP_MAX)
}

/// `name` cut to at most `max` bytes, at a character boundary.
fn cut(name: &str, max: usize) -> &str {
    if name.len() <= max {
        return name;
    }
    let mut end = max;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(input: u64, output: u64) -> Tokens {
        Tokens {
            input,
            output,
            cache_read: 1,
            cache_write: 2,
            reasoning: 3,
        }
    }

    #[test]
    fn apps_and_models_past_their_caps_are_other() {
        let ledger = Ledger::default();
        for i in 0..100 {
            let label = ledger.app(&format!("app-{i}"));
            assert_eq!(
                &*label,
                if i < MAX_APPS {
                    format!("app-{i}")
                } else {
                    OTHER.into()
                }
            );
        }
        // One seen before the cap keeps its name.
        assert_eq!(&*ledger.app("app-3"), "app-3");
        for i in 0..300 {
            let label = ledger.model(Some(&format!("m-{i}")));
            assert_eq!(
                &*label,
                if i < MAX_MODELS {
                    format!("m-{i}")
                } else {
                    OTHER.into()
                }
            );
        }
        assert_eq!(&*ledger.model(None), UNKNOWN);
        assert_eq!(&*ledger.app("  "), UNKNOWN);
        let id = ledger.app_id("app-7").unwrap();
        assert_eq!(&*ledger.app_label(id), "app-7");
        assert_eq!(ledger.app_id("app-99"), Some(OTHER_ID));
        assert_eq!(&*ledger.app_label(OTHER_ID), OTHER);
        assert_eq!(ledger.app_id(""), None);
        assert_eq!(&*ledger.model_label(ledger.model_id("m-9")), "m-9");
        assert_eq!(Ledger::default().app(&"é".repeat(40)).len(), 64);
    }

    #[test]
    fn rows_add_up_since_start_and_forget_past_the_minute() {
        let ledger = Ledger::default();
        let (up, app, model) = (ledger.unknown(), ledger.app("a"), ledger.model(Some("m")));
        let row = ledger.row(&up, &app, &model);
        row.record_at(0, Some(&tokens(10, 5)));
        ledger.row(&up, &app, &model).record_at(0, Some(&tokens(1, 1)));
        row.record_at(30, None);
        let now = ledger.report_at(59);
        assert_eq!(now.since_start.len(), 1);
        let total = now.since_start[0].counts;
        assert_eq!(
            (total.requests, total.input_tokens, total.output_tokens),
            (3, 11, 6)
        );
        assert_eq!(
            (
                total.cache_read_tokens,
                total.cache_write_tokens,
                total.reasoning_tokens
            ),
            (2, 4, 6)
        );
        assert_eq!(now.last_60s[0].counts, total);
        // At 60 s the first second's answers left the minute; at 90 s all have.
        let later = ledger.report_at(60);
        assert_eq!(later.last_60s[0].counts.requests, 1);
        assert_eq!(later.since_start[0].counts, total);
        assert!(ledger.report_at(90).last_60s.is_empty());
    }

    #[test]
    fn a_busy_row_keeps_at_most_a_minute_of_buckets() {
        let ledger = Ledger::default();
        let (up, app, model) = (ledger.unknown(), ledger.app("a"), ledger.model(None));
        let row = ledger.row(&up, &app, &model);
        for second in 0..1000 {
            row.record_at(second, Some(&tokens(1, 1)));
        }
        assert_eq!(lock(&row.counts).recent.len(), 60);
        // Saturating, not wrapping: counts come from outside.
        row.record_at(1000, Some(&tokens(u64::MAX, 1)));
        assert_eq!(lock(&row.counts).total.input_tokens, u64::MAX);
    }

    #[test]
    fn the_report_is_the_json_the_readme_shows() {
        let ledger = Ledger::default();
        let up: Arc<str> = "openai".into();
        let row = ledger.row(&up, &ledger.app("chat"), &ledger.model(Some("gpt-4o")));
        row.record_at(0, Some(&tokens(7, 3)));
        let json = serde_json::to_value(ledger.report_at(0)).unwrap();
        assert_eq!(
            json["since_start"][0],
            serde_json::json!({
                "upstream": "openai", "app": "chat", "model": "gpt-4o", "requests": 1,
                "input_tokens": 7, "output_tokens": 3, "cache_read_tokens": 1,
                "cache_write_tokens": 2, "reasoning_tokens": 3
            })
        );
        assert_eq!(json["last_60s"], json["since_start"]);
    }
}
