//! The reader of one response body (stub: replaced by the incremental JSON scanner).

use super::{Framing, Outcome, Reason, Shapes};

/// Reads one response body's usage as it streams past, in bounded state.
#[derive(Debug)]
pub struct Reader {
    framing: Framing,
    shapes: Shapes,
}

impl Reader {
    /// A reader of a body framed as `framing`, taking `shapes`' fields.
    pub fn new(framing: Framing, shapes: Shapes) -> Reader {
        Reader { framing, shapes }
    }

    /// The next bytes of the body, in order.
    pub fn feed(&mut self, chunk: &[u8]) {
        let _ = (chunk, self.framing, self.shapes);
    }

    /// Documents ended so far: SSE events (whatever their data), or JSON documents.
    pub fn events(&self) -> u64 {
        0
    }

    /// Whether a usage field of an accepted shape has been seen.
    pub fn shaped(&self) -> bool {
        false
    }

    /// What the body said, once it ended (`complete`) or was cut.
    pub fn finish(&mut self, complete: bool) -> Outcome {
        let _ = complete;
        Outcome::Unreadable {
            reason: Reason::NoUsage,
            model: None,
        }
    }
}
