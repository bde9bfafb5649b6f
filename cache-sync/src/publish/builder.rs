//! Configuring a [`Publisher`].

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::Publisher;
use super::announce::MIN_ANNOUNCE_INTERVAL;
use crate::error::Result;
use crate::transport::Transport;
use crate::util::{MAX_TIMEOUT, check_duration};
use crate::wire::{Codec, Keyring, check_max_event_bytes};

/// Configures a [`Publisher`].
pub struct PublisherBuilder {
    pub(super) transport: Arc<dyn Transport>,
    pub(super) topic: String,
    pub(super) origin: String,
    pub(super) max_event_bytes: usize,
    pub(super) keyring: Option<Keyring>,
    pub(super) announce_interval: Duration,
    pub(super) again_after: Option<Duration>,
    pub(super) window: usize,
}

impl fmt::Debug for PublisherBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PublisherBuilder")
            .field("topic", &self.topic)
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

impl PublisherBuilder {
    /// The topic to publish to. Default `"cache-sync"`.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = topic.into();
        self
    }

    /// A name for this publisher in nodes' logs (a service or node name).
    pub fn origin(mut self, origin: impl Into<String>) -> Self {
        self.origin = origin.into();
        self
    }

    /// Largest event sent, signature included; larger batches are split.
    /// Keep it at or below the nodes' limit. Default 1 MiB; 1 byte to
    /// 64 MiB, and [`build`](Self::build) refuses anything else.
    pub fn max_event_bytes(mut self, n: usize) -> Self {
        self.max_event_bytes = n;
        self
    }

    /// Signs every event with the ring's primary key (HMAC-SHA256).
    pub fn signing(mut self, keyring: Keyring) -> Self {
        self.keyring = Some(keyring);
        self
    }

    /// How often the publisher announces, per cache it published to lately,
    /// the last sequence number it used (see [`Publisher`]). A node that
    /// missed the last events before a quiet period resyncs that cache
    /// within this interval plus its
    /// [reorder window](crate::NodeBuilder::reorder_window), plus the
    /// transport's latency, provided this process and the tokio runtime it
    /// published on keep running for one interval after the last publish
    /// (three, for the repeats), whether or not the `Publisher` is dropped
    /// meanwhile. Announcements are signed like events.
    ///
    /// Default 1 s; 10 ms to 1 h, or `Duration::MAX` for no announcements
    /// (and then no such bound: a lost last event is found at the next
    /// event, or by a transport's own loss detection).
    /// [`build`](Self::build) refuses anything else.
    pub fn announce_interval(mut self, every: Duration) -> Self {
        self.announce_interval = every;
        self
    }

    /// Sends every change a second time, `delay` after the first, as an
    /// invalidation of the keys it changed at the same versions (a clear as
    /// the same clear): the "delayed double delete" for nodes that load from
    /// a read replica.
    ///
    /// Why: a node that receives an invalidation before the replica it loads
    /// from has caught up reloads the old row and keeps it. The second
    /// invalidation, sent once the replica's lag has passed, removes that
    /// copy; the next read loads the new row. Set `delay` above the
    /// replica's worst lag. Loads that return the row's version
    /// ([`SyncedCache::get_with_versioned`](crate::SyncedCache::get_with_versioned))
    /// need no second invalidation for a versioned change: the old row's
    /// version is older than the tombstone, so it is not cached.
    ///
    /// The second send is an ordinary event with its own sequence number, so
    /// nodes detect its loss like any other. Its timer lives in this process,
    /// in one task per publisher that holds the publisher's state (a dropped
    /// publisher's second sends still go out) until none is pending: if the
    /// process or its tokio runtime stops first, the second send is lost.
    /// Until it is sent, each pending second send holds the keys (and
    /// versions) its change named, so memory grows with the rate of changes
    /// times `delay`. The database
    /// outbox's relay keeps its copy as a row instead, which survives a
    /// crash. A transport's own delayed delivery (RocketMQ's delay levels)
    /// is not used: the broker would hand the event over after later ones,
    /// and nodes would see its sequence number out of order, as a gap.
    ///
    /// Off by default; 1 ms to 1 h, and [`build`](Self::build) refuses
    /// anything else.
    pub fn again_after(mut self, delay: Duration) -> Self {
        self.again_after = Some(delay);
        self
    }

    /// How many events the publisher may have handed to the transport and
    /// not yet seen acknowledged, across all caches: the pipelining window
    /// (see [`start_publish`](crate::transport::Transport::start_publish)).
    /// A publish that finds it full waits for a place before it takes its
    /// sequence number. Each publish still returns only once its own events
    /// are acknowledged, so the window matters only to concurrent
    /// publishes (many tasks sharing one publisher, an outbox or CDC relay).
    /// On a transport that does not pipeline, one call is in flight at a
    /// time whatever the window.
    ///
    /// A transport's client may bound the calls in flight on its
    /// connection too (async-nats: 5000 JetStream acknowledgements), and a
    /// hand-over then waits for room there; keep the windows of the
    /// publishers sharing one transport within it.
    ///
    /// Default 64; 1 (one call at a time, as before pipelining) or more,
    /// and [`build`](Self::build) refuses 0. Beyond tokio's semaphore limit
    /// (`usize::MAX >> 3`) it is that limit: as good as unbounded.
    pub fn window(mut self, events: usize) -> Self {
        self.window = events;
        self
    }

    /// The publisher, once the transport has accepted the topic's name
    /// ([`check_topic`](crate::transport::Transport::check_topic)) and the
    /// settings are in range; otherwise [`Error::Config`](crate::Error::Config) naming the rule
    /// broken.
    pub fn build(self) -> Result<Publisher> {
        self.transport.check_topic(&self.topic)?;
        check_max_event_bytes(self.max_event_bytes)?;
        if let Some(delay) = self.again_after {
            check_duration("again_after", delay, Duration::from_millis(1), MAX_TIMEOUT)?;
        }
        if self.announce_interval != Duration::MAX {
            check_duration(
                "announce_interval (or Duration::MAX for none)",
                self.announce_interval,
                MIN_ANNOUNCE_INTERVAL,
                MAX_TIMEOUT,
            )?;
        }
        if self.window == 0 {
            return Err(crate::Error::Config(
                "window must be at least 1 (one publish in flight at a time)".into(),
            ));
        }
        let codec = Codec::new(self.max_event_bytes, self.keyring);
        Ok(Publisher::with_codec(
            self.transport,
            self.topic,
            self.origin,
            codec,
            self.announce_interval,
            self.again_after,
            self.window,
        ))
    }
}
