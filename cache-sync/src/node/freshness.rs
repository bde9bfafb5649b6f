//! The node's freshness bound, proved on its own clock: a moment before
//! which every acknowledged publish on its topic has been applied.
//!
//! Every `freshness_interval` the node asks the transport for the topic's
//! tail ([`Transport::tail`](crate::transport::Transport::tail)), noting on
//! its monotonic clock when it asked. Once the position it has applied
//! covers that tail, everything acknowledged before the moment it asked is
//! applied: that moment is the node's bound. Its age is how stale the node
//! may be. Nothing else is compared: no clock of another machine, no
//! timestamp off the wire. The cost is one request to the broker per node
//! per interval; nothing every node must receive from every other.
//!
//! A node that lags keeps the tails it has not reached yet (at most
//! `MAX_TAILS_PENDING`, the newest replacing the last when full), so a node a
//! little behind proves a bound a little old, not none. A request
//! that fails or takes longer than an interval proves nothing, and the age
//! grows: a node cut off from its broker (by a partition, with no reset)
//! shows it as an age that keeps growing.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use super::shared::Shared;
use crate::error::Result;
use crate::transport::Position;
use crate::util::{Moment, lock};

/// Tails asked for and not reached yet, kept at most: a node this far
/// behind proves the oldest of them first, then the rest.
const MAX_TAILS_PENDING: usize = 64;

/// What the freshness task found, and how it is woken.
#[derive(Default)]
pub(super) struct Freshness {
    /// When the node asked for the newest tail it has reached; none
    /// before the first, or on a transport that cannot tell. The caches it
    /// holds keep a copy for their staleness bounds (see `reached`).
    pub(super) proof: Moment,
    /// Notified after every applied batch (and loss), so a pending tail is
    /// checked as soon as it may be reached.
    pub(super) applied: Notify,
}

impl Freshness {
    /// How long ago the node asked for the newest tail it has applied:
    /// every publish acknowledged before then is applied. `None` until the
    /// first is reached, or on a transport that cannot tell.
    pub(super) fn age(&self) -> Option<Duration> {
        self.proof.age()
    }

    /// Never back: an older tail reached late proves less.
    fn reached(&self, asked: Instant) {
        self.proof.advance(asked);
    }
}

/// A request for the tail in flight.
struct Asking {
    /// When it was asked: what it proves, once reached.
    asked: Instant,
    /// When it is given up.
    gives_up: Instant,
    request: Pin<Box<dyn Future<Output = Result<Option<Position>>> + Send>>,
}

/// Asks for the tail every `every`, and notes the newest one applied.
/// Ends at `stop`, or at once on a transport that cannot tell.
pub(super) async fn freshness_loop(
    shared: Arc<Shared>,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) {
    if every == Duration::MAX {
        return;
    }
    let mut pending: VecDeque<(Instant, Position)> = VecDeque::new();
    let mut asking: Option<Asking> = None;
    let mut next_ask = Instant::now();
    loop {
        if asking.is_none() && Instant::now() >= next_ask {
            let asked = Instant::now();
            let (transport, topic) = (shared.transport.clone(), shared.topic.clone());
            next_ask = crate::util::deadline_after(every);
            asking = Some(Asking {
                asked,
                // A request past an interval proves nothing: it is given
                // up, and the next one asked.
                gives_up: next_ask,
                request: Box::pin(async move { transport.tail(&topic).await }),
            });
        }
        // The newest tail reached proves its moment, and makes the older
        // ones moot (one from a history since replaced is never reached).
        let reached = (!pending.is_empty())
            .then(|| {
                let position = lock(&shared.position);
                pending
                    .iter()
                    .rposition(|(_, tail)| shared.transport.covers(&position, tail))
            })
            .flatten();
        if let Some(i) = reached {
            let asked = pending[i].0;
            pending.drain(..=i);
            shared.freshness.reached(asked);
            // Each cache keeps its own copy, so its readers load one
            // atomic and share no lock. After the position's lock: no
            // other lock is taken under it.
            for cache in shared.caches().values() {
                cache.proved(shared.token, asked);
            }
        }
        let gives_up = asking.as_ref().map(|a| a.gives_up);
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            () = shared.freshness.applied.notified(), if !pending.is_empty() => {}
            () = tokio::time::sleep_until(next_ask), if asking.is_none() => {}
            () = sleep_until_some(gives_up) => {
                asking = None;
                tracing::debug!(node = %shared.id, topic = %shared.topic,
                    "the topic's tail was not answered within the freshness interval");
            }
            answer = poll_asking(&mut asking) => {
                let asked = asking.take().map(|a| a.asked);
                match (answer, asked) {
                    (Ok(Some(tail)), Some(asked)) => {
                        if pending.len() >= MAX_TAILS_PENDING {
                            pending.pop_back();
                        }
                        pending.push_back((asked, tail));
                    }
                    // The transport cannot tell: no bound, and no more asking.
                    (Ok(None), _) => return,
                    (Err(e), _) => {
                        tracing::debug!(node = %shared.id, topic = %shared.topic, error = %e,
                            "asking for the topic's tail failed");
                    }
                    (Ok(Some(_)), None) => {}
                }
            }
        }
    }
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn poll_asking(asking: &mut Option<Asking>) -> Result<Option<Position>> {
    match asking {
        Some(a) => (&mut a.request).await,
        None => std::future::pending().await,
    }
}
