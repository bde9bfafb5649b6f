//! A publish handed over to the transport, awaiting the broker's
//! acknowledgement.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use super::Position;
use crate::error::Result;

/// A publish already handed over to the transport (see
/// [`Transport::start_publish`](super::Transport::start_publish)): a
/// future that completes with the broker's answer, the record's position
/// where the transport knows it.
pub struct PendingPublish(Pending);

enum Pending {
    /// Answered already: no future to box (`None` once taken).
    Ready(Option<Result<Option<Position>>>),
    Waiting(Pin<Box<dyn Future<Output = Result<Option<Position>>> + Send + 'static>>),
}

impl PendingPublish {
    /// An acknowledgement still to come, from `ack`.
    pub fn new(ack: impl Future<Output = Result<Option<Position>>> + Send + 'static) -> Self {
        Self(Pending::Waiting(Box::pin(ack)))
    }

    /// An acknowledgement already in: what a transport that cannot
    /// pipeline returns once its whole publish is done.
    pub fn ready(published: Result<Option<Position>>) -> Self {
        Self(Pending::Ready(Some(published)))
    }
}

impl Future for PendingPublish {
    type Output = Result<Option<Position>>;

    fn poll(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        match &mut self.get_mut().0 {
            Pending::Ready(published) => std::task::Poll::Ready(
                published
                    .take()
                    .expect("a PendingPublish polled after it completed"),
            ),
            Pending::Waiting(ack) => ack.as_mut().poll(cx),
        }
    }
}

impl fmt::Debug for PendingPublish {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            Pending::Ready(_) => "PendingPublish(ready)",
            Pending::Waiting(_) => "PendingPublish(waiting)",
        })
    }
}
