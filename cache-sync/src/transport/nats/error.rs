//! How the client's errors become cache-sync's [`Error`]: one rule for
//! every call, kept in one place because whether a node retries (a
//! disconnect) or not (the server answered with an error) depends on it.

use super::{KIND, NatsJetStreamTransport};
use crate::error::Error;

impl NatsJetStreamTransport {
    /// An error, classified by whether the client is connected at all: a
    /// server that answers with an error is not a disconnect.
    pub(super) fn err(&self, e: impl std::error::Error + Send + Sync + 'static) -> Error {
        match self.client.connection_state() {
            async_nats::connection::State::Connected => Error::Transport {
                transport: KIND,
                source: Box::new(e),
            },
            _ => Error::disconnected(KIND, e),
        }
    }
}
