//! Publishing: `PUBLISH`, or `SPUBLISH` on the slot's master through a
//! script; changes, heartbeats and replies alike, each to its channel.

use super::RedisPubSubTransport;
use crate::error::Result;
use crate::transport::redis::{PUBSUB, map_err};

/// `SPUBLISH` on the slot's master only (see `publish_to`). Sent whole with
/// `EVAL`, not by hash: `EVALSHA` meets `NOSCRIPT` on a master that never
/// saw it (a promoted replica), and the `redis` crate then loads the
/// script on every node of the cluster, which fails while one is down,
/// just when a failover happens. It is 49 bytes.
const SPUBLISH: &str = "return redis.call('SPUBLISH', KEYS[1], ARGV[1])";

impl RedisPubSubTransport {
    pub(super) async fn publish_to(&self, channel: String, payload: &[u8]) -> Result<()> {
        let mut conn = self.publisher.clone();
        if self.sharded.is_some() {
            // Through a script, not a bare `SPUBLISH`: a replica of the
            // slot's master takes `SPUBLISH` itself and passes it on over the
            // cluster bus, late, after what others published on the master
            // since (a publisher whose slot map still names the old master,
            // now a replica, would go on publishing there, and its events
            // would arrive out of step with everyone else's). A
            // replica answers a script with `MOVED`, so the publish lands on
            // the master and the client learns the new map.
            redis::cmd("EVAL")
                .arg(SPUBLISH)
                .arg(1)
                .arg(channel)
                .arg(payload)
                .query_async::<i64>(&mut conn)
                .await
        } else {
            redis::cmd("PUBLISH")
                .arg(channel)
                .arg(payload)
                .query_async::<i64>(&mut conn)
                .await
        }
        .map_err(|e| map_err(PUBSUB, e))?;
        Ok(())
    }
}
