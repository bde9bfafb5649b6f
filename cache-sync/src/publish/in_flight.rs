//! The events of one publish handed over to the transport, each holding
//! its place in the window until its acknowledgement comes.

use super::{Published, Sent};
use crate::error::Result;
use crate::transport::{PendingPublish, Position};

/// An event handed over, waiting for its acknowledgement, holding its
/// place in the window until then.
pub(super) struct InFlight<'a> {
    pub(super) ack: PendingPublish,
    pub(super) sent: Sent,
    /// `None` where the transport does not pipeline.
    pub(super) _permit: Option<tokio::sync::SemaphorePermit<'a>>,
}

/// The events of one publish handed over so far, and how it went.
pub(super) struct HandedOver<'a> {
    /// The oldest in flight, where a publish of one event (the usual one)
    /// keeps it without allocating; the others follow in `rest`.
    first: Option<InFlight<'a>>,
    rest: std::collections::VecDeque<InFlight<'a>>,
    published: Published,
    /// The first failure seen (a hand-over that stopped the publish, or an
    /// acknowledgement): what the caller gets, whichever event it was.
    pub(super) error: Option<crate::Error>,
}

impl<'a> HandedOver<'a> {
    pub(super) fn push(&mut self, event: InFlight<'a>) {
        if self.first.is_none() && self.rest.is_empty() {
            self.first = Some(event);
        } else {
            self.rest.push_back(event);
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.first.is_none() && self.rest.is_empty()
    }

    /// Awaits the oldest acknowledgement; false if none is left.
    pub(super) async fn settle_one(&mut self) -> bool {
        let Some(event) = self.first.take().or_else(|| self.rest.pop_front()) else {
            return false;
        };
        let result = event.ack.await;
        self.record(result, event.sent);
        true
    }

    /// Counts an acknowledged event, or keeps its error if it is the first.
    pub(super) fn record(&mut self, result: Result<Option<Position>>, sent: Sent) {
        match result {
            Ok(position) if self.error.is_none() => {
                let published = &mut self.published;
                published.events = published.events.saturating_add(1);
                published.position = position.or(published.position.take());
                published.last = Some(sent);
            }
            Ok(_) => {}
            Err(e) => {
                self.error.get_or_insert(e);
            }
        }
    }

    /// Nothing handed over yet.
    pub(super) fn new() -> Self {
        Self {
            first: None,
            rest: std::collections::VecDeque::new(),
            published: Published {
                events: 0,
                position: None,
                last: None,
            },
            error: None,
        }
    }

    /// Awaits every acknowledgement (each frees its place in the window as
    /// it completes), then says how the publish went: its first failure.
    /// By reference, as `hand_over_locked` fills it: moving it in and out
    /// of the futures would copy it each time.
    pub(super) async fn settle(&mut self) -> Result<Published> {
        if !self.is_empty() {
            while self.settle_one().await {}
        }
        match self.error.take() {
            Some(e) => Err(e),
            None => Ok(std::mem::replace(
                &mut self.published,
                Published {
                    events: 0,
                    position: None,
                    last: None,
                },
            )),
        }
    }
}
