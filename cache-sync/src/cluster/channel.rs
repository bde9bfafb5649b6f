//! The heartbeat channel as the node and the acknowledgement waits use it:
//! reading a message off it, sending messages and answers (best effort,
//! counted), the reply channel, and whether the view can be trusted to
//! know every live node yet.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::handle::Inner;
use super::message::{self, Opened};
use super::{Ack, Cluster, Incomplete, Message, Probe, Request, ack};
use crate::util::{Backoff, lock};
use crate::wire::Codec;

/// What a node does something about, read off the heartbeat channel.
#[derive(Debug)]
pub(crate) enum Incoming {
    Request(Request),
    Probe(Probe),
}

/// How long a watcher gives the nodes to answer the roll call it sends as
/// it starts before it trusts its view to hold every live node (unless 1.5
/// heartbeat intervals are sooner): a node answers at once, so this covers
/// the transport's round trip with room to spare.
const ROLL_CALL_GRACE: Duration = Duration::from_millis(500);

/// Retries of the heartbeat and reply channels' subscriptions and sends:
/// 100 ms, doubling up to 5 s.
pub(crate) const CHANNEL_BACKOFF_MIN: Duration = Duration::from_millis(100);
pub(crate) const CHANNEL_BACKOFF_MAX: Duration = Duration::from_secs(5);

impl Cluster {
    /// Reads one message off the heartbeat channel: a heartbeat is taken
    /// in, an answer to one of this party's acknowledgement requests or
    /// probes too, a request or a probe is handed back. Answers for other parties are skipped on
    /// their first bytes, unread. Refused ones (unsigned or forged on a
    /// verifying party, oversized, unreadable) are counted and dropped.
    pub(crate) fn receive(&self, payload: &Bytes) -> Option<Incoming> {
        let stats = &self.inner.stats;
        stats.received.fetch_add(1, Relaxed);
        if Codec::ack_for(payload).is_some_and(|asker| asker != self.inner.asker) {
            // Not ours: nothing to verify or parse, and nothing changes.
            return None;
        }
        match message::open(&self.inner.codec, payload) {
            // Another topic's, replayed here (one keyring may sign several
            // topics): not this cluster's.
            Ok(Opened::Message(Message::Heartbeat(h))) if h.topic != self.inner.topic => {
                stats.rejected.fetch_add(1, Relaxed);
                None
            }
            Ok(Opened::Message(Message::Request(r))) if r.topic != self.inner.topic => {
                stats.rejected.fetch_add(1, Relaxed);
                None
            }
            Ok(Opened::Message(Message::Probe(p))) if p.topic != self.inner.topic => {
                stats.rejected.fetch_add(1, Relaxed);
                None
            }
            Ok(Opened::Ack { ack, .. }) if ack.topic != self.inner.topic => {
                stats.rejected.fetch_add(1, Relaxed);
                None
            }
            Ok(Opened::Message(Message::Heartbeat(h))) => {
                self.observe(h);
                None
            }
            Ok(Opened::Message(Message::Request(r))) => Some(Incoming::Request(r)),
            Ok(Opened::Message(Message::Probe(p))) => Some(Incoming::Probe(p)),
            Ok(Opened::Ack { ack, .. }) => {
                self.answered(&ack);
                None
            }
            Err(e) => {
                stats.rejected.fetch_add(1, Relaxed);
                tracing::debug!(observer = %self.inner.observer, error = %e,
                    "heartbeat channel: message refused");
                None
            }
        }
    }

    /// Names this party in its acknowledgement requests.
    pub(crate) fn asker(&self) -> u64 {
        self.inner.asker
    }

    /// Whether this party reads its reply channel now.
    pub(crate) fn reads_replies(&self) -> bool {
        self.inner.replies.load(Relaxed)
    }

    /// Starts reading this party's reply channel, until `stop` (a node's
    /// view; a watcher starts its own).
    pub(crate) fn read_replies(&self, stop: watch::Receiver<bool>) -> JoinHandle<()> {
        tokio::spawn(reply_loop(Arc::downgrade(&self.inner), stop))
    }

    pub(crate) fn waiters(&self) -> &ack::Waiters {
        &self.inner.waiters
    }

    /// Takes in a node's answer to this party's acknowledgement requests,
    /// waking the waits.
    pub(crate) fn answered(&self, ack: &Ack) {
        // Both, whatever the first says: one answer may carry both kinds.
        let probed = self.inner.probes.answered(ack);
        if self.inner.waiters.answered(ack) | probed {
            self.inner.updates.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Publishes an answer for the party `asker`, on its reply channel if
    /// it reads one (`reply`), else on the heartbeat channel; best effort,
    /// as `send`.
    pub(crate) async fn send_ack(&self, asker: u64, reply: bool, ack: &Ack) {
        let stats = &self.inner.stats;
        let transport = &self.inner.transport;
        let topic = &self.inner.topic;
        let sent = match message::seal_ack(&self.inner.codec, asker, ack) {
            Ok(payload) => {
                let payload = Bytes::from(payload);
                if reply {
                    match transport.publish_reply(topic, asker, payload.clone()).await {
                        // A transport of another kind than the asker's
                        // says it has none: the shared channel, then.
                        Err(e) if e.is_unsupported() => {
                            transport.publish_heartbeat(topic, payload).await
                        }
                        other => other,
                    }
                } else {
                    transport.publish_heartbeat(topic, payload).await
                }
            }
            Err(e) => Err(e),
        };
        match sent {
            Ok(()) => {
                stats.sent.fetch_add(1, Relaxed);
            }
            Err(e) => {
                stats.send_failures.fetch_add(1, Relaxed);
                tracing::debug!(observer = %self.inner.observer, error = %e,
                    "heartbeat channel: could not send an acknowledgement");
            }
        }
    }

    /// Publishes a message on the heartbeat channel; a failure is counted
    /// and logged, never returned: heartbeats are best effort.
    pub(crate) async fn send(&self, message: &Message) -> bool {
        let stats = &self.inner.stats;
        // The owning node answers its own view's requests directly.
        if let (Message::Request(r), Some(local)) = (message, &self.inner.local_request)
            && r.target.is_some()
        {
            local(r.clone());
        }
        let sent = match message::seal(&self.inner.codec, message) {
            Ok(payload) => self
                .inner
                .transport
                .publish_heartbeat(&self.inner.topic, Bytes::from(payload))
                .await
                .map_err(|e| (e, "publish")),
            Err(e) => Err((e, "encode")),
        };
        match sent {
            Ok(()) => {
                stats.sent.fetch_add(1, Relaxed);
                true
            }
            Err((e, what)) => {
                stats.send_failures.fetch_add(1, Relaxed);
                // A message too large to send will never go out: that is
                // a setting to fix, not a passing failure.
                if e.is_too_large() {
                    tracing::warn!(observer = %self.inner.observer, error = %e,
                        "heartbeat channel: message too large to send");
                } else {
                    tracing::debug!(observer = %self.inner.observer, error = %e, what,
                        "heartbeat channel: could not send");
                }
                false
            }
        }
    }

    /// A receiver that changes at every heartbeat taken in.
    pub(crate) fn updates(&self) -> watch::Receiver<u64> {
        self.inner.updates.subscribe()
    }

    /// The heartbeat interval this party expects of nodes.
    pub(crate) fn interval(&self) -> Duration {
        self.inner.interval
    }

    /// The heartbeat channel is read from now on; `roll_call` says whether
    /// a roll call went out with it.
    pub(crate) fn listening(&self, roll_call: bool) {
        *lock(&self.inner.listening) = Some((Instant::now(), roll_call));
    }

    /// The heartbeat channel is not read (its subscription broke).
    pub(crate) fn deaf(&self) {
        *lock(&self.inner.listening) = None;
    }

    /// When the view can be trusted to hold every live node: it has read
    /// the channel without a break for 1.5 heartbeat intervals, or, after a
    /// roll call went out (every node answers one at once), for
    /// `ROLL_CALL_GRACE` if that is sooner. `None` while the channel is
    /// not read: the view may miss anyone then.
    pub(crate) fn settled_at(&self) -> Option<Instant> {
        let (since, roll_call) = (*lock(&self.inner.listening))?;
        let half = self.inner.interval.checked_div(2).unwrap_or(Duration::ZERO);
        let mut wait = self.inner.interval.saturating_add(half);
        if roll_call {
            wait = wait.min(ROLL_CALL_GRACE);
        }
        Some(since.checked_add(wait).unwrap_or(since))
    }

    /// Why this view may be missing a live node now, or `None` once it
    /// can be trusted to hold every one: it reads the heartbeat channel
    /// ([`Incomplete::NotListening`] otherwise), is not full
    /// ([`Incomplete::ViewFull`]), and has read the channel for 1.5
    /// heartbeat intervals, or 500 ms after the roll call it sent, and
    /// holds at least as many live nodes as any node it heard counts in its
    /// own view ([`Incomplete::Settling`]). An acknowledged publish is
    /// complete only through a view that is settled; `cache-sync status`
    /// waits for one.
    pub fn unsettled(&self) -> Option<Incomplete> {
        match self.settled_at() {
            None => Some(Incomplete::NotListening),
            Some(_) if self.overflowing() => Some(Incomplete::ViewFull),
            Some(at) if Instant::now() < at => Some(Incomplete::Settling),
            Some(_) if self.missing_nodes() => Some(Incomplete::Settling),
            Some(_) => None,
        }
    }
}

/// Reads this party's reply channel, where nodes send the answers to its
/// acknowledgement requests and key probes (see
/// `Transport::publish_reply`), for as long
/// as the party lives: subscribes again after an error, with a backoff,
/// and says meanwhile that it does not read it, so requests ask for the
/// heartbeat channel instead. Ends at once on a transport without reply
/// channels.
async fn reply_loop(cluster: Weak<Inner>, mut stop: watch::Receiver<bool>) {
    let mut backoff = Backoff::new(super::CHANNEL_BACKOFF_MIN, super::CHANNEL_BACKOFF_MAX);
    loop {
        let Some(inner) = cluster.upgrade() else {
            return;
        };
        let (transport, topic, asker) = (inner.transport.clone(), inner.topic.clone(), inner.asker);
        drop(inner);
        // A broker that is down can take its timeout to answer: the stop
        // must not wait for that.
        let subscribed = tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            subscribed = transport.subscribe_replies(&topic, asker) => subscribed,
        };
        let mut sub = match subscribed {
            Ok(sub) => sub,
            Err(e) if e.is_unsupported() => return,
            Err(e) => {
                backoff.fail();
                tracing::debug!(error = %e, retry_in = ?backoff.wait(), "reply channel: subscribe failed");
                tokio::select! {
                    _ = stop.wait_for(|s| *s) => return,
                    () = tokio::time::sleep(backoff.wait()) => continue,
                }
            }
        };
        backoff.reset();
        set_replies(&cluster, true);
        loop {
            let next = tokio::select! {
                _ = stop.wait_for(|s| *s) => {
                    set_replies(&cluster, false);
                    return;
                }
                next = sub.next() => next,
            };
            let Some(inner) = cluster.upgrade() else {
                return;
            };
            match next {
                Ok(payload) => {
                    let _ = Cluster { inner }.receive(&payload);
                }
                Err(e) => {
                    inner.replies.store(false, Relaxed);
                    backoff.fail();
                    tracing::debug!(error = %e, retry_in = ?backoff.wait(),
                        "reply channel: subscription failed; subscribing again");
                    break;
                }
            }
        }
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            () = tokio::time::sleep(backoff.wait()) => {}
        }
    }
}

fn set_replies(cluster: &Weak<Inner>, on: bool) {
    if let Some(inner) = cluster.upgrade() {
        inner.replies.store(on, Relaxed);
    }
}
