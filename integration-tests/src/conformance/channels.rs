//! Names and side channels: names map one to one onto broker resources, and
//! the heartbeat and reply channels reach whom they should, and only them.

use super::*;

/// Topic names that once shared a broker resource, or broke one: each must
/// get a resource of its own, and a node on one sees none of the other's
/// events. Cache names with the characters brokers give meaning to work too.
pub async fn names_map_one_to_one(fixture: &mut dyn Fixture) {
    let pairs: [(&str, &str); 6] = [
        ("tenant.a", "tenant_a"),
        ("x", "x:n"),
        (">", "tenant.*"),
        ("a b", "a%20b"),
        ("über", "%C3%BCber"),
        ("x:e", "x"),
    ];
    for (a, b) in pairs {
        let mut nodes = Vec::new();
        for topic in [a, b] {
            let cache =
                cache_sync::SyncedCache::new("c", moka::future::Cache::<String, String>::new(10));
            let node = fixture
                .configure(cache_sync::Node::builder(
                    format!("node-{topic}"),
                    fixture.transport().await,
                ))
                .topic(topic)
                // No look-back: "x" comes up twice, and only this pair's
                // events may reach it.
                .reorder_window(Duration::ZERO)
                .register(&cache)
                .start()
                .await
                .unwrap_or_else(|e| panic!("{}: topic {topic:?}: {e}", fixture.name()));
            nodes.push((topic, node, cache));
        }
        for (topic, _, _) in &nodes {
            let p = Publisher::builder(fixture.transport().await)
                .topic(*topic)
                // Announcements are records too: the count below is of
                // this one event.
                .announce_interval(Duration::MAX)
                .build()
                .unwrap_or_else(|e| panic!("{}: topic {topic:?}: {e}", fixture.name()));
            retry(|| p.insert("c", [("k", topic.to_string())])).await;
        }
        for (topic, node, cache) in &nodes {
            crate::eventually(&format!("{topic:?} applies its own event"), async || {
                cache.peek("k").await.as_deref() == Some(*topic)
            })
            .await;
            let s = node.status();
            assert_eq!(
                (s.events_received, s.events_rejected, s.losses),
                (1, 0, 0),
                "{}: topic {topic:?} saw another topic's events: {s:?}",
                fixture.name()
            );
        }
        for (_, node, _) in nodes {
            let _ = node.shutdown().await;
        }
    }
    // Cache names are tags on some transports: characters that mean
    // something in a tag expression or a header must not.
    let names = [
        "feature flags",
        "a||b",
        "*",
        ".",
        "x:n",
        "ü",
        " lead",
        "%41",
    ];
    let caches: Vec<_> = names
        .iter()
        .map(|n| cache_sync::SyncedCache::new(*n, moka::future::Cache::<String, String>::new(10)))
        .collect();
    let mut builder = fixture.configure(cache_sync::Node::builder(
        "names",
        fixture.transport().await,
    ));
    for c in &caches {
        builder = builder.register(c);
    }
    let node = builder
        .start()
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", fixture.name()));
    let p = Publisher::new(fixture.transport().await);
    for n in names {
        retry(|| p.insert(n, [("k", n.to_string())])).await;
    }
    for c in &caches {
        crate::eventually(
            &format!("cache {:?} applies its event", c.name()),
            async || c.peek("k").await.as_deref() == Some(c.name()),
        )
        .await;
    }
    assert_eq!(node.status().events_rejected, 0);
    let _ = node.shutdown().await;
    // And names no transport can carry fail at build time, naming the rule.
    for bad in ["", "nul\0byte", "new\nline"] {
        let err = fixture
            .configure(cache_sync::Node::builder("bad", fixture.transport().await))
            .topic(bad)
            .start()
            .await
            .expect_err("a bad topic starts no node");
        assert!(err.is_config(), "{}: {bad:?}: {err}", fixture.name());
        let err = Publisher::builder(fixture.transport().await)
            .topic(bad)
            .build()
            .expect_err("a bad topic builds no publisher");
        assert!(err.is_config(), "{}: {bad:?}: {err}", fixture.name());
    }
    let long = "t".repeat(300);
    assert!(
        fixture
            .configure(cache_sync::Node::builder("long", fixture.transport().await))
            .topic(long.as_str())
            .start()
            .await
            .is_err_and(|e| e.is_config())
    );
}

/// How long a heartbeat or a change record may take to arrive.
const ARRIVES_WITHIN: Duration = Duration::from_secs(20);

/// How long nothing more must arrive before a subscription counts as
/// having delivered everything: a stray record has had time to show.
const QUIET: Duration = Duration::from_millis(1500);

/// How long a record already delivered to the client takes to be handed out.
const AT_HAND: Duration = Duration::from_millis(200);

/// The next heartbeat, failing the test if none comes.
async fn next_heartbeat(
    name: &str,
    what: &str,
    sub: &mut Box<dyn HeartbeatSubscription>,
) -> bytes::Bytes {
    match tokio::time::timeout(ARRIVES_WITHIN, sub.next()).await {
        Ok(Ok(payload)) => payload,
        Ok(Err(e)) => panic!("{name}: {what}: the heartbeat subscription failed: {e}"),
        Err(_) => panic!("{name}: {what}: no heartbeat within {ARRIVES_WITHIN:?}"),
    }
}

/// Returns once `sub` hears `publisher`'s heartbeats on `topic`, with
/// nothing of the wait left to read. On a cluster a subscription's interest
/// reaches the other servers a moment after it is made, and a core NATS
/// message sent before that reaches nobody (seen: the first five of 100
/// heartbeats lost during a loaded full run); a channel that keeps nothing
/// promises nothing earlier.
async fn heartbeats_reach(
    name: &str,
    publisher: &Arc<dyn Transport>,
    topic: &str,
    subs: &mut [&mut Box<dyn HeartbeatSubscription>],
) {
    let deadline = tokio::time::Instant::now() + ARRIVES_WITHIN;
    for sub in subs.iter_mut() {
        loop {
            retry(|| publisher.publish_heartbeat(topic, bytes::Bytes::from_static(b"probe"))).await;
            if let Ok(got) = tokio::time::timeout(Duration::from_millis(100), sub.next()).await {
                let got = got.unwrap_or_else(|e| panic!("{name}: a probe heartbeat: {e}"));
                assert_eq!(&got[..], b"probe", "{name}: a probe heartbeat");
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{name}: no probe heartbeat within {ARRIVES_WITHIN:?}"
            );
        }
    }
    // Once every subscriber hears them, a last message after every probe
    // (one publisher's messages keep their order), read up to by each.
    retry(|| publisher.publish_heartbeat(topic, bytes::Bytes::from_static(b"ready"))).await;
    for sub in subs.iter_mut() {
        while &next_heartbeat(name, "the probes", sub).await[..] != b"ready" {}
    }
}

/// Fails if a heartbeat arrives within [`QUIET`].
async fn no_more_heartbeats(name: &str, what: &str, sub: &mut Box<dyn HeartbeatSubscription>) {
    if let Ok(got) = tokio::time::timeout(QUIET, sub.next()).await {
        panic!("{name}: {what}: got {got:?}, expected nothing more");
    }
}

/// Everything a change subscription delivers until it has been quiet for
/// [`QUIET`] after at least `expect` records: the payloads, and how many
/// losses it signalled.
async fn read_changes(
    name: &str,
    what: &str,
    sub: &mut Box<dyn Subscription>,
    expect: usize,
) -> (Vec<bytes::Bytes>, usize) {
    let deadline = tokio::time::Instant::now() + ARRIVES_WITHIN;
    let (mut payloads, mut losses) = (Vec::new(), 0);
    loop {
        let wait = if payloads.len() >= expect {
            QUIET
        } else {
            deadline.saturating_duration_since(tokio::time::Instant::now())
        };
        match tokio::time::timeout(wait, sub.next(1000)).await {
            Ok(Ok(Delivery::Batch { records, .. })) => {
                payloads.extend(records.into_iter().map(|r| r.payload));
            }
            Ok(Ok(Delivery::Lost(loss))) => {
                eprintln!("{name}: {what}: loss {loss:?}");
                losses += 1;
            }
            Ok(Ok(other)) => panic!("{name}: {what}: unexpected delivery {other:?}"),
            Ok(Err(e)) => panic!("{name}: {what}: the change subscription failed: {e}"),
            Err(_) if payloads.len() >= expect => return (payloads, losses),
            Err(_) => panic!(
                "{name}: {what}: {} of {expect} change records within {ARRIVES_WITHIN:?}",
                payloads.len()
            ),
        }
    }
}

/// The heartbeat channel beside each topic's change history: a heartbeat
/// reaches every heartbeat subscriber byte for byte, never a change
/// subscription (nor takes a change history's room), and each topic's
/// channel is its own, whatever characters its name holds. A transport
/// without one must say `Unsupported`.
pub async fn heartbeat_channel(fixture: &mut dyn Fixture) {
    let name = fixture.name();
    let publisher = fixture.transport().await;
    let (a_node, b_node) = (fixture.transport().await, fixture.transport().await);

    // (a) Two subscribers, on two clients of their own, get it byte-exact.
    let topic = "hb-a";
    let mut a = match a_node.subscribe_heartbeats(topic).await {
        Ok(sub) => sub,
        Err(e) if e.is_unsupported() => cannot_run(name, "a heartbeat channel"),
        Err(e) => panic!("{name}: subscribe_heartbeats: {e}"),
    };
    let mut b = b_node
        .subscribe_heartbeats(topic)
        .await
        .unwrap_or_else(|e| panic!("{name}: subscribe_heartbeats: {e}"));
    heartbeats_reach(name, &publisher, topic, &mut [&mut a, &mut b]).await;
    // Every byte value, NUL and invalid UTF-8 included.
    let beat: bytes::Bytes = (0..=255u8)
        .chain(0..=255u8)
        .rev()
        .collect::<Vec<_>>()
        .into();
    retry(|| publisher.publish_heartbeat(topic, beat.clone())).await;
    for (who, sub) in [("first", &mut a), ("second", &mut b)] {
        let got = next_heartbeat(name, who, sub).await;
        assert_eq!(
            got, beat,
            "{name}: the {who} subscriber got another payload"
        );
        no_more_heartbeats(name, who, sub).await;
    }

    // (b) Never in a change subscription of the same topic, made before or
    // after the heartbeats.
    let topic = "hb-b";
    let before = a_node
        .subscribe(topic, SubscribeOptions::new(StartFrom::Latest))
        .await
        .unwrap_or_else(|e| panic!("{name}: subscribe: {e}"));
    let mut beats = b_node
        .subscribe_heartbeats(topic)
        .await
        .unwrap_or_else(|e| panic!("{name}: subscribe_heartbeats: {e}"));
    heartbeats_reach(name, &publisher, topic, &mut [&mut beats]).await;
    for i in 0..100u32 {
        let payload = bytes::Bytes::from(format!("beat {i}"));
        retry(|| publisher.publish_heartbeat(topic, payload.clone())).await;
    }
    let change = bytes::Bytes::from_static(b"the one change event");
    retry(|| publisher.publish(topic, "c", change.clone())).await;
    let mut subs = vec![("made before, from the latest", before)];
    match b_node
        .subscribe(topic, SubscribeOptions::new(StartFrom::Earliest))
        .await
    {
        Ok(after) => subs.push(("made after, from the earliest", after)),
        Err(e) if e.is_unsupported() => {
            eprintln!("{name}: no earliest start ({e}); checked the latest one only");
        }
        Err(e) => panic!("{name}: subscribe from the earliest: {e}"),
    }
    for (what, sub) in &mut subs {
        let (payloads, losses) = read_changes(name, what, sub, 1).await;
        assert_eq!(
            (payloads, losses),
            (vec![change.clone()], 0),
            "{name}: the change subscription {what} must see the one change record and no loss"
        );
    }
    // The heartbeats themselves went through (the channel may drop some,
    // never on a quiet test broker).
    for i in 0..100u32 {
        let got = next_heartbeat(name, "the 100", &mut beats).await;
        assert_eq!(got, format!("beat {i}").as_bytes(), "{name}: heartbeat {i}");
    }
    drop(subs);

    // (c) Each topic's channel is its own, whatever its name holds.
    let topics = [
        "x", "x.hb", "x:hb", "x%hb", "x hb", "a.b", "a_b", "*", ">", "a:b", "a b", "über",
    ];
    let mut channels = Vec::new();
    let mut refused = Vec::new();
    for topic in topics {
        if let Err(e) = a_node.check_topic(topic) {
            // A name the transport cannot map is refused by its rules (a
            // config error, the same for its heartbeat channel), never
            // half-taken; the names it takes are checked below.
            assert!(
                e.is_config(),
                "{name}: {topic:?} refused, but not by a rule: {e}"
            );
            let beats = a_node.subscribe_heartbeats(topic).await;
            assert!(
                beats.as_ref().is_err_and(cache_sync::Error::is_config),
                "{name}: {topic:?} refused as a topic, yet its heartbeat channel gave {:?}",
                beats.map(drop)
            );
            refused.push(topic);
            continue;
        }
        let beats = a_node
            .subscribe_heartbeats(topic)
            .await
            .unwrap_or_else(|e| panic!("{name}: {topic:?}: subscribe_heartbeats: {e}"));
        let changes = a_node
            .subscribe(topic, SubscribeOptions::new(StartFrom::Latest))
            .await
            .unwrap_or_else(|e| panic!("{name}: {topic:?}: subscribe: {e}"));
        channels.push((topic, beats, changes));
    }
    // The plain names every transport takes are among those checked.
    assert!(
        ["x", "a_b"].iter().all(|t| !refused.contains(t)),
        "{name}: refused a plain topic: {refused:?}"
    );
    if !refused.is_empty() {
        eprintln!("{name}: refuses topics {refused:?} by its naming rules, as documented");
    }
    for (topic, ..) in &channels {
        retry(|| publisher.publish_heartbeat(topic, bytes::Bytes::from(topic.to_string()))).await;
    }
    for (topic, beats, _) in &mut channels {
        let got = next_heartbeat(name, topic, beats).await;
        assert_eq!(
            got,
            topic.as_bytes(),
            "{name}: topic {topic:?} got another topic's heartbeat"
        );
    }
    // Anything stray has had time to arrive; it would now be at hand.
    tokio::time::sleep(QUIET).await;
    for (topic, beats, changes) in &mut channels {
        if let Ok(got) = tokio::time::timeout(AT_HAND, beats.next()).await {
            panic!("{name}: topic {topic:?}: got {got:?}, expected nothing more");
        }
        match tokio::time::timeout(AT_HAND, changes.next(1000)).await {
            Err(_) => {}
            Ok(Ok(Delivery::Batch { records, .. })) if records.is_empty() => {}
            Ok(stray) => panic!("{name}: topic {topic:?}: a change subscription got {stray:?}"),
        }
    }
    drop(channels);
}

/// Where the broker keeps heartbeats (and the suite can look at it):
/// heartbeats take none of the change history's room, and their own channel
/// stays short and expires.
pub async fn heartbeats_take_no_room_in_the_history(fixture: &mut dyn Fixture) {
    let name = fixture.name();
    let publisher = fixture.transport().await;
    let topic = "hb-d";
    retry(|| publisher.publish(topic, "c", bytes::Bytes::from_static(b"change"))).await;
    retry(|| publisher.publish_heartbeat(topic, bytes::Bytes::from_static(b"beat"))).await;
    let Some(start) = fixture.stored(topic) else {
        cannot_run(name, "a look at what the broker stores");
    };
    // More than the channel keeps (Redis Streams: about 4096), so it must
    // have trimmed.
    const BEATS: u32 = 6000;
    for i in 0..BEATS {
        let payload = bytes::Bytes::from(format!("beat {i}"));
        retry(|| publisher.publish_heartbeat(topic, payload.clone())).await;
    }
    let end = fixture.stored(topic).expect("looked at once already");
    eprintln!("{name}: stored before {BEATS} heartbeats {start:?}, after {end:?}");
    assert_eq!(
        end.history, start.history,
        "{name}: heartbeats changed the length of the change history"
    );
    assert_eq!(
        start.history, 1,
        "{name}: the change history holds the one event"
    );
    assert!(
        end.heartbeats < u64::from(BEATS),
        "{name}: the heartbeat channel kept all {BEATS} heartbeats: {end:?}"
    );
    if let Some(ttl) = end.heartbeats_expire_in {
        assert!(
            ttl > Duration::ZERO && ttl <= Duration::from_secs(60),
            "{name}: the heartbeat channel lives on for {ttl:?}"
        );
    }
}

/// Each optional channel (heartbeats, replies) is either there on both
/// sides or declared missing on both: a subscription that says
/// `Unsupported` where publishing works (or the other way round) would
/// leave a party waiting for answers that go nowhere. Runs on every
/// transport; it says which it found.
pub async fn optional_channels_are_declared_on_both_sides(fixture: &mut dyn Fixture) {
    let name = fixture.name();
    let transport = fixture.transport().await;
    let topic = "declared";
    let beat = bytes::Bytes::from_static(b"beat");
    // Each side said `Unsupported`, or neither; true where it worked.
    let alike = |what: &str,
                 subscribed: cache_sync::Result<()>,
                 published: cache_sync::Result<()>| {
        let unsupported =
            |r: &cache_sync::Result<()>| r.as_ref().err().map(cache_sync::Error::is_unsupported);
        assert_eq!(
            unsupported(&subscribed),
            unsupported(&published),
            "{name}: {what}: subscribing gave {subscribed:?}, publishing {published:?}"
        );
        subscribed.is_ok()
    };
    alike(
        "heartbeats",
        transport.subscribe_heartbeats(topic).await.map(drop),
        retry_unless_unsupported(|| transport.publish_heartbeat(topic, beat.clone())).await,
    );
    let replies = alike(
        "replies",
        transport.subscribe_replies(topic, 7).await.map(drop),
        retry_unless_unsupported(|| transport.publish_reply(topic, 7, beat.clone())).await,
    );
    eprintln!(
        "{name}: reply channel {}",
        if replies {
            "present"
        } else {
            "declared unsupported"
        }
    );
}

/// `f` until it works or says `Unsupported` (a broker may still be making
/// the resource on first use).
async fn retry_unless_unsupported<F, Fut>(mut f: F) -> cache_sync::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = cache_sync::Result<()>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match f().await {
            Err(e) if !e.is_unsupported() && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return other,
        }
    }
}

/// A party's reply channel (answers to its acknowledgement requests): what
/// is published for a party reaches that party's reply subscription byte
/// for byte, and no other party's, nor the topic's heartbeat channel, nor
/// a change subscription; each topic's replies are its own. A transport
/// without reply channels declares it on both sides (`Unsupported`): its
/// answers then go on the heartbeat channel.
pub async fn reply_channel(fixture: &mut dyn Fixture) {
    let name = fixture.name();
    let publisher = fixture.transport().await;
    let (one, two) = (fixture.transport().await, fixture.transport().await);
    let topic = "replies";
    let mut mine = match one.subscribe_replies(topic, 1).await {
        Ok(sub) => sub,
        Err(e) if e.is_unsupported() => cannot_run(name, "reply channels"),
        Err(e) => panic!("{name}: subscribe_replies: {e}"),
    };
    let mut other_party = two
        .subscribe_replies(topic, 2)
        .await
        .unwrap_or_else(|e| panic!("{name}: subscribe_replies: {e}"));
    let mut shared = two
        .subscribe_heartbeats(topic)
        .await
        .unwrap_or_else(|e| panic!("{name}: subscribe_heartbeats: {e}"));
    let mut changes = two
        .subscribe(topic, SubscribeOptions::new(StartFrom::Latest))
        .await
        .unwrap_or_else(|e| panic!("{name}: subscribe: {e}"));
    // Party 1 on another topic, whose name reads like this one's channels.
    let lookalike = "replies.hb";
    let mut elsewhere = match one.check_topic(lookalike) {
        Ok(()) => Some(
            one.subscribe_replies(lookalike, 1)
                .await
                .unwrap_or_else(|e| panic!("{name}: subscribe_replies: {e}")),
        ),
        Err(_) => None,
    };
    let answer: bytes::Bytes = (0..=255u8).collect::<Vec<_>>().into();
    retry(|| publisher.publish_reply(topic, 1, answer.clone())).await;
    assert_eq!(
        next_heartbeat(name, "party 1's reply channel", &mut mine).await,
        answer,
        "{name}: party 1 got another payload"
    );
    no_more_heartbeats(name, "party 1's reply channel", &mut mine).await;
    no_more_heartbeats(name, "party 2's reply channel", &mut other_party).await;
    no_more_heartbeats(name, "the heartbeat channel", &mut shared).await;
    if let Some(sub) = &mut elsewhere {
        no_more_heartbeats(name, "party 1 on another topic", sub).await;
    }
    match tokio::time::timeout(AT_HAND, changes.next(1000)).await {
        Err(_) => {}
        Ok(Ok(Delivery::Batch { records, .. })) if records.is_empty() => {}
        Ok(stray) => panic!("{name}: a change subscription got {stray:?}"),
    }
    // Nobody subscribed: no error, and nothing left that a later
    // subscriber would get.
    retry(|| publisher.publish_reply(topic, 3, bytes::Bytes::from_static(b"lost"))).await;
    // A publish returns once it is on the publisher's connection, not once
    // the broker has routed it (NATS' flush waits for the socket only), so
    // a subscription made at once on another connection could still catch
    // it. A broker handles one connection's messages in order: once a
    // marker sent after it arrives, "lost" has been routed to nobody.
    retry(|| publisher.publish_reply(topic, 1, bytes::Bytes::from_static(b"marker"))).await;
    assert_eq!(
        next_heartbeat(name, "party 1's reply channel", &mut mine).await,
        bytes::Bytes::from_static(b"marker"),
        "{name}: party 1 got another payload"
    );
    let mut late = two
        .subscribe_replies(topic, 3)
        .await
        .unwrap_or_else(|e| panic!("{name}: subscribe_replies: {e}"));
    // On a cluster the new subscription's interest reaches the other
    // servers a moment after it is made, and a reply sent before then
    // reaches nobody (seen once in a loaded full run on the NATS cluster):
    // "kept" is sent until one arrives, and the first to arrive must be it.
    let deadline = tokio::time::Instant::now() + ARRIVES_WITHIN;
    let first = loop {
        retry(|| publisher.publish_reply(topic, 3, bytes::Bytes::from_static(b"kept"))).await;
        match tokio::time::timeout(Duration::from_millis(500), late.next()).await {
            Ok(Ok(payload)) => break payload,
            Ok(Err(e)) => panic!("{name}: party 3's reply channel failed: {e}"),
            Err(_) if tokio::time::Instant::now() < deadline => {}
            Err(_) => panic!("{name}: party 3's reply channel: no reply within {ARRIVES_WITHIN:?}"),
        }
    };
    assert_eq!(
        first,
        bytes::Bytes::from_static(b"kept"),
        "{name}: a reply sent before the subscription was delivered to it"
    );
}
