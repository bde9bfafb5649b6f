//! Watching the name servers and brokers, so a dead link is seen as one
//! even while the client library keeps retrying quietly.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::util::lock;

/// A topic's master brokers: broker name to address.
pub(super) type TopicBrokers = HashMap<String, String>;
/// What a subscription's watchdog saw of its brokers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Brokers {
    /// Every connection is open.
    Up,
    /// A broker closed its connection and refuses new ones: it is down.
    Down,
    /// A broker closed its connection but accepts new ones at once. It
    /// restarted (this process may have been paused meanwhile), or cut the
    /// connection for its own reasons: either way the client's connections
    /// may now lead to another store, so the subscription starts afresh and
    /// checks its position's history.
    Closed,
    /// A broker that was down when the subscription began accepts
    /// connections: the subscription starts afresh to read its queues,
    /// from the position it had there, once their history is checked.
    Returned,
}

/// How often the watchdog replaces its own connections: well inside the
/// broker's idle timeout (120 s), so a close is never the broker tidying up
/// a silent connection.
pub(super) const WATCHDOG_REFRESH: Duration = Duration::from_secs(30);

/// How often a broker that is down is tried.
pub(super) const RETURN_POLL: Duration = Duration::from_millis(500);

/// A subscription's connections to the brokers it reads, opened before its
/// plan checked what they hold, and shared with the transport's freshness
/// proof (`Inner::vouched`).
///
/// A broker's queue ends say nothing of a node's position unless they come
/// from the history the node read. RocketMQ names no history in what it
/// answers (a broker that lost its store counts its queues from 0 again),
/// but a broker that restarts closes every connection it held: while the
/// connection opened before the plan is still open, the broker at that
/// address is the same process, with the same store, as the one whose
/// history the plan checked.
pub(super) struct Watch {
    /// Broker name to its address and the connection held to it.
    conns: Mutex<HashMap<String, (String, std::net::TcpStream)>>,
    /// The subscription reads every broker its position names, and none
    /// has closed a connection since: false from the start when the plan
    /// left one out (down, or gone from the route), and once the watchdog
    /// saw one close.
    settled: AtomicBool,
}

impl Watch {
    /// Connections to `brokers` (name to address); one that does not
    /// answer is left out.
    pub(super) async fn open(brokers: &TopicBrokers) -> Self {
        let mut conns = HashMap::new();
        for (name, addr) in brokers {
            if let Some(s) = connect(addr).await.and_then(|s| s.into_std().ok()) {
                conns.insert(name.clone(), (addr.clone(), s));
            }
        }
        Self {
            conns: Mutex::new(conns),
            settled: AtomicBool::new(false),
        }
    }

    /// After the plan: keeps the brokers it reads (`read`, name to
    /// address), connecting to any it reads that was not watched before it
    /// (the route changed meanwhile). Settled only if the plan left no
    /// broker out and every broker it reads was watched before it and has
    /// not closed since.
    pub(super) async fn planned(&self, read: &TopicBrokers, left_out: bool) {
        let mut before = true;
        let known: TopicBrokers = lock(&self.conns)
            .iter()
            .map(|(name, (addr, _))| (name.clone(), addr.clone()))
            .collect();
        let mut late = Vec::new();
        for (name, addr) in read {
            if known.get(name) != Some(addr) {
                before = false;
                if let Some(s) = connect(addr).await.and_then(|s| s.into_std().ok()) {
                    late.push((name.clone(), (addr.clone(), s)));
                }
            }
        }
        let mut conns = lock(&self.conns);
        conns.retain(|name, _| read.contains_key(name));
        conns.extend(late);
        let open = conns.len() == read.len() && conns.values().all(|(_, s)| is_open(s));
        self.settled
            .store(before && open && !left_out, Ordering::SeqCst);
    }

    /// Whether this subscription vouches for `brokers` (name to address):
    /// settled, and each of them the process it has held a connection to
    /// since before its plan.
    pub(super) fn vouches_for<'a>(
        &self,
        mut brokers: impl Iterator<Item = (&'a str, &'a str)>,
    ) -> bool {
        if !self.settled.load(Ordering::SeqCst) {
            return false;
        }
        let conns = lock(&self.conns);
        brokers.all(|(name, addr)| {
            conns
                .get(name)
                .is_some_and(|(held, s)| held == addr && is_open(s))
        })
    }

    /// A broker closed, went down, or the subscription ended.
    pub(super) fn unsettle(&self) {
        self.settled.store(false, Ordering::SeqCst);
    }

    /// The connections, for the watchdog to wait on (each a second handle
    /// to the same socket).
    fn async_handles(&self) -> Vec<(String, tokio::net::TcpStream)> {
        lock(&self.conns)
            .values()
            .map(|(addr, s)| {
                let handle = s
                    .try_clone()
                    .ok()
                    .and_then(|c| tokio::net::TcpStream::from_std(c).ok());
                (addr.clone(), handle)
            })
            .filter_map(|(addr, h)| h.map(|h| (addr, h)))
            .collect()
    }

    /// Replaces each connection with a new one, each only while the old
    /// one is still open (so a restart between the two is not missed).
    /// The address of one that closed or does not answer, if any.
    async fn renew(&self) -> Option<(String, bool)> {
        let addrs: Vec<(String, String)> = lock(&self.conns)
            .iter()
            .map(|(name, (addr, _))| (name.clone(), addr.clone()))
            .collect();
        for (name, addr) in addrs {
            let Some(new) = connect(&addr).await.and_then(|s| s.into_std().ok()) else {
                return Some((addr, false));
            };
            let mut conns = lock(&self.conns);
            match conns.get_mut(&name) {
                Some((_, old)) if is_open(old) => *old = new,
                _ => return Some((addr, true)),
            }
        }
        None
    }
}

/// Whether the peer has not closed `stream`: a broker sends nothing
/// unasked, so a look that finds neither data nor an end finds it open. A
/// look at the socket itself, not at what the runtime last noticed of it.
fn is_open(stream: &std::net::TcpStream) -> bool {
    match stream.peek(&mut [0u8; 1]) {
        Ok(n) => n > 0,
        Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
    }
}

/// Watches the connections of `watch` (every broker read), and reports
/// the first time one closes. A broker that dies closes it at once,
/// however quickly it comes back; the pull requests of the client, by
/// contrast, hang for 30 s. `returned` resolves once a broker that was
/// down is back (see `RocketMqTransport::open`), which is reported too.
pub(super) async fn watchdog(
    watch: Arc<Watch>,
    returned: impl Future<Output = ()>,
    report: watch::Sender<Brokers>,
) {
    tokio::select! {
        () = watch_open(&watch, &report) => {}
        () = returned => {
            watch.unsettle();
            report.send_replace(Brokers::Returned);
        }
    }
}

async fn watch_open(watch: &Watch, report: &watch::Sender<Brokers>) {
    loop {
        let handles = watch.async_handles();
        let ended = handles.iter().map(|(addr, s)| Box::pin(closed(addr, s)));
        let gone = tokio::select! {
            addr = first_of(ended) => {
                let up = connect(&addr).await.is_some();
                Some(up)
            }
            () = tokio::time::sleep(WATCHDOG_REFRESH) => {
                watch.renew().await.map(|(_, up)| up)
            }
        };
        if let Some(up) = gone {
            watch.unsettle();
            report.send_replace(if up { Brokers::Closed } else { Brokers::Down });
            return;
        }
    }
}

pub(super) async fn connect(addr: &str) -> Option<tokio::net::TcpStream> {
    match tokio::time::timeout(
        Duration::from_millis(500),
        tokio::net::TcpStream::connect(addr),
    )
    .await
    {
        Ok(Ok(s)) => Some(s),
        _ => None,
    }
}

/// Waits until the peer closes the connection. A broker sends nothing
/// unasked, so any readiness that is not data ends it.
pub(super) async fn closed(addr: &str, stream: &tokio::net::TcpStream) -> String {
    let mut buf = [0u8; 64];
    loop {
        if stream.readable().await.is_err() {
            break;
        }
        match stream.try_read(&mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => break,
        }
    }
    addr.to_owned()
}

/// The output of whichever future finishes first (a tiny `select_all`, so
/// the feature needs no extra crate).
pub(super) async fn first_of<F: Future + Unpin>(futures: impl IntoIterator<Item = F>) -> F::Output {
    let mut futures: Vec<F> = futures.into_iter().collect();
    std::future::poll_fn(move |cx| {
        for f in &mut futures {
            if let std::task::Poll::Ready(out) = std::pin::Pin::new(f).poll(cx) {
                return std::task::Poll::Ready(out);
            }
        }
        std::task::Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A "broker": a listener whose accepted connections the test holds.
    async fn broker() -> (tokio::net::TcpListener, String) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        (listener, addr)
    }

    async fn until_not(what: impl Fn() -> bool) {
        let started = std::time::Instant::now();
        while what() {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "still true after 5 s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn a_watch_vouches_only_for_the_process_it_held_since_before_the_plan() {
        let (listener, addr) = broker().await;
        let brokers: TopicBrokers = [("b".to_owned(), addr.clone())].into();
        let watch = Watch::open(&brokers).await;
        let (held, _) = listener.accept().await.unwrap();
        let at = |name: &'static str, addr: &str| watch.vouches_for([(name, addr)].into_iter());
        assert!(!at("b", &addr), "not planned yet");
        watch.planned(&brokers, false).await;
        assert!(at("b", &addr));
        assert!(!at("b", "127.0.0.1:1"), "the broker at another address");
        assert!(!at("c", &addr), "a broker not watched");
        assert!(watch.vouches_for(std::iter::empty()));
        // The broker restarts: its end of every connection closes. The
        // next process at the address is not the one the plan checked.
        drop(held);
        until_not(|| at("b", &addr)).await;
    }

    #[tokio::test]
    async fn a_plan_that_left_a_broker_out_or_read_one_not_watched_vouches_for_nothing() {
        let (_listener, addr) = broker().await;
        let brokers: TopicBrokers = [("b".to_owned(), addr.clone())].into();
        let watch = Watch::open(&brokers).await;
        watch.planned(&brokers, true).await;
        assert!(!watch.vouches_for([("b", addr.as_str())].into_iter()));
        // Joined the route after the watch opened: read, but not watched
        // through the plan's checks.
        let late = Watch::open(&TopicBrokers::new()).await;
        late.planned(&brokers, false).await;
        assert!(!late.vouches_for([("b", addr.as_str())].into_iter()));
        // A broker watched but no longer read is let go.
        let (_other, other) = broker().await;
        let both: TopicBrokers = [("b".to_owned(), addr.clone()), ("c".to_owned(), other)].into();
        let watch = Watch::open(&both).await;
        watch.planned(&brokers, false).await;
        assert!(watch.vouches_for([("b", addr.as_str())].into_iter()));
        assert_eq!(lock(&watch.conns).len(), 1);
    }

    #[tokio::test]
    async fn the_watchdog_reports_a_close_and_the_watch_stops_vouching() {
        let (listener, addr) = broker().await;
        let brokers: TopicBrokers = [("b".to_owned(), addr.clone())].into();
        let watch = Arc::new(Watch::open(&brokers).await);
        let (held, _) = listener.accept().await.unwrap();
        watch.planned(&brokers, false).await;
        let (report, mut seen) = watch::channel(Brokers::Up);
        let dog = tokio::spawn(watchdog(watch.clone(), std::future::pending(), report));
        drop(held);
        // Still listening: the broker is back at once, so `Closed`.
        tokio::time::timeout(
            Duration::from_secs(5),
            seen.wait_for(|b| *b == Brokers::Closed),
        )
        .await
        .expect("reported within 5 s")
        .expect("watchdog alive");
        assert!(!watch.vouches_for([("b", addr.as_str())].into_iter()));
        dog.await.unwrap();
    }
}
