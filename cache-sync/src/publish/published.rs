//! What a publish call sent, and waiting for the nodes to apply it.

use std::sync::Arc;
use std::time::Duration;

use crate::cluster::{Acks, Cluster, Goal, Target};
use crate::transport::Position;

/// What a publish call sent.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Published {
    /// Events sent (0 for an empty batch; more than 1 when it was split).
    pub events: usize,
    /// The transport position of the last one, where the transport reports it.
    pub position: Option<Position>,
    /// The last event sent, for [`applied_by`](Self::applied_by).
    pub(super) last: Option<Sent>,
}

/// Which event a publish sent last: what nodes report once they apply it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Sent {
    pub(super) cache: Arc<str>,
    pub(super) publisher: u64,
    pub(super) seq: u64,
    /// When it was handed to the transport, on this process's clock:
    /// acknowledgement latencies count from here.
    pub(super) at: tokio::time::Instant,
}

impl Published {
    /// Asks every node that holds the cache to answer `cluster` once it
    /// has applied this publish, and waits until every live one did, or
    /// until `timeout`; then says which nodes did, with the time from the
    /// publish to each one's answer, and why not all if not
    /// ([`Acks::incomplete`]).
    ///
    /// A node answers once it has applied this publish's last event, or
    /// covered it (a node applies a publisher's numbers in order, or
    /// resyncs the cache when one is missing), judged from the publisher's
    /// sequence numbers the node tracks (up to 100 000 publishers per node),
    /// not from a short list of recent ones; events it has taken in but
    /// whose writes still wait for a pinned load do not count until they
    /// land. The live nodes are those `cluster` has heard from in their
    /// last three heartbeat intervals. A view that may not know every node
    /// (a node's own younger than 1.5 heartbeat intervals; a watcher that
    /// has given the nodes less than 500 ms to answer the roll call it sent
    /// as it started; a view holding fewer live nodes than a node it heard
    /// counts in its own; a view that is not reading the heartbeat channel; a
    /// view full to its member or byte bound, or that dropped a node's
    /// heartbeat for lack of room lately) never calls it complete, and says
    /// so. An empty publish (no event) resolves at once, with no node.
    ///
    /// ```no_run
    /// # async fn run(publisher: cache_sync::Publisher, cluster: cache_sync::cluster::Cluster) -> cache_sync::Result<()> {
    /// use std::time::Duration;
    /// let published = publisher.invalidate("countries", ["de"]).await?;
    /// let acks = published.applied_by(&cluster, Duration::from_secs(5)).await;
    /// println!("{acks}"); // applied on 3/3 nodes in 2 ms
    /// # Ok(()) }
    /// ```
    pub async fn applied_by(&self, cluster: &Cluster, timeout: Duration) -> Acks {
        let Some(last) = &self.last else {
            return Acks::none();
        };
        let goal = Goal {
            target: Target::Seq {
                publisher: last.publisher,
                seq: last.seq,
            },
            since: Some(last.at),
        };
        crate::cluster::wait(cluster, &last.cache, goal, timeout).await
    }
}
