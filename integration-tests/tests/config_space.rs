//! The configuration space, sampled: random builder settings (capacities
//! 0 to 8, durations of 0, 1 ns, 1 ms, 100 ms, 1 h, 1 h and 1 ns, and
//! `Duration::MAX`, topic and cache
//! names from an alphabet of the characters brokers give meaning to) on
//! every transport in the suite. Each combination must either fail with an
//! error that says why, or work: the node starts, sees the event published
//! to it (or says it cannot), and shuts down. None may panic or hang.
//!
//! Transport settings have one rule: a value outside the range its builder
//! documents is refused with a config error ([`cache_sync::Error::is_config`])
//! when the transport is built or connects, and a value inside it never is.
//! Nothing is clamped, so each combination knows beforehand which of the
//! two it must get.

use std::sync::Arc;
use std::time::Duration;

use cache_sync::transport::Transport;
use cache_sync::{
    Node, Publisher, SyncedCache,
    transport::{
        EmbeddedTransport, NatsJetStreamTransport, RedisPubSubTransport, RedisStreamsTransport,
        RocketMqTransport,
    },
};
use integration_tests::nats_server::NatsServer;
use integration_tests::redis_server::RedisServer;
use integration_tests::rocketmq_server::RocketMqServer;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// The ranges the transport builders document.
const MS: Duration = Duration::from_millis(1);
const HOUR: Duration = Duration::from_secs(3600);
/// NATS's shortest pull expiry and ping interval.
const NATS_MIN_INTERVAL: Duration = Duration::from_millis(100);
/// The largest event size a publisher takes (64 MiB, as documented).
const MAX_EVENT_BYTES_CEILING: usize = 64 << 20;
/// Redis Pub/Sub's smallest backlog limit.
const MIN_BACKLOG_BYTES: usize = 64 << 10;
/// The capacity setting, 0 to 8, as a Pub/Sub backlog limit: 0, one byte
/// below the smallest limit, the smallest limit, then doubling from there.
fn backlog_bytes(capacity: usize) -> usize {
    match capacity.checked_sub(2) {
        None if capacity == 0 => 0,
        None => MIN_BACKLOG_BYTES - 1,
        Some(doublings) => MIN_BACKLOG_BYTES << doublings,
    }
}

fn in_range(d: Duration, min: Duration, max: Duration) -> bool {
    (min..=max).contains(&d)
}

/// How long one combination may take, start to shutdown, before it counts
/// as a hang.
const CASE_LIMIT: Duration = Duration::from_secs(60);

/// The edges, and often enough an ordinary value that whole combinations
/// get past validation: 100 ms and 1 h are in every transport's range (1 ms
/// is not in NATS's), and the others are outside every one of them.
fn duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        1 => Just(Duration::ZERO),
        1 => Just(Duration::from_nanos(1)),
        3 => Just(Duration::from_millis(1)),
        6 => Just(Duration::from_millis(100)),
        1 => Just(HOUR),
        1 => Just(HOUR + Duration::from_nanos(1)),
        2 => Just(Duration::MAX),
    ]
}

/// Names from the characters that mean something to some broker, plus
/// the empty name, a NUL, and one over the 255-byte limit.
fn name() -> impl Strategy<Value = String> {
    let alphabet = prop_oneof![
        3 => Just('a'),
        1 => Just('Z'),
        1 => Just('0'),
        1 => Just('.'),
        1 => Just('*'),
        1 => Just('>'),
        1 => Just(':'),
        1 => Just(' '),
        1 => Just('ü'),
        1 => Just('%'),
        1 => Just('='),
        1 => Just('|'),
        1 => Just('_'),
        1 => Just('-'),
        1 => Just('/'),
    ];
    prop_oneof![
        16 => proptest::collection::vec(alphabet, 1..8).prop_map(|cs| cs.into_iter().collect()),
        1 => Just(String::new()),
        1 => Just("a\0b".to_owned()),
        1 => Just("x".repeat(300)),
        1 => Just("ü".repeat(127)),
        1 => Just("x".repeat(255)),
        1 => Just("cache-sync".to_owned()),
    ]
}

#[derive(Debug, Clone)]
struct Settings {
    topic: String,
    cache: String,
    max_batch: usize,
    max_event_bytes: usize,
    max_tracked_keys: usize,
    max_load_retries: u32,
    reorder_window: Duration,
    persist_interval: Duration,
    min_backoff: Duration,
    max_backoff: Duration,
    publisher_max_event_bytes: usize,
    freshness_interval: Duration,
    max_staleness: Duration,
    /// Transport settings: two durations and a capacity, used as each
    /// transport's builder takes them.
    t1: Duration,
    t2: Duration,
    capacity: usize,
}

/// Ordinary settings, every one valid.
fn sane() -> Settings {
    Settings {
        topic: "topic".into(),
        cache: "cache".into(),
        max_batch: 4,
        max_event_bytes: 1 << 20,
        max_tracked_keys: 8,
        max_load_retries: 3,
        reorder_window: Duration::from_millis(100),
        persist_interval: Duration::from_millis(100),
        min_backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(100),
        publisher_max_event_bytes: 1 << 20,
        freshness_interval: Duration::from_millis(100),
        max_staleness: Duration::from_secs(1),
        // In every transport's range: NATS takes nothing under 100 ms, and a
        // 1 s Redis response timeout does not run out on a loaded machine.
        t1: Duration::from_millis(100),
        t2: Duration::from_secs(1),
        capacity: 8,
    }
}

/// Half the time every setting is random; the other half one setting is
/// (any of them), the rest ordinary, so that each edge is also tried alone
/// and most combinations get past validation.
fn settings() -> impl Strategy<Value = Settings> {
    (random_settings(), any::<bool>(), 0usize..15).prop_map(|(random, one_edge, which)| {
        if !one_edge {
            return random;
        }
        let mut s = sane();
        match which {
            0 => s.topic = random.topic,
            1 => s.cache = random.cache,
            2 => s.max_batch = random.max_batch,
            3 => s.max_event_bytes = random.max_event_bytes,
            4 => s.max_tracked_keys = random.max_tracked_keys,
            5 => s.max_load_retries = random.max_load_retries,
            6 => s.reorder_window = random.reorder_window,
            7 => s.persist_interval = random.persist_interval,
            8 => (s.min_backoff, s.max_backoff) = (random.min_backoff, random.max_backoff),
            9 => s.publisher_max_event_bytes = random.publisher_max_event_bytes,
            10 => s.t1 = random.t1,
            11 => s.t2 = random.t2,
            12 => s.freshness_interval = random.freshness_interval,
            13 => s.max_staleness = random.max_staleness,
            _ => s.capacity = random.capacity,
        }
        s
    })
}

fn random_settings() -> impl Strategy<Value = Settings> {
    let bytes = prop_oneof![
        1 => 0usize..=8,
        3 => Just(256),
        3 => Just(1 << 20),
        1 => Just(usize::MAX),
    ];
    let batch = prop_oneof![1 => Just(0usize), 8 => 1usize..=8];
    // Mostly in order, so that both ends are exercised past validation.
    let backoff = prop_oneof![
        3 => (duration(), duration()).prop_map(|(a, b)| (a.min(b), a.max(b))),
        1 => (duration(), duration()),
    ];
    (
        (name(), name(), batch, bytes.clone(), 0usize..=8, 0u32..=8),
        (duration(), duration(), backoff, bytes),
        (duration(), duration(), 0usize..=8, duration(), duration()),
    )
        .prop_map(
            |(
                (topic, cache, max_batch, max_event_bytes, max_tracked_keys, max_load_retries),
                (
                    reorder_window,
                    persist_interval,
                    (min_backoff, max_backoff),
                    publisher_max_event_bytes,
                ),
                (t1, t2, capacity, freshness_interval, max_staleness),
            )| Settings {
                topic,
                cache,
                max_batch,
                max_event_bytes,
                max_tracked_keys,
                max_load_retries,
                reorder_window,
                persist_interval,
                min_backoff,
                max_backoff,
                publisher_max_event_bytes,
                freshness_interval,
                max_staleness,
                t1,
                t2,
                capacity,
            },
        )
}

/// Whether a node must start with these settings on any transport: each
/// in the range `docs/design.md` documents, and names every transport
/// takes as they are (letters and digits, short). Names with other
/// characters depend on the transport's own rules, so they are left out.
fn node_settings_valid(s: &Settings) -> bool {
    let plain =
        |n: &str| (1..=64).contains(&n.len()) && n.chars().all(|c| c.is_ascii_alphanumeric());
    plain(&s.topic)
        && plain(&s.cache)
        && s.max_batch >= 1
        && (1..=MAX_EVENT_BYTES_CEILING).contains(&s.max_event_bytes)
        && !s.persist_interval.is_zero()
        && MS <= s.min_backoff
        && s.min_backoff <= s.max_backoff
        && (s.freshness_interval == Duration::MAX
            || (Duration::from_millis(10)..=HOUR).contains(&s.freshness_interval))
}

/// What every transport refuses, whatever its own rules add.
fn name_is_bad(name: &str) -> bool {
    name.is_empty() || name.len() > 255 || name.chars().any(char::is_control)
}

/// How a combination turned out, when it kept the contract.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// Refused by validation: a config error (or, for the one event, "too
    /// large" under a tiny `max_event_bytes`), which says why.
    Refused,
    /// Valid settings, and the transport failed (not a validation error):
    /// the broker is not ready, or a tiny timeout ran out. Allowed only
    /// where the test says the settings explain it.
    Failed(String),
    /// Started, published, and the node saw the event or said why not.
    Worked,
}

/// Runs one combination on a transport made by `connect`; `Err` describes how it
/// failed the contract. `valid` says whether every transport setting is in
/// the range its builder documents, so whether `connect` must refuse them.
async fn one(
    settings: Settings,
    valid: impl FnOnce(&Settings) -> bool,
    connect: impl AsyncFnOnce(&Settings) -> cache_sync::Result<Arc<dyn Transport>>,
) -> Result<Outcome, String> {
    let valid = valid(&settings);
    let transport = match connect(&settings).await {
        Ok(_) if !valid => {
            return Err("a transport setting outside its range was accepted".into());
        }
        Ok(transport) => transport,
        Err(e) if e.is_config() && e.to_string().is_empty() => {
            return Err(format!("an error that says nothing: {e:?}"));
        }
        Err(e) if e.is_config() && valid => {
            return Err(format!("transport settings in range were refused: {e}"));
        }
        Err(e) if e.is_config() => return Ok(Outcome::Refused),
        Err(e) if !valid => {
            return Err(format!(
                "a transport setting outside its range gave another error than a config \
                 error (was the broker asked?): {e:?}"
            ));
        }
        Err(e) if !e.to_string().is_empty() => return Ok(Outcome::Failed(format!("connect: {e}"))),
        Err(e) => return Err(format!("an error that says nothing: {e:?}")),
    };
    let built = SyncedCache::builder(settings.cache.clone(), moka::future::Cache::new(16))
        .max_tracked_keys(settings.max_tracked_keys)
        .max_load_retries(settings.max_load_retries)
        .max_staleness(settings.max_staleness)
        .build();
    let cache: SyncedCache<String, String> = match built {
        Ok(_) if settings.max_tracked_keys == 0 => {
            return Err("a cache tracking 0 keys was accepted".into());
        }
        Ok(cache) => cache,
        Err(e) if settings.max_tracked_keys == 0 && e.is_config() => {
            return Ok(Outcome::Refused);
        }
        Err(e) => return Err(format!("valid cache settings refused: {e}")),
    };
    let started = Node::builder("config-space", transport.clone())
        .topic(settings.topic.clone())
        .max_batch(settings.max_batch)
        .max_event_bytes(settings.max_event_bytes)
        .reorder_window(settings.reorder_window)
        .persist_interval(settings.persist_interval)
        .reconnect_backoff(settings.min_backoff, settings.max_backoff)
        .freshness_interval(settings.freshness_interval)
        .register(&cache)
        .start()
        .await;
    let node = match started {
        Ok(node) => node,
        Err(e) => {
            if std::env::var_os("CONFIG_SPACE_VERBOSE").is_some() {
                eprintln!("refused: {e}");
            }
            if e.to_string().is_empty() {
                return Err(format!("an error that says nothing: {e:?}"));
            }
            if e.is_config() && node_settings_valid(&settings) {
                return Err(format!("node settings in range were refused: {e}"));
            }
            return Ok(if e.is_config() {
                Outcome::Refused
            } else {
                Outcome::Failed(format!("node start: {e}"))
            });
        }
    };
    if name_is_bad(&settings.topic) || name_is_bad(&settings.cache) {
        return Err("a node started with a name no transport accepts".into());
    }
    let publisher_valid =
        (1..=MAX_EVENT_BYTES_CEILING).contains(&settings.publisher_max_event_bytes);
    let built = Publisher::builder(transport)
        .topic(settings.topic.clone())
        .max_event_bytes(settings.publisher_max_event_bytes)
        .build();
    let publisher = match built {
        Ok(_) if !publisher_valid => {
            return Err("a publisher's max_event_bytes outside its range was accepted".into());
        }
        Ok(publisher) => publisher,
        Err(e) if e.is_config() && !publisher_valid => {
            node.shutdown()
                .await
                .map_err(|e| format!("shutdown failed: {e}"))?;
            return Ok(Outcome::Refused);
        }
        Err(e) => {
            return Err(format!(
                "a publisher for the node's own topic was refused: {e}"
            ));
        }
    };
    let published = publisher.insert(&settings.cache, [("k", "v")]).await;
    let outcome = match &published {
        Ok(_) => Outcome::Worked,
        Err(e) if e.is_too_large() || e.is_config() => Outcome::Refused,
        Err(e) => Outcome::Failed(format!("publish: {e}")),
    };
    if published.is_ok() {
        // The node sees the event, or says why it cannot (a transport
        // error or a loss, counted); it never goes quiet while claiming
        // health.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let s = node.status();
            if s.events_received >= 1 || s.transport_errors >= 1 || s.losses >= 1 {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                return Err(format!(
                    "the node never saw the event nor reported why: {s:?}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    // A read under any bound answers, from memory or as a miss.
    let _ = cache.get("k").await;
    let s = node.status();
    if !s.consuming && s.transport_errors == 0 {
        return Err(format!(
            "the consumer stopped without an error (a panic?): {s:?}"
        ));
    }
    node.shutdown()
        .await
        .map_err(|e| format!("shutdown failed: {e}"))?;
    Ok(outcome)
}

/// Settings every transport must take and work with end to end: the
/// node-side edges, each alone.
fn valid_edges() -> Vec<(&'static str, Settings)> {
    let edge = |what, f: fn(&mut Settings)| {
        let mut s = sane();
        f(&mut s);
        (what, s)
    };
    vec![
        edge("max_batch 1", |s| s.max_batch = 1),
        edge("max_tracked_keys 1", |s| s.max_tracked_keys = 1),
        edge("max_load_retries 0", |s| s.max_load_retries = 0),
        edge("reorder_window 0", |s| s.reorder_window = Duration::ZERO),
        edge("reorder_window MAX", |s| s.reorder_window = Duration::MAX),
        edge("persist_interval MAX", |s| {
            s.persist_interval = Duration::MAX
        }),
        edge("backoff 1 ms to 1 ms", |s| {
            (s.min_backoff, s.max_backoff) = (MS, MS)
        }),
        // 2: Pub/Sub's backlog at its smallest, 64 KiB; the others' 2.
        edge("transport capacity at its smallest valid", |s| {
            s.capacity = 2
        }),
        edge("freshness_interval 10 ms", |s| {
            s.freshness_interval = Duration::from_millis(10)
        }),
        edge("freshness_interval MAX (none)", |s| {
            s.freshness_interval = Duration::MAX
        }),
        edge("max_staleness 0", |s| s.max_staleness = Duration::ZERO),
        edge("max_staleness MAX", |s| s.max_staleness = Duration::MAX),
        edge("max_event_bytes at the ceiling", |s| {
            s.max_event_bytes = MAX_EVENT_BYTES_CEILING;
            s.publisher_max_event_bytes = MAX_EVENT_BYTES_CEILING;
        }),
    ]
}

/// Settings every transport must refuse by validation.
fn invalid_edges() -> Vec<(&'static str, Settings)> {
    let edge = |what, f: fn(&mut Settings)| {
        let mut s = sane();
        f(&mut s);
        (what, s)
    };
    vec![
        edge("empty topic", |s| s.topic = String::new()),
        edge("empty cache name", |s| s.cache = String::new()),
        edge("a 256-byte topic", |s| s.topic = "t".repeat(256)),
        edge("a control character in the cache name", |s| {
            s.cache = "a\nb".into()
        }),
        edge("max_batch 0", |s| s.max_batch = 0),
        edge("max_tracked_keys 0", |s| s.max_tracked_keys = 0),
        edge("max_event_bytes 0", |s| s.max_event_bytes = 0),
        edge("max_event_bytes past the ceiling", |s| {
            s.max_event_bytes = MAX_EVENT_BYTES_CEILING + 1
        }),
        edge("publisher max_event_bytes usize::MAX", |s| {
            s.publisher_max_event_bytes = usize::MAX
        }),
        edge("backoff min above max", |s| {
            (s.min_backoff, s.max_backoff) = (HOUR, MS)
        }),
        edge("backoff min 0", |s| s.min_backoff = Duration::ZERO),
        edge("persist_interval 0", |s| {
            s.persist_interval = Duration::ZERO
        }),
        edge("transport capacity 0", |s| s.capacity = 0),
        edge("freshness_interval 0", |s| {
            s.freshness_interval = Duration::ZERO
        }),
        edge("freshness_interval 1 h + 1 ns", |s| {
            s.freshness_interval = HOUR + Duration::from_nanos(1)
        }),
    ]
}

/// Runs the fixed cases, then `cases` random combinations, each under
/// [`CASE_LIMIT`]. Coverage of each class is by construction, not by luck:
/// ordinary settings must work (on a `broker` transport retried while the
/// broker is still getting ready, up to a minute; the embedded one must
/// work at once), every valid edge must work, every invalid one
/// must be refused by validation. In the random ones a transport failure
/// (as opposed to a validation refusal) fails the test unless `may_fail`
/// says the settings explain it (a timeout of a few milliseconds).
fn explore<C>(cases: u32, broker: bool, may_fail: fn(&Settings) -> bool, connect: C)
where
    C: Fn(Settings) -> std::pin::Pin<Box<dyn Future<Output = Result<Outcome, String>> + Send>>,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let run = |s: Settings| -> Result<Outcome, String> {
        runtime.block_on(async {
            match tokio::time::timeout(CASE_LIMIT, tokio::spawn(connect(s))).await {
                Err(_) => Err("hung".to_owned()),
                Ok(Err(join)) => Err(format!("panicked: {join}")),
                Ok(Ok(outcome)) => outcome,
            }
        })
    };

    // The broker may still be getting ready: ordinary settings are
    // retried until they work, and every later failure is the settings'.
    let ready = std::time::Instant::now();
    loop {
        match run(sane()) {
            Ok(Outcome::Worked) => break,
            Ok(Outcome::Failed(e)) if broker && ready.elapsed() < Duration::from_secs(60) => {
                eprintln!("ordinary settings failed, the broker may not be ready: {e}");
                std::thread::sleep(Duration::from_millis(500));
            }
            other => panic!("ordinary settings did not work: {other:?}"),
        }
    }
    eprintln!("ordinary settings worked after {:?}", ready.elapsed());
    // A transport failure (never a refusal) is tried twice more on a
    // broker, for the edges and the random combinations alike: on a loaded
    // 2-core machine the RocketMQ client's start timed out on edges that have
    // nothing to do with connecting (`reorder_window 0`, valid; the
    // publisher's `max_event_bytes usize::MAX`, invalid, whose refusal comes
    // after the node has started), and a publish of ordinary settings timed
    // out (CI, beside a build). One that keeps failing fails the test, as
    // does an invalid edge that fails on the transport instead of being
    // refused.
    let run_again = |what: &str, settings: Settings| {
        let mut outcome = run(settings.clone());
        for _ in 0..2 {
            match &outcome {
                Ok(Outcome::Failed(e)) if broker => {
                    eprintln!("{what}: a transport failure, tried again: {e}");
                    outcome = run(settings.clone());
                }
                _ => break,
            }
        }
        outcome
    };
    for (what, settings) in valid_edges() {
        assert_eq!(
            run_again(what, settings),
            Ok(Outcome::Worked),
            "{what}: a valid edge must work"
        );
    }
    for (what, settings) in invalid_edges() {
        assert_eq!(
            run_again(what, settings),
            Ok(Outcome::Refused),
            "{what}: must be refused by validation"
        );
    }

    let counts = std::sync::Mutex::new([0u32; 3]);
    let mut runner = TestRunner::new(Config {
        cases,
        // A failing combination is printed whole; shrinking it against a
        // live broker would take longer than it helps.
        max_shrink_iters: 0,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&settings(), |s| {
            let explained = may_fail(&s);
            let described = format!("{s:?}");
            let outcome = if explained {
                run(s)
            } else {
                run_again(&described, s)
            };
            let slot = match outcome {
                Ok(Outcome::Worked) => 0,
                Ok(Outcome::Refused) => 1,
                Ok(Outcome::Failed(_)) if explained => 2,
                Ok(Outcome::Failed(e)) => {
                    return Err(TestCaseError::fail(format!(
                        "valid settings, and the transport failed where nothing in them explains it: {e}\n{described}"
                    )));
                }
                Err(broken) => return Err(TestCaseError::fail(broken)),
            };
            counts.lock().expect("counts")[slot] += 1;
            Ok(())
        })
        .expect("every combination is refused clearly, works, or fails for a reason its settings give");
    let [worked, refused, failed] = counts.into_inner().expect("counts");
    eprintln!(
        "random combinations: {worked} worked end to end, {refused} refused by validation, \
         {failed} failed on a timeout their settings made too short"
    );
}

/// A Redis client timeout this short may run out on a loaded machine.
fn short_redis_timeout(s: &Settings) -> bool {
    // The strategy's 1 ms and 100 ms.
    s.t1 <= Duration::from_millis(100) || s.t2 <= Duration::from_millis(100)
}

fn never(_: &Settings) -> bool {
    false
}

#[test]
fn embedded() {
    explore(256, false, never, |s| {
        Box::pin(one(
            s,
            |s: &Settings| s.capacity >= 1,
            async |s: &Settings| {
                let transport = EmbeddedTransport::builder()
                    .max_records(s.capacity)
                    .max_bytes(s.capacity)
                    .build()?;
                Ok(Arc::new(transport) as Arc<dyn Transport>)
            },
        ))
    });
}

#[test]
fn redis_streams() {
    let server = RedisServer::start();
    let url = server.url();
    explore(64, true, short_redis_timeout, move |s| {
        let url = url.clone();
        Box::pin(one(
            s,
            |s: &Settings| in_range(s.t1, MS, HOUR) && in_range(s.t2, MS, HOUR) && s.capacity >= 1,
            async move |s: &Settings| {
                let transport = RedisStreamsTransport::builder(url)
                    .block(s.t1)
                    .response_timeout(s.t2)
                    .max_len(s.capacity)
                    .connect()
                    .await?;
                Ok(Arc::new(transport) as Arc<dyn Transport>)
            },
        ))
    });
}

#[test]
fn redis_pubsub() {
    let server = RedisServer::start();
    let url = server.url();
    explore(48, true, short_redis_timeout, move |s| {
        let url = url.clone();
        Box::pin(one(
            s,
            |s: &Settings| {
                in_range(s.t1, MS, HOUR)
                    && in_range(s.t2, MS, HOUR)
                    && backlog_bytes(s.capacity) >= MIN_BACKLOG_BYTES
            },
            async move |s: &Settings| {
                let transport = RedisPubSubTransport::builder(url)
                    .ping_interval(s.t1)
                    .ping_timeout(s.t2)
                    .max_backlog_bytes(backlog_bytes(s.capacity))
                    .connect()
                    .await?;
                Ok(Arc::new(transport) as Arc<dyn Transport>)
            },
        ))
    });
}

#[test]
fn nats_jetstream() {
    let server = NatsServer::start();
    let url = server.url();
    explore(48, true, never, move |s| {
        let url = url.clone();
        Box::pin(one(
            s,
            |s: &Settings| {
                in_range(s.t1, NATS_MIN_INTERVAL, HOUR)
                    && in_range(s.t2, NATS_MIN_INTERVAL, HOUR)
                    && s.capacity >= 1
            },
            async move |s: &Settings| {
                let transport = NatsJetStreamTransport::builder(url)
                    .pull_expiry(s.t1)
                    .ping_interval(s.t2)
                    .max_messages(i64::try_from(s.capacity).unwrap_or(i64::MAX))
                    .connect()
                    .await?;
                Ok(Arc::new(transport) as Arc<dyn Transport>)
            },
        ))
    });
}

#[test]
fn rocketmq() {
    let server = RocketMqServer::start();
    let addr = server.namesrv_addr();
    // Each combination starts a client runtime and a consumer (about a
    // second each), so fewer of them.
    explore(16, true, never, move |s| {
        let addr = addr.clone();
        Box::pin(one(
            s,
            |s: &Settings| s.capacity >= 1,
            async move |s: &Settings| {
                let transport = RocketMqTransport::builder(addr)
                    .queues_per_topic(u32::try_from(s.capacity).unwrap_or(u32::MAX))
                    .connect()
                    .await?;
                Ok(Arc::new(transport) as Arc<dyn Transport>)
            },
        ))
    });
}
