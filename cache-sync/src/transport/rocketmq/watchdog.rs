//! Watching the name servers and brokers, so a dead link is seen as one
//! even while the client library keeps retrying quietly.

use std::collections::HashMap;
use std::time::Duration;

use tokio::sync::watch;

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

/// Holds a TCP connection to each broker read (`addrs`), and reports the
/// first time one closes. A broker that dies closes it at once, however
/// quickly it comes back; the pull requests of the client, by contrast,
/// hang for 30 s. `returned` resolves once a broker that was down is back
/// (see `RocketMqTransport::open`), which is reported too.
pub(super) async fn watchdog(
    addrs: Vec<String>,
    returned: impl Future<Output = ()>,
    report: watch::Sender<Brokers>,
) {
    tokio::select! {
        () = watch_open(&addrs, &report) => {}
        () = returned => {
            report.send_replace(Brokers::Returned);
        }
    }
}

async fn watch_open(addrs: &[String], report: &watch::Sender<Brokers>) {
    loop {
        let mut conns = HashMap::new();
        for addr in addrs {
            match connect(addr).await {
                Some(s) => {
                    conns.insert(addr.clone(), s);
                }
                None => {
                    report.send_replace(Brokers::Down);
                    return;
                }
            }
        }
        let ended = conns.iter().map(|(addr, s)| Box::pin(closed(addr, s)));
        tokio::select! {
            addr = first_of(ended) => {
                let state = match connect(&addr).await {
                    Some(_) => Brokers::Closed,
                    None => Brokers::Down,
                };
                report.send_replace(state);
                return;
            }
            () = tokio::time::sleep(WATCHDOG_REFRESH) => {}
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
