//! The cluster view: every node's last heartbeat, as any party on the topic
//! sees it, and what follows from it: who is live, who lags, who applied a
//! publish.
//!
//! A [`Cluster`] watches the view without being a node (`Node::cluster`
//! gives a node's own). [`ClusterView`] and the types under it are what
//! `GET /cache-sync/cluster` serves; [`Acks`] is what
//! [`Published::applied_by`](crate::Published::applied_by) reports.
//!
//! Nodes publish heartbeats on their transport's heartbeat channel (see
//! [`Transport::publish_heartbeat`](crate::transport::Transport::publish_heartbeat)),
//! a resource apart from the change history. Nothing has to be configured:
//! whoever shares the topic sees the nodes.

// The parts: `heartbeat` (what a node sends), `message` (how it goes over
// the channel), `handle` (the `Cluster` handle and its builder),
// `membership` and `members` (taking heartbeats in, and what is kept of
// them), `channel` (sending and reading, as the node uses it), `watcher`
// (a watcher's task), `ack` (acknowledged publishes), `probe` (key
// probes), `requests` (the requests both wait on, and the wait) and
// `view` (the view as served).

mod ack;
mod channel;
mod handle;
mod heartbeat;
mod members;
mod membership;
mod message;
mod probe;
mod requests;
#[cfg(test)]
mod tests;
mod view;
mod watcher;

pub use ack::{Acks, Incomplete, NodeAck};
pub(crate) use ack::{Goal, wait};
pub(crate) use channel::Incoming;
pub(crate) use channel::{CHANNEL_BACKOFF_MAX, CHANNEL_BACKOFF_MIN};
pub use handle::{Cluster, ClusterBuilder};
pub use heartbeat::{CacheHeartbeat, Heartbeat};
pub(crate) use heartbeat::{DEFAULT_HEARTBEAT_INTERVAL, check_interval};
pub(crate) use message::{Ack, Message, Probe, Probed, Progress, Request, Target};
#[cfg(any(test, feature = "_fuzz"))]
pub(crate) use message::{
    Opened as OpenedMessage, open as open_message, seal as seal_message,
    seal_ack as seal_ack_message,
};
pub(crate) use probe::MAX_PROBE_KEY_BYTES;
pub use probe::{KeyProbe, NodeKey};
pub use view::{CacheSummary, ClusterView, GoneNode, NodeCacheView, NodeView};
