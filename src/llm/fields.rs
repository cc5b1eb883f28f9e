//! The fields read, per provider: the paths a document's keys are matched against, the raw counts
//! they hold, and how those counts are normalised to one meaning each ([`Tokens`]).
//!
//! Not handled here: the JSON and SSE syntax around the fields (`json`, `sse`).

use super::{Model, Shapes, Tokens, MODEL_MAX};

/// A known object on a path from a document's root; only keys directly inside one are matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Node {
    /// The document's root object.
    Root,
    /// `message` (Anthropic's `message_start`).
    Message,
    /// `response` (OpenAI Responses API stream events).
    Response,
    /// `usage`, `message.usage` or `response.usage`.
    Usage,
    /// `U.prompt_tokens_details`.
    PromptDetails,
    /// `U.completion_tokens_details`.
    CompletionDetails,
    /// `U.input_tokens_details`.
    InputDetails,
    /// `U.output_tokens_details`.
    OutputDetails,
    /// Gemini's `usageMetadata`.
    UsageMetadata,
}

/// A raw count, as the provider names it; its index in [`Counts`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Slot {
    PromptTokens,
    CompletionTokens,
    PromptCached,
    CompletionReasoning,
    InputTokens,
    OutputTokens,
    InputCached,
    OutputReasoning,
    CacheCreation,
    CacheRead,
    PromptTokenCount,
    CandidatesTokenCount,
    CachedContentTokenCount,
    ThoughtsTokenCount,
}

const SLOTS: usize = Slot::ThoughtsTokenCount as usize + 1;

/// Counts that are input or output totals: at least one must be committed for a usage to be read
/// (a usage that has only details is not usage).
const PRIMARY: [Slot; 6] = [
    Slot::PromptTokens,
    Slot::CompletionTokens,
    Slot::InputTokens,
    Slot::OutputTokens,
    Slot::PromptTokenCount,
    Slot::CandidatesTokenCount,
];

/// What a key's value is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Target {
    /// An object whose keys are read in turn.
    Object(Node),
    /// A count.
    Count(Slot),
    /// The model; Gemini's `modelVersion` is preferred to a `model` in the same document.
    Model { preferred: bool },
}

const OPENAI: u8 = 1;
const ANTHROPIC: u8 = 2;
const GEMINI: u8 = 4;
const ALL: u8 = OPENAI | ANTHROPIC | GEMINI;

/// One key of a known object: the key, what its value is for, and the shapes that read it.
struct Key {
    parent: Node,
    name: &'static [u8],
    target: Target,
    shapes: u8,
}

const fn key(parent: Node, name: &'static [u8], target: Target, shapes: u8) -> Key {
    Key {
        parent,
        name,
        target,
        shapes,
    }
}

const _: () = assert!(
    KEYS.len() <= u32::BITS as usize,
    "a KeyMatch holds one bit per key"
);

/// Every key read; a key's index is its bit in a [`KeyMatch`]'s candidates.
static KEYS: [Key; 28] = {
    use Node::*;
    use Slot::*;
    use Target::{Count, Model as M, Object as O};
    const OA: u8 = OPENAI | ANTHROPIC;
    [
        key(Root, b"usage", O(Usage), OA),
        key(Root, b"message", O(Message), OA),
        key(Root, b"response", O(Response), OA),
        key(Root, b"model", M { preferred: false }, ALL),
        key(Root, b"modelVersion", M { preferred: true }, GEMINI),
        key(Root, b"usageMetadata", O(UsageMetadata), GEMINI),
        key(Message, b"usage", O(Usage), OA),
        key(Message, b"model", M { preferred: false }, ANTHROPIC),
        key(Response, b"usage", O(Usage), OA),
        key(Response, b"model", M { preferred: false }, OPENAI),
        key(Usage, b"prompt_tokens", Count(PromptTokens), OPENAI),
        key(Usage, b"completion_tokens", Count(CompletionTokens), OPENAI),
        key(Usage, b"prompt_tokens_details", O(PromptDetails), OPENAI),
        key(Usage, b"completion_tokens_details", O(CompletionDetails), OPENAI),
        key(Usage, b"input_tokens", Count(InputTokens), OA),
        key(Usage, b"output_tokens", Count(OutputTokens), OA),
        key(Usage, b"input_tokens_details", O(InputDetails), OPENAI),
        key(Usage, b"output_tokens_details", O(OutputDetails), OPENAI),
        key(
            Usage,
            b"cache_creation_input_tokens",
            Count(CacheCreation),
            ANTHROPIC,
        ),
        key(Usage, b"cache_read_input_tokens", Count(CacheRead), ANTHROPIC),
        key(PromptDetails, b"cached_tokens", Count(PromptCached), OPENAI),
        key(
            CompletionDetails,
            b"reasoning_tokens",
            Count(CompletionReasoning),
            OPENAI,
        ),
        key(InputDetails, b"cached_tokens", Count(InputCached), OPENAI),
        key(OutputDetails, b"reasoning_tokens", Count(OutputReasoning), OPENAI),
        key(
            UsageMetadata,
            b"promptTokenCount",
            Count(PromptTokenCount),
            GEMINI,
        ),
        key(
            UsageMetadata,
            b"candidatesTokenCount",
            Count(CandidatesTokenCount),
            GEMINI,
        ),
        key(
            UsageMetadata,
            b"cachedContentTokenCount",
            Count(CachedContentTokenCount),
            GEMINI,
        ),
        key(
            UsageMetadata,
            b"thoughtsTokenCount",
            Count(ThoughtsTokenCount),
            GEMINI,
        ),
    ]
};

const NODES: usize = Node::UsageMetadata as usize + 1;

/// Each `Shapes`' bits, in its declaration order: `shapes as usize` indexes them.
const SHAPE_BITS: [u8; 4] = [ALL, OPENAI, ANTHROPIC, GEMINI];

/// The keys of each object each `Shapes` reads (indexed as [`SHAPE_BITS`]), as bits of
/// [`KEYS`]: worked out once, not at every key.
static CANDIDATES: [[u32; 4]; NODES] = {
    let mut table = [[0; 4]; NODES];
    let shapes = SHAPE_BITS;
    let mut i = 0;
    while i < KEYS.len() {
        let key = &KEYS[i];
        let mut s = 0;
        while s < shapes.len() {
            if key.shapes & shapes[s] != 0 {
                table[key.parent as usize][s] |= 1 << i;
            }
            s += 1;
        }
        i += 1;
    }
    table
};

/// The longest key read.
const KEY_MAX: usize = {
    let mut max = 0;
    let mut i = 0;
    while i < KEYS.len() {
        if KEYS[i].name.len() > max {
            max = KEYS[i].name.len();
        }
        i += 1;
    }
    max
};

/// The keys of each length, as bits of [`KEYS`]: a key whose end is found is compared only
/// with the known keys of its length (usually none or one), not filtered byte by byte.
static LENGTHS: [u32; KEY_MAX + 1] = {
    let mut table = [0; KEY_MAX + 1];
    let mut i = 0;
    while i < KEYS.len() {
        table[KEYS[i].name.len()] |= 1 << i;
        i += 1;
    }
    table
};

/// A key being read against the keys `parent` has for the accepted shapes, without storing it:
/// the keys still possible and how far they matched. A key within one chunk is matched whole
/// when its end is found ([`KeyMatch::last`]); one cut by a chunk's end is matched part by part.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct KeyMatch {
    candidates: u32,
    at: u8,
}

impl KeyMatch {
    /// The start of a key inside `parent`.
    pub(super) fn new(parent: Node, shapes: Shapes) -> KeyMatch {
        KeyMatch {
            candidates: CANDIDATES[parent as usize][shapes as usize],
            at: 0,
        }
    }

    /// Whether a key can still match.
    pub(super) fn alive(&self) -> bool {
        self.candidates != 0
    }

    /// The key's next bytes, not its last (none a quote or a backslash: an escaped key matches
    /// nothing).
    pub(super) fn extend(&mut self, part: &[u8]) {
        let at = usize::from(self.at);
        let mut left = self.candidates;
        while left != 0 {
            let i = left.trailing_zeros() as usize;
            left &= left - 1;
            if KEYS[i].name.get(at..at + part.len()) != Some(part) {
                self.candidates &= !(1 << i);
            }
        }
        self.at = u8::try_from(at + part.len()).unwrap_or(u8::MAX);
    }

    /// The key's last bytes (before its closing quote; none a quote or a backslash): what the
    /// whole key's value is for.
    pub(super) fn last(&self, part: &[u8]) -> Option<Target> {
        let at = usize::from(self.at);
        let mut left = self.candidates & LENGTHS.get(at + part.len()).copied().unwrap_or(0);
        while left != 0 {
            let i = left.trailing_zeros() as usize;
            left &= left - 1;
            // As long as `part` (the length says): compared inline, not by a `memcmp` call.
            if KEYS[i].name[at..].iter().zip(part).all(|(a, b)| a == b) {
                return Some(KEYS[i].target);
            }
        }
        None
    }
}

/// Raw counts by [`Slot`]; `ABSENT` for one not given (a count is at most 2^53, so the
/// mark costs no bit of a value and no mask beside them).
#[derive(Debug, Clone, Copy)]
pub(super) struct Counts {
    values: [u64; SLOTS],
}

const ABSENT: u64 = u64::MAX;

impl Default for Counts {
    fn default() -> Counts {
        Counts {
            values: [ABSENT; SLOTS],
        }
    }
}

impl Counts {
    pub(super) fn set(&mut self, slot: Slot, value: u64) {
        self.values[slot as usize] = value;
    }

    fn get(&self, slot: Slot) -> u64 {
        match self.values[slot as usize] {
            ABSENT => 0,
            value => value,
        }
    }

    /// Every count `later` has replaces this one's: the last value of each field wins.
    pub(super) fn merge(&mut self, later: &Counts) {
        for (value, later) in self.values.iter_mut().zip(later.values) {
            if later != ABSENT {
                *value = later;
            }
        }
    }

    /// Whether an input or an output total is among them.
    pub(super) fn has_totals(&self) -> bool {
        PRIMARY.iter().any(|s| self.values[*s as usize] != ABSENT)
    }

    /// The counts with one meaning each. Each provider's fields are disjoint, so for one
    /// provider's body every sum below has a single term that is present (Anthropic's input is
    /// its three input fields, Gemini's output its candidates and thoughts, as each defines
    /// them); a body mixing shapes (only read with `Shapes::All`, and no provider sends one)
    /// gets the sum of what each shape says, saturating.
    pub(super) fn tokens(&self) -> Tokens {
        use Slot::*;
        let sum = |slots: &[Slot]| slots.iter().fold(0u64, |acc, s| acc.saturating_add(self.get(*s)));
        Tokens {
            input: sum(&[
                PromptTokens,
                InputTokens,
                CacheCreation,
                CacheRead,
                PromptTokenCount,
            ]),
            output: sum(&[
                CompletionTokens,
                OutputTokens,
                CandidatesTokenCount,
                ThoughtsTokenCount,
            ]),
            cache_read: sum(&[PromptCached, InputCached, CacheRead, CachedContentTokenCount]),
            cache_write: sum(&[CacheCreation]),
            reasoning: sum(&[CompletionReasoning, OutputReasoning, ThoughtsTokenCount]),
        }
    }
}

/// Which model string a document holds so far, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Held {
    None,
    Plain,
    Preferred,
}

/// What a response said: the fields of the documents that closed well-formed (committed), and of
/// the one being read (pending, dropped if it turns out malformed).
///
/// One buffer serves both for the model string being read and for the pending document's model:
/// that keeps the state small, at the cost that a document naming a model twice, the second
/// time with a name not taken (too long, escaped), loses the first (no provider does that).
#[derive(Debug, Clone, Copy)]
pub(super) struct Tally {
    committed: Counts,
    pending: Counts,
    model: Option<Model>,
    name: [u8; MODEL_MAX],
    name_len: u8,
    held: Held,
    /// A usage count of an accepted shape was seen (its key), committed or not.
    pub(super) shaped: bool,
}

impl Tally {
    pub(super) fn new() -> Tally {
        Tally {
            committed: Counts::default(),
            pending: Counts::default(),
            model: None,
            name: [0; MODEL_MAX],
            name_len: 0,
            held: Held::None,
            shaped: false,
        }
    }

    /// A document starts: nothing of it is pending.
    pub(super) fn begin(&mut self) {
        self.pending = Counts::default();
        self.held = Held::None;
    }

    /// The document closed well-formed: its fields replace those committed before.
    pub(super) fn commit(&mut self) {
        self.committed.merge(&self.pending);
        let name = &self.name[..usize::from(self.name_len)];
        // Most streams name the same model in every event: it is kept, not made again.
        if self.held != Held::None
            && self.model.is_none_or(|m| {
                usize::from(m.len) != name.len() || m.bytes.iter().zip(name).any(|(a, b)| a != b)
            })
        {
            self.model = Model::new(name);
        }
        self.begin();
    }

    pub(super) fn count(&mut self, slot: Slot, value: u64) {
        self.pending.set(slot, value);
    }

    /// Whether a model string at a key of this preference is to be read: a `model` is not
    /// read over a `modelVersion` the same document gave.
    pub(super) fn start_model(&mut self, preferred: bool) -> bool {
        if self.held == Held::Preferred && !preferred {
            return false;
        }
        self.held = Held::None;
        self.name_len = 0;
        true
    }

    /// The next bytes of the model string; false when it is not a model name (then nothing is
    /// held and the rest of the string is skipped).
    pub(super) fn model_bytes(&mut self, bytes: &[u8]) -> bool {
        let len = usize::from(self.name_len);
        let Some(to) = self.name.get_mut(len..len + bytes.len()) else {
            self.name_len = 0;
            return false;
        };
        if !bytes.iter().all(u8::is_ascii_graphic) {
            self.name_len = 0;
            return false;
        }
        to.copy_from_slice(bytes);
        self.name_len += bytes.len() as u8;
        true
    }

    /// The model string ended.
    pub(super) fn end_model(&mut self, preferred: bool) {
        if self.name_len > 0 {
            self.held = if preferred { Held::Preferred } else { Held::Plain };
        }
    }

    pub(super) fn model(&self) -> Option<Model> {
        self.model
    }

    pub(super) fn committed(&self) -> &Counts {
        &self.committed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_bits_follow_the_declaration_order() {
        assert_eq!(SHAPE_BITS[Shapes::All as usize], ALL);
        assert_eq!(SHAPE_BITS[Shapes::OpenAi as usize], OPENAI);
        assert_eq!(SHAPE_BITS[Shapes::Anthropic as usize], ANTHROPIC);
        assert_eq!(SHAPE_BITS[Shapes::Gemini as usize], GEMINI);
    }

    #[test]
    fn keys_are_unique_per_object() {
        for (i, a) in KEYS.iter().enumerate() {
            for b in &KEYS[i + 1..] {
                assert!(
                    a.parent != b.parent || a.name != b.name,
                    "{:?} {:?}",
                    a.parent,
                    std::str::from_utf8(a.name)
                );
            }
        }
    }

    #[test]
    fn keys_match_exactly() {
        let find = |parent, shapes, key: &[u8]| {
            let whole = KeyMatch::new(parent, shapes).last(key);
            // Cut by chunks at every place: the same key.
            for cut in 0..key.len() {
                let mut m = KeyMatch::new(parent, shapes);
                key[..cut].iter().for_each(|b| m.extend(&[*b]));
                assert_eq!(
                    m.last(&key[cut..]),
                    whole,
                    "{:?} cut at {cut}",
                    std::str::from_utf8(key)
                );
            }
            whole
        };
        assert_eq!(
            find(Node::Root, Shapes::All, b"usage"),
            Some(Target::Object(Node::Usage))
        );
        assert_eq!(find(Node::Root, Shapes::All, b"usag"), None);
        assert_eq!(find(Node::Root, Shapes::All, b"usages"), None);
        assert_eq!(find(Node::Root, Shapes::All, b"Usage"), None);
        assert_eq!(find(Node::Root, Shapes::Gemini, b"usage"), None);
        assert_eq!(
            find(Node::Usage, Shapes::Anthropic, b"cache_read_input_tokens"),
            Some(Target::Count(Slot::CacheRead))
        );
        assert_eq!(
            find(Node::Usage, Shapes::OpenAi, b"cache_read_input_tokens"),
            None
        );
        assert_eq!(
            find(Node::Usage, Shapes::OpenAi, b"prompt_tokens"),
            Some(Target::Count(Slot::PromptTokens))
        );
        assert_eq!(
            find(Node::Usage, Shapes::OpenAi, b"prompt_tokens_details"),
            Some(Target::Object(Node::PromptDetails))
        );
        let mut long = KeyMatch::new(Node::Usage, Shapes::All);
        (0..300).for_each(|_| long.extend(b"a"));
        assert!(!long.alive());
        assert_eq!(long.last(b"a"), None);
    }

    #[test]
    fn the_last_value_of_each_field_wins() {
        let mut tally = Tally::new();
        tally.count(Slot::InputTokens, 25);
        tally.count(Slot::OutputTokens, 1);
        tally.commit();
        for output in [5, 17, 42] {
            tally.count(Slot::OutputTokens, output);
            tally.commit();
        }
        let tokens = tally.committed().tokens();
        assert_eq!((tokens.input, tokens.output), (25, 42));
    }

    #[test]
    fn mixed_shapes_add_up() {
        let mut counts = Counts::default();
        counts.set(Slot::PromptTokens, 1 << 53);
        counts.set(Slot::PromptTokenCount, 5);
        counts.set(Slot::ThoughtsTokenCount, 3);
        counts.set(Slot::CandidatesTokenCount, 4);
        let tokens = counts.tokens();
        assert_eq!(tokens.input, (1 << 53) + 5);
        assert_eq!((tokens.output, tokens.reasoning), (7, 3));
        let mut details = Counts::default();
        details.set(Slot::PromptCached, 1);
        assert!(!details.has_totals());
    }
}
