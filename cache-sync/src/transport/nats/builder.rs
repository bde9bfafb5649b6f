//! Configuring and connecting a [`NatsJetStreamTransport`]: the settings,
//! the checks `connect` makes before any I/O, and the connection whose
//! events feed the transport's [`Link`]. Apart from the transport itself,
//! which only reads the settings.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use tokio::sync::watch;

use super::naming::{MAX_STREAM_NAME, subject_char};
use super::{KIND, Link, NatsJetStreamTransport};
use crate::error::{Error, Result};
use crate::util::{MAX_TIMEOUT, check_at_least, check_duration};

#[derive(Debug, Clone)]
pub(super) struct NatsConfig {
    pub(super) max_messages: i64,
    pub(super) pull_expiry: Duration,
    ping_interval: Duration,
    request_timeout: Duration,
    pub(super) subject_prefix: String,
    pub(super) storage: stream::StorageType,
    pub(super) replicas: usize,
}

/// The most replicas JetStream keeps of a stream.
const MAX_REPLICAS: usize = 5;

/// Configures a [`NatsJetStreamTransport`].
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
#[derive(Debug, Clone)]
pub struct NatsJetStreamBuilder {
    /// One server, or several of a cluster: tried in turn.
    urls: Vec<String>,
    config: NatsConfig,
}

/// The shortest [`pull_expiry`](NatsJetStreamBuilder::pull_expiry) and
/// [`ping_interval`](NatsJetStreamBuilder::ping_interval): far below it the
/// client polls or pings continuously.
const MIN_INTERVAL: Duration = Duration::from_millis(100);

impl NatsJetStreamBuilder {
    /// Messages kept per topic. Default 100 000; at least 1, or
    /// [`connect`](Self::connect) refuses it.
    pub fn max_messages(mut self, n: i64) -> Self {
        self.config.max_messages = n;
        self
    }

    /// How long one pull request may wait on the server (long poll). The
    /// client's idle heartbeat follows it, and a dead consumer is recreated
    /// after two missed heartbeats, so this bounds how long a node stalls
    /// after a broker restart. Default 2 s; between 100 ms and an hour (the
    /// server refuses longer pull requests), or [`connect`](Self::connect)
    /// refuses it.
    pub fn pull_expiry(mut self, expiry: Duration) -> Self {
        self.config.pull_expiry = expiry;
        self
    }

    /// How often the client PINGs an idle server. Two unanswered PINGs
    /// count as a lost connection, so a server that stops answering (but
    /// keeps its socket open) shows as a disconnect, and `consuming: false`,
    /// within about twice this. A killed server shows at once. Default 5 s;
    /// between 100 ms and an hour, or [`connect`](Self::connect) refuses it.
    pub fn ping_interval(mut self, every: Duration) -> Self {
        self.config.ping_interval = every;
        self
    }

    /// How long a JetStream request waits for its answer: a publish's
    /// acknowledgement, a stream or consumer looked up or made. While a
    /// stream's leader is being elected, requests go unanswered and only a
    /// new one, sent after the election, is answered: the wait bounds how
    /// long a node takes to resume after its stream's leader failed (a
    /// publish meanwhile fails after it, and can be retried). Default 4 s
    /// (the client's own is 10 s); between 100 ms and an hour, or
    /// [`connect`](Self::connect) refuses it.
    pub fn request_timeout(mut self, wait: Duration) -> Self {
        self.config.request_timeout = wait;
        self
    }

    /// Subject prefix; the subject is `<prefix>.<topic>` and the stream is
    /// named after both. Default `"cache-sync"`. It must be a literal NATS
    /// subject (dot-separated tokens, no wildcards or whitespace), or
    /// [`connect`](Self::connect) fails.
    pub fn subject_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config.subject_prefix = prefix.into();
        self
    }

    /// Keep the stream in memory instead of on disk (lost on a server restart,
    /// which nodes then see as a history reset). Default: file storage.
    pub fn memory_storage(mut self) -> Self {
        self.config.storage = stream::StorageType::Memory;
        self
    }

    /// Copies JetStream keeps of each topic's stream, on as many servers of
    /// a cluster. Default 1; between 1 and 5, or
    /// [`connect`](Self::connect) refuses it. With 3, a publish is
    /// acknowledged once two servers hold it, and the stream lives on when
    /// its leader fails. Applied when the stream is made: a stream that
    /// exists keeps its own.
    pub fn replicas(mut self, n: usize) -> Self {
        self.config.replicas = n;
        self
    }

    /// Connects. The client reconnects by itself after a disconnect, to any
    /// server it was given or has learnt of from the cluster.
    ///
    /// A setting out of its range, or a subject prefix that is not a literal
    /// subject, is refused with [`Error::Config`] before anything is sent.
    pub async fn connect(self) -> Result<NatsJetStreamTransport> {
        self.check()?;
        let link = Arc::new(watch::Sender::new(Link::default()));
        let on_event = Arc::downgrade(&link);
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(2))
            .ping_interval(self.config.ping_interval)
            .retry_on_initial_connect()
            .max_reconnects(None)
            .event_callback(move |event| {
                let on_event = on_event.clone();
                async move {
                    let Some(tx) = on_event.upgrade() else { return };
                    match event {
                        async_nats::Event::Connected => tx.send_modify(|l| {
                            l.connects = l.connects.saturating_add(1);
                            l.up = true;
                        }),
                        async_nats::Event::Disconnected | async_nats::Event::Closed => {
                            tx.send_modify(|l| l.up = false);
                        }
                        _ => {}
                    }
                }
            })
            .connect(self.urls.as_slice())
            .await
            .map_err(|e| Error::disconnected(KIND, e))?;
        let mut js = jetstream::new(client.clone());
        js.set_timeout(self.config.request_timeout);
        Ok(NatsJetStreamTransport {
            js,
            client,
            config: self.config,
            link,
            known_streams: Arc::default(),
            handing: Arc::default(),
        })
    }

    /// Everything `connect` refuses, checked without touching the network.
    fn check(&self) -> Result<()> {
        let c = &self.config;
        if self.urls.is_empty() {
            return Err(Error::Config("nats-jetstream: no server URL".into()));
        }
        check_at_least("nats-jetstream max_messages", c.max_messages, 1)?;
        if !(1..=MAX_REPLICAS).contains(&c.replicas) {
            return Err(Error::Config(format!(
                "nats-jetstream replicas {}: between 1 and {MAX_REPLICAS}",
                c.replicas
            )));
        }
        check_duration(
            "nats-jetstream pull_expiry",
            c.pull_expiry,
            MIN_INTERVAL,
            MAX_TIMEOUT,
        )?;
        check_duration(
            "nats-jetstream ping_interval",
            c.ping_interval,
            MIN_INTERVAL,
            MAX_TIMEOUT,
        )?;
        check_duration(
            "nats-jetstream request_timeout",
            c.request_timeout,
            MIN_INTERVAL,
            MAX_TIMEOUT,
        )?;
        check_prefix(&c.subject_prefix)
    }
}

impl NatsJetStreamTransport {
    /// Configures a transport for the server at `url` (`nats://127.0.0.1:4222`),
    /// or for the servers of a cluster, comma-separated as NATS clients take
    /// them (`nats://127.0.0.1:4222,nats://127.0.0.1:4223`); with several,
    /// set [`replicas`](NatsJetStreamBuilder::replicas) too.
    pub fn builder(url: impl Into<String>) -> NatsJetStreamBuilder {
        let urls = url
            .into()
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
            .collect();
        NatsJetStreamBuilder {
            urls,
            config: NatsConfig {
                max_messages: 100_000,
                pull_expiry: Duration::from_secs(2),
                ping_interval: Duration::from_secs(5),
                request_timeout: Duration::from_secs(4),
                subject_prefix: "cache-sync".into(),
                storage: stream::StorageType::File,
                replicas: 1,
            },
        }
    }

    /// Connects with default settings.
    pub async fn connect(url: impl Into<String>) -> Result<Self> {
        Self::builder(url).connect().await
    }
}

/// The subject prefix is used as it is: it must be a literal subject.
fn check_prefix(prefix: &str) -> Result<()> {
    let literal = !prefix.is_empty()
        && prefix
            .split('.')
            .all(|token| !token.is_empty() && token.chars().all(subject_char));
    if literal && prefix.len() <= MAX_STREAM_NAME {
        return Ok(());
    }
    Err(Error::Config(format!(
        "NATS subject prefix {prefix:?} is not allowed: it must be a literal subject, dot-separated \
         tokens of printable ASCII without whitespace, '*', '>', '%' or '='"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nothing listens there: an attempt to connect would fail or hang.
    const NOWHERE: &str = "nats://127.0.0.1:1";

    /// `connect` fails at once with a config error naming the setting. The
    /// client retries its first connection in the background, so a
    /// connection attempt would instead give `Ok` (or hang).
    async fn assert_refused(builder: NatsJetStreamBuilder, setting: &str) {
        let connected = tokio::time::timeout(Duration::from_secs(5), builder.connect())
            .await
            .expect("refused at once, without connecting");
        let e = connected.expect_err(setting);
        assert!(e.is_config(), "{setting}: {e:?}");
        assert!(e.to_string().contains(setting), "{e}");
    }

    #[tokio::test]
    async fn connect_refuses_out_of_range_settings_before_any_io() {
        let builder = || NatsJetStreamTransport::builder(NOWHERE);
        for n in [0, -1, i64::MIN] {
            assert_refused(builder().max_messages(n), "max_messages").await;
        }
        let below = MIN_INTERVAL - Duration::from_nanos(1);
        let above = MAX_TIMEOUT + Duration::from_nanos(1);
        type Set = fn(NatsJetStreamBuilder, Duration) -> NatsJetStreamBuilder;
        let durations: [(&str, Set); 3] = [
            ("pull_expiry", NatsJetStreamBuilder::pull_expiry),
            ("ping_interval", NatsJetStreamBuilder::ping_interval),
            ("request_timeout", NatsJetStreamBuilder::request_timeout),
        ];
        for (setting, set) in durations {
            for d in [Duration::ZERO, below, above, Duration::MAX] {
                assert_refused(set(builder(), d), setting).await;
            }
        }
        for n in [0, MAX_REPLICAS + 1, usize::MAX] {
            assert_refused(builder().replicas(n), "replicas").await;
        }
        for url in ["", ",", " , "] {
            let refused = NatsJetStreamTransport::builder(url);
            assert_refused(refused, "no server URL").await;
        }
    }

    #[test]
    fn several_urls_are_a_cluster_s_servers() {
        let b = NatsJetStreamTransport::builder("nats://a:1, nats://b:2,,");
        assert_eq!(b.urls, ["nats://a:1", "nats://b:2"]);
    }

    #[test]
    fn the_ends_of_each_range_are_accepted() {
        for builder in [
            NatsJetStreamTransport::builder(NOWHERE),
            NatsJetStreamTransport::builder(NOWHERE)
                .max_messages(1)
                .replicas(1)
                .pull_expiry(MIN_INTERVAL)
                .ping_interval(MIN_INTERVAL)
                .request_timeout(MIN_INTERVAL),
            NatsJetStreamTransport::builder(NOWHERE)
                .max_messages(i64::MAX)
                .replicas(MAX_REPLICAS)
                .pull_expiry(MAX_TIMEOUT)
                .ping_interval(MAX_TIMEOUT)
                .request_timeout(MAX_TIMEOUT),
        ] {
            builder.check().unwrap();
        }
    }
}
