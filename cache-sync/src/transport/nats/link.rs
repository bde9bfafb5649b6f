//! The client's connection as subscriptions watch it. Apart because both
//! the connection's event callback (which moves it) and every subscription
//! (which ends when it changes) depend on it.

use tokio::sync::watch;

/// Whether the client is connected, and how many times it connected. Moved
/// by the client's events; subscriptions end on any change, so a node shows
/// a dropped connection at once and resumes afresh after a reconnect.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Link {
    pub(super) connects: u64,
    pub(super) up: bool,
}

/// Resolves once the connection drops, or a new one replaces the one the
/// subscription began on. The client reports its first connection with
/// an event that may arrive after the subscription began; that one counts
/// as the same connection.
pub(super) async fn link_lost(link: &mut watch::Receiver<Link>, connects: u64) -> &'static str {
    loop {
        if link.changed().await.is_err() {
            return "the client was dropped";
        }
        let now = *link.borrow_and_update();
        if !now.up {
            return "disconnected from the server";
        }
        if now.connects > connects {
            return "reconnected; the consumer starts afresh";
        }
    }
}
