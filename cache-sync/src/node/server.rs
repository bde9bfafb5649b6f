//! The status server: serving the router on a listener, with bounds on
//! what any one client may hold (connections, time, a request's head).

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
#[cfg(test)]
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper::service::{Service as _, service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::{Notify, watch};
use tokio::task::{AbortHandle, JoinHandle, JoinSet};

use super::Node;
use crate::error::{Error, Result};
use crate::util::deadline_after;

/// How long a client may take to send a request's head (line and
/// headers), from the moment the server starts reading it. Defeats clients
/// that send half a request, or a byte at a time.
pub(crate) const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection may make no progress at all (an idle keep-alive
/// connection, a stalled body, a client that stops reading the response).
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long [`StatusServer::shutdown`] lets requests in flight finish
/// before it closes their connections.
pub(crate) const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Connections open at once, so a flood of clients cannot use up the
/// process's file descriptors. Probes and scrapes need a handful. Past it,
/// a new connection takes the place of the one idle longest (see
/// `Connections::make_room`).
pub(crate) const MAX_CONNECTIONS: usize = 64;
/// How long one connection is kept: after that it is closed once its
/// request in flight is answered. Busy keep-alive clients never go idle,
/// so without this, as many of them as the cap could keep a probe out for
/// good.
pub(crate) const MAX_CONNECTION_AGE: Duration = Duration::from_secs(60);

/// A running status server. Stops when [`shutdown`](Self::shutdown) is called
/// or when dropped.
///
/// It speaks HTTP/1.1 with keep-alive. A client gets
/// 10 s to send a request's head and a connection that makes no progress
/// for 60 s is closed, so no client can hold a connection, or the server's
/// shutdown, hostage; shutdown lets requests in flight finish for up to 5 s,
/// then closes what is left. At most 64 connections are open at once, and
/// none is kept longer than 60 s (it closes after the request in flight).
/// A connection past the 64 is accepted all the same, and the open one that
/// has been idle longest (no request in flight: one that has sent nothing
/// yet, part of a request's head, or is between keep-alive requests) is
/// closed to make room, so silent or slow clients cannot keep a health
/// probe out. Only while all 64 have a request in flight does a new
/// connection wait, until one of those requests is answered.
#[derive(Debug)]
pub struct StatusServer {
    addr: SocketAddr,
    stop: Option<watch::Sender<bool>>,
    task: Option<JoinHandle<()>>,
}

impl StatusServer {
    pub(crate) async fn bind(node: Node, addr: impl ToSocketAddrs + fmt::Debug) -> Result<Self> {
        let asked = format!("{addr:?}");
        let bind_error = |source| Error::Bind {
            addr: asked.clone(),
            source,
        };
        let listener = TcpListener::bind(addr).await.map_err(bind_error)?;
        let addr = listener.local_addr().map_err(bind_error)?;
        let (stop, stopped) = watch::channel(false);
        Ok(Self {
            addr,
            stop: Some(stop),
            task: Some(tokio::spawn(serve(
                listener,
                super::http::router(node),
                stopped,
                Connections::default(),
            ))),
        })
    }

    /// The bound address (useful after binding port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets requests in flight finish for up to 5 s, closes
    /// every connection, and waits for all of that.
    pub async fn shutdown(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            stop.send_replace(true);
        }
        if let Some(task) = self.task.take() {
            // A panic in the server's task is passed on; a task the runtime
            // cancelled (it is shutting down) has stopped serving all the
            // same.
            if let Err(e) = task.await
                && let Ok(panic) = e.try_into_panic()
            {
                std::panic::resume_unwind(panic);
            }
        }
        Ok(())
    }
}

impl Drop for StatusServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            stop.send_replace(true);
        }
    }
}

/// Accepts until told to stop, then shuts the connections down within
/// `SHUTDOWN_GRACE`.
async fn serve(
    listener: TcpListener,
    app: Router,
    mut stop: watch::Receiver<bool>,
    mut connections: Connections,
) {
    let (drain, draining) = watch::channel(false);
    loop {
        tokio::select! {
            () = stopped(&mut stop) => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => tokio::select! {
                    () = stopped(&mut stop) => break,
                    () = connections.make_room() => {
                        connections.spawn(stream, app.clone(), draining.clone());
                    }
                },
                Err(e) => {
                    // Out of file descriptors, or a connection reset before
                    // it was accepted: wait a moment rather than spin.
                    tracing::warn!(error = %e, "status server: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            () = connections.reap(), if !connections.tasks.is_empty() => {}
        }
    }
    drop(listener);
    drain.send_replace(true);
    let mut tasks = connections.tasks;
    let finished = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if finished.is_err() {
        tracing::debug!(
            open = tasks.len(),
            "status server: closing connections still open after the grace period"
        );
    }
    tasks.shutdown().await;
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// A server's open connections, and which one gives way to a new one.
#[derive(Default)]
struct Connections {
    /// One task per connection; its socket closes when the task ends.
    tasks: JoinSet<()>,
    /// The connections that may still be shed (a shed one leaves at once,
    /// though `tasks` counts it until its task has ended).
    open: Vec<Slot>,
    idleness: Arc<Idleness>,
    /// Connections shed since the server started.
    shed: u64,
    /// The most connections held at once, the one being accepted included.
    #[cfg(test)]
    peak: Arc<AtomicUsize>,
}

struct Slot {
    activity: Arc<Activity>,
    task: AbortHandle,
}

impl Connections {
    fn spawn(&mut self, stream: TcpStream, app: Router, draining: watch::Receiver<bool>) {
        let activity = Arc::new(Activity::new(self.idleness.clone()));
        let task = self
            .tasks
            .spawn(connection(stream, app, draining, activity.clone()));
        self.open.push(Slot { activity, task });
    }

    /// Waits for a connection's task to end.
    async fn reap(&mut self) {
        if self.tasks.join_next().await.is_some() {
            self.open.retain(|slot| !slot.task.is_finished());
        }
    }

    /// Makes room for a connection just accepted (and held meanwhile, the
    /// one past the cap). The policy: at the cap, close the connection that
    /// has been idle longest, which is never one with a request in flight
    /// and, under a flood, is a client that has sent nothing or half a
    /// head for longest, while a probe that just connected is the last to
    /// go. If every connection has a request in flight, wait for one to be
    /// answered: the handlers are quick and read no body, and a client that
    /// does not read its response is idle, not busy, once it is answered.
    async fn make_room(&mut self) {
        #[cfg(test)]
        self.peak
            .fetch_max(self.tasks.len().saturating_add(1), Ordering::Relaxed);
        while self.tasks.len() >= MAX_CONNECTIONS {
            if self.shed_longest_idle() {
                // Until its socket is closed, not just until it is told to
                // close: the server holds no more than the cap plus one.
                self.reap().await;
            } else {
                let idleness = self.idleness.clone();
                tokio::select! {
                    () = self.reap() => {}
                    () = idleness.request_done.notified() => {}
                }
            }
        }
    }

    /// False if no connection is idle, or the one idle longest has just
    /// started a request (then its end wakes `make_room` to look again).
    fn shed_longest_idle(&mut self) -> bool {
        let Some((i, since)) = longest_idle(self.open.iter().map(|slot| &*slot.activity)) else {
            return false;
        };
        if !self.open[i].activity.shed(since) {
            return false;
        }
        self.open.swap_remove(i).task.abort();
        self.shed = self.shed.saturating_add(1);
        tracing::debug!(
            shed = self.shed,
            "status server: at the connection cap, closed the connection idle longest"
        );
        true
    }
}

/// The index and idle mark of the activity idle longest, if any is idle.
fn longest_idle<'a>(activities: impl IntoIterator<Item = &'a Activity>) -> Option<(usize, u64)> {
    activities
        .into_iter()
        .enumerate()
        .filter_map(|(i, a)| a.idle_since().map(|since| (i, since)))
        .min_by_key(|&(_, since)| since)
}

/// Shared by a server's connections.
#[derive(Default)]
struct Idleness {
    /// Counts the times a connection went idle: a connection's mark is the
    /// count when it did, so the lowest mark is the one idle longest. A
    /// count rather than a time, because marks are then unique (no ties,
    /// not even on a paused clock) and a mark seen once never comes back.
    clock: AtomicU64,
    /// A request was answered: an accept waiting on every connection
    /// being busy looks again.
    request_done: Notify,
}

/// Whether one connection has a request in flight, and if not, since when
/// it has been idle.
struct Activity {
    /// `BUSY`, `SHED`, or the idle mark.
    state: AtomicU64,
    idleness: Arc<Idleness>,
}

const BUSY: u64 = u64::MAX;
const SHED: u64 = u64::MAX - 1;

impl Activity {
    /// Idle from the moment it is accepted.
    fn new(idleness: Arc<Idleness>) -> Self {
        Self {
            state: AtomicU64::new(idleness.clock.fetch_add(1, Ordering::Relaxed)),
            idleness,
        }
    }

    fn idle_since(&self) -> Option<u64> {
        Some(self.state.load(Ordering::Relaxed)).filter(|&s| s < SHED)
    }

    /// Marks a request in flight until the guard is dropped.
    fn busy(self: &Arc<Self>) -> Busy {
        self.state.store(BUSY, Ordering::Relaxed);
        Busy(self.clone())
    }

    /// Claims the connection for shedding if it is still idle with the
    /// mark `since`, so one that has just started a request is not cut.
    fn shed(&self, since: u64) -> bool {
        self.state
            .compare_exchange(since, SHED, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }
}

struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        let idleness = &self.0.idleness;
        self.0.state.store(
            idleness.clock.fetch_add(1, Ordering::Relaxed),
            Ordering::Relaxed,
        );
        idleness.request_done.notify_one();
    }
}

async fn connection(
    stream: TcpStream,
    app: Router,
    mut draining: watch::Receiver<bool>,
    activity: Arc<Activity>,
) {
    let io = TokioIo::new(IdleTimeout::new(stream, IDLE_TIMEOUT));
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .keep_alive(true);
    let app = TowerToHyperService::new(app);
    // Busy from a request's head being read until its response is ready.
    let service = service_fn(move |request| {
        let busy = activity.busy();
        let response = app.call(request);
        async move {
            let response = response.await;
            drop(busy);
            response
        }
    });
    let conn = builder.serve_connection(io, service);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        () = async { let _ = draining.wait_for(|d| *d).await; } => {
            // Finish the request in flight, if any, then close; the server
            // cuts this short after `SHUTDOWN_GRACE`.
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
        () = tokio::time::sleep(MAX_CONNECTION_AGE) => {
            // The same, bounded by the idle timeout; a shutdown meanwhile
            // cuts it short as above.
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

/// A stream that fails with `TimedOut` once neither a read nor a write has
/// made progress for `idle`.
struct IdleTimeout {
    stream: TcpStream,
    idle: Duration,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl IdleTimeout {
    fn new(stream: TcpStream, idle: Duration) -> Self {
        Self {
            stream,
            idle,
            deadline: Box::pin(tokio::time::sleep_until(deadline_after(idle))),
        }
    }

    fn progressed(&mut self) {
        self.deadline.as_mut().reset(deadline_after(self.idle));
    }

    /// Called when the stream is not ready: an error once the deadline
    /// passed, else `Pending` with the deadline's waker registered too.
    fn stalled<T>(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<T>> {
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "status connection idle for too long",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for IdleTimeout {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        match std::pin::Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(r) => {
                this.progressed();
                Poll::Ready(r)
            }
            Poll::Pending => this.stalled(cx),
        }
    }
}

impl AsyncWrite for IdleTimeout {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        match std::pin::Pin::new(&mut this.stream).poll_write(cx, buf) {
            Poll::Ready(r) => {
                this.progressed();
                Poll::Ready(r)
            }
            Poll::Pending => this.stalled(cx),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        match std::pin::Pin::new(&mut this.stream).poll_flush(cx) {
            Poll::Ready(r) => Poll::Ready(r),
            Poll::Pending => this.stalled(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::node::http::router;
    use crate::node::http::tests::node_with_cache;

    /// An address that cannot be listened on (taken, or not this
    /// machine's) is a `Bind` error naming it: not an I/O error on a file,
    /// and not a disconnected transport.
    #[tokio::test]
    async fn an_address_that_cannot_be_listened_on_is_a_bind_error() {
        let (node, _cache) = node_with_cache().await;
        let taken = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let taken = taken.local_addr().unwrap();
        // 192.0.2.0/24 is TEST-NET-1: never an address of this machine.
        for addr in [taken.to_string(), "192.0.2.1:0".to_owned()] {
            let e = node.serve_status(addr.as_str()).await.unwrap_err();
            assert!(e.is_bind(), "{addr}: {e:?}");
            assert!(!e.is_io() && !e.is_disconnected(), "{addr}: {e:?}");
            assert!(e.to_string().contains(&addr), "{addr}: {e}");
        }
    }

    /// Regression: a client that sent half a request blocked
    /// `StatusServer::shutdown` without bound, and its connection stayed
    /// open for good; so did one that connected and sent nothing. The clock
    /// is paused: tokio moves it on whenever every task waits, so the
    /// server's timeouts fire without the test waiting for them.
    #[tokio::test(start_paused = true)]
    async fn no_client_holds_a_connection_or_the_shutdown_hostage() {
        let (node, _cache) = node_with_cache().await;
        let server = node.serve_status("127.0.0.1:0").await.unwrap();
        let addr = server.local_addr();
        let mut half = tokio::net::TcpStream::connect(addr).await.unwrap();
        half.write_all(b"GET /cache-sync/status HTTP/1.1\r\nHost: loc")
            .await
            .unwrap();
        let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
        for (what, stream) in [("half a request", &mut half), ("nothing", &mut silent)] {
            let mut rest = Vec::new();
            let closed = tokio::time::timeout(
                HEADER_READ_TIMEOUT + IDLE_TIMEOUT,
                stream.read_to_end(&mut rest),
            )
            .await;
            assert!(
                closed.is_ok(),
                "a client that sent {what} still holds its connection"
            );
        }
        // A third client, mid-request when shutdown starts, cannot stall it
        // past the grace period either.
        let mut stalled = tokio::net::TcpStream::connect(addr).await.unwrap();
        stalled
            .write_all(b"GET /healthz HTTP/1.1\r\n")
            .await
            .unwrap();
        tokio::task::yield_now().await;
        let started = tokio::time::Instant::now();
        tokio::time::timeout(SHUTDOWN_GRACE + HEADER_READ_TIMEOUT, server.shutdown())
            .await
            .expect("shutdown waited on a stalled client")
            .unwrap();
        assert!(started.elapsed() <= SHUTDOWN_GRACE + HEADER_READ_TIMEOUT);
    }

    /// What a probe may take on the paused clock: nothing times out on its
    /// way, so it is answered without the clock moving at all, where
    /// waiting for a slot took `HEADER_READ_TIMEOUT`.
    const PROBE_BOUND: Duration = Duration::from_secs(1);

    /// A server on a loopback port, run by `serve` itself so that a test
    /// chooses the router and sees how many connections were held at once.
    struct Running {
        addr: SocketAddr,
        peak: Arc<AtomicUsize>,
        stop: watch::Sender<bool>,
        task: JoinHandle<()>,
    }

    impl Running {
        async fn start(app: Router) -> Self {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let connections = Connections::default();
            let peak = connections.peak.clone();
            let (stop, stopped) = watch::channel(false);
            let task = tokio::spawn(serve(listener, app, stopped, connections));
            Self {
                addr,
                peak,
                stop,
                task,
            }
        }

        /// Stops the server; the most connections it held at once.
        async fn shutdown(self) -> usize {
            self.stop.send_replace(true);
            self.task.await.unwrap();
            self.peak.load(Ordering::Relaxed)
        }
    }

    /// `n` clients that each send `sent` (maybe nothing) and then wait.
    /// One that cannot get a socket fails the test: it must not pass
    /// without the flood it is about.
    async fn idle_clients(addr: SocketAddr, n: usize, sent: &[u8]) -> Vec<TcpStream> {
        let mut clients = Vec::with_capacity(n);
        for i in 0..n {
            let mut client = TcpStream::connect(addr).await.unwrap_or_else(|e| {
                panic!(
                    "client {i} of {n} could not connect ({e}): \
                     `ulimit -n` must allow {n} sockets and the server's"
                )
            });
            client.write_all(sent).await.unwrap();
            clients.push(client);
        }
        clients
    }

    /// `GET /livez` on a new connection: the answer, and how long it took.
    async fn probe(addr: SocketAddr) -> (String, Duration) {
        let started = tokio::time::Instant::now();
        let mut probe = TcpStream::connect(addr).await.unwrap();
        probe
            .write_all(b"GET /livez HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut response = String::new();
        tokio::time::timeout(
            HEADER_READ_TIMEOUT + IDLE_TIMEOUT,
            probe.read_to_string(&mut response),
        )
        .await
        .expect("the probe was never answered")
        .unwrap();
        (response, started.elapsed())
    }

    fn assert_answered_at_once((response, took): (String, Duration)) -> Duration {
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        assert!(took < PROBE_BOUND, "the probe was answered after {took:?}");
        took
    }

    /// How many of `clients` the server has closed.
    fn closed_by_server(clients: Vec<TcpStream>) -> usize {
        clients
            .into_iter()
            // Straight from the socket: tokio's view of its readiness may
            // lag.
            .map(|client| client.into_std().unwrap())
            .filter(|client| {
                let mut buf = [0; 1];
                match std::io::Read::read(&mut &*client, &mut buf) {
                    Ok(n) => n == 0,
                    Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                }
            })
            .count()
    }

    /// Issue 21, item 12: past the cap, a client takes the place of the
    /// silent client idle longest, and the cap still holds. Left in the
    /// listen queue until the silent ones time out, it would wait 6.5 s on
    /// average (17 s with 500 of them), and an orchestrator's probe with it.
    #[tokio::test(start_paused = true)]
    async fn a_client_past_the_cap_is_served_at_once_in_place_of_the_one_idle_longest() {
        let (node, _cache) = node_with_cache().await;
        let server = Running::start(router(node)).await;
        let mut silent = idle_clients(server.addr, MAX_CONNECTIONS, b"").await;
        let wall = std::time::Instant::now();
        let took = assert_answered_at_once(probe(server.addr).await);
        eprintln!(
            "probe past {MAX_CONNECTIONS} silent clients: {took:?} on the runtime's clock, {:?} on the wall",
            wall.elapsed()
        );
        let rest = silent.split_off(1);
        assert_eq!(closed_by_server(silent), 1, "the oldest was not shed");
        assert_eq!(closed_by_server(rest), 0, "another one was shed");
        assert!(server.shutdown().await <= MAX_CONNECTIONS + 1);
    }

    #[tokio::test(start_paused = true)]
    async fn two_thousand_silent_clients_neither_delay_a_probe_nor_pile_up() {
        const CLIENTS: usize = 2_000;
        let (node, _cache) = node_with_cache().await;
        let server = Running::start(router(node)).await;
        let silent = idle_clients(server.addr, CLIENTS, b"").await;
        let wall = std::time::Instant::now();
        let took = assert_answered_at_once(probe(server.addr).await);
        eprintln!(
            "probe past {CLIENTS} silent clients: {took:?} on the runtime's clock, {:?} on the wall",
            wall.elapsed()
        );
        assert!(closed_by_server(silent) >= CLIENTS - MAX_CONNECTIONS);
        let peak = server.shutdown().await;
        assert!(peak <= MAX_CONNECTIONS + 1, "held {peak} connections");
    }

    #[tokio::test(start_paused = true)]
    async fn clients_that_sent_half_a_head_do_not_delay_a_probe() {
        let (node, _cache) = node_with_cache().await;
        let server = Running::start(router(node)).await;
        let _slow = idle_clients(
            server.addr,
            MAX_CONNECTIONS,
            b"GET /cache-sync/status HTTP/1.1\r\nHost: loc",
        )
        .await;
        assert_answered_at_once(probe(server.addr).await);
        assert!(server.shutdown().await <= MAX_CONNECTIONS + 1);
    }

    /// A client that goes on opening connections while the probe is sent
    /// sheds the ones it opened before, not the probe's.
    #[tokio::test(start_paused = true)]
    async fn a_probe_is_answered_while_a_client_keeps_opening_connections() {
        const MORE: usize = 500;
        let (node, _cache) = node_with_cache().await;
        let server = Running::start(router(node)).await;
        let _silent = idle_clients(server.addr, MAX_CONNECTIONS, b"").await;
        let opened = Arc::new(AtomicUsize::new(0));
        let flood = tokio::spawn({
            let (addr, opened) = (server.addr, opened.clone());
            async move {
                let mut clients = Vec::with_capacity(MORE);
                for _ in 0..MORE {
                    clients.push(TcpStream::connect(addr).await.unwrap());
                    opened.fetch_add(1, Ordering::Relaxed);
                }
                clients
            }
        });
        while opened.load(Ordering::Relaxed) < MORE / 5 {
            tokio::task::yield_now().await;
        }
        assert_answered_at_once(probe(server.addr).await);
        assert!(
            opened.load(Ordering::Relaxed) < MORE,
            "the flood was over before the probe was answered"
        );
        let clients = flood.await.unwrap();
        assert!(closed_by_server(clients) >= MORE - MAX_CONNECTIONS);
        assert!(server.shutdown().await <= MAX_CONNECTIONS + 1);
    }

    /// A router whose `/hold` answers only once `release` has a permit for
    /// it; `held` counts the requests that reached it.
    fn holding_router(release: Arc<tokio::sync::Semaphore>, held: Arc<AtomicUsize>) -> Router {
        Router::new()
            .route(
                "/hold",
                axum::routing::get(move || async move {
                    held.fetch_add(1, Ordering::Relaxed);
                    release.acquire().await.unwrap().forget();
                    "released"
                }),
            )
            .route("/livez", axum::routing::get(|| async { "alive" }))
    }

    /// `n` keep-alive clients, each with a `/hold` request in flight.
    async fn held_clients(addr: SocketAddr, n: usize, held: &AtomicUsize) -> Vec<TcpStream> {
        let clients = idle_clients(addr, n, b"GET /hold HTTP/1.1\r\nHost: localhost\r\n\r\n").await;
        while held.load(Ordering::Relaxed) < n {
            tokio::task::yield_now().await;
        }
        clients
    }

    /// Reads a `/hold` response off a keep-alive connection.
    async fn released(client: &mut TcpStream) -> String {
        let mut response = Vec::new();
        while !response.ends_with(b"released") {
            let mut buf = [0; 1024];
            let n = client.read(&mut buf).await.unwrap_or(0);
            assert!(
                n > 0,
                "closed before its response: {:?}",
                String::from_utf8_lossy(&response)
            );
            response.extend_from_slice(&buf[..n]);
        }
        String::from_utf8(response).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_with_a_request_in_flight_is_not_shed() {
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let held = Arc::new(AtomicUsize::new(0));
        let server = Running::start(holding_router(release.clone(), held.clone())).await;
        // The oldest connection, so the first to go were it taken for idle.
        let mut busy = held_clients(server.addr, 1, &held).await;
        let _silent = idle_clients(server.addr, 2 * MAX_CONNECTIONS, b"").await;
        assert_answered_at_once(probe(server.addr).await);
        release.add_permits(1);
        assert!(released(&mut busy[0]).await.starts_with("HTTP/1.1 200"));
        assert!(server.shutdown().await <= MAX_CONNECTIONS + 1);
    }

    /// The one wait left: while every connection has a request in flight, a
    /// new one waits until one of them is answered, and is then served.
    #[tokio::test(start_paused = true)]
    async fn while_every_connection_is_busy_a_new_one_waits_for_an_answer() {
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let held = Arc::new(AtomicUsize::new(0));
        let server = Running::start(holding_router(release.clone(), held.clone())).await;
        let mut busy = held_clients(server.addr, MAX_CONNECTIONS, &held).await;
        let mut waiting = tokio::spawn(probe(server.addr));
        assert!(
            tokio::time::timeout(SHUTDOWN_GRACE, &mut waiting)
                .await
                .is_err(),
            "served while every connection was busy"
        );
        let released_at = tokio::time::Instant::now();
        release.add_permits(1);
        let (response, _) = waiting.await.unwrap();
        assert_answered_at_once((response, released_at.elapsed()));
        // The one answered first got its answer whole, then made room; the
        // others were left alone.
        release.add_permits(MAX_CONNECTIONS - 1);
        for client in &mut busy {
            assert!(released(client).await.starts_with("HTTP/1.1 200"));
        }
        assert!(server.shutdown().await <= MAX_CONNECTIONS + 1);
    }

    #[test]
    fn the_connection_idle_longest_is_shed_never_a_busy_one() {
        let idleness = Arc::new(Idleness::default());
        let [first, second, third] = [(); 3].map(|()| Arc::new(Activity::new(idleness.clone())));
        let all = || [&*first, &*second, &*third];
        assert_eq!(longest_idle(all()).map(|(i, _)| i), Some(0));
        let request = first.busy();
        let (i, since) = longest_idle(all()).unwrap();
        assert_eq!(i, 1, "a busy connection was picked");
        // Busy between being picked and being shed: kept.
        let another = second.busy();
        assert!(!second.shed(since));
        drop(another);
        // Answered now, so idle for less time than the third.
        drop(request);
        let (i, since) = longest_idle(all()).unwrap();
        assert_eq!(i, 2);
        assert!(third.shed(since));
        let _busy = [first.busy(), second.busy()];
        assert_eq!(longest_idle(all()), None);
    }

    /// With the cap, busy keep-alive clients (which never go idle) could
    /// hold every slot for good, so a connection is closed once it is
    /// `MAX_CONNECTION_AGE` old, after the request in flight.
    #[tokio::test(start_paused = true)]
    async fn a_busy_keep_alive_connection_is_closed_when_it_is_old() {
        let (node, _cache) = node_with_cache().await;
        let server = node.serve_status("127.0.0.1:0").await.unwrap();
        let mut stream = tokio::net::TcpStream::connect(server.local_addr())
            .await
            .unwrap();
        let opened = tokio::time::Instant::now();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let sent = stream
                .write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
                .await;
            // A response, or the end of the connection.
            let n = match sent {
                Ok(()) => stream.read(&mut buf).await.unwrap_or(0),
                Err(_) => 0,
            };
            if n == 0 {
                break;
            }
            assert!(
                opened.elapsed() <= MAX_CONNECTION_AGE + IDLE_TIMEOUT,
                "a busy connection was kept for {:?}",
                opened.elapsed()
            );
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
        assert!(opened.elapsed() >= MAX_CONNECTION_AGE);
        server.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn serves_on_a_loopback_listener() {
        let (node, _cache) = node_with_cache().await;
        let server = node.serve_status("127.0.0.1:0").await.unwrap();
        let addr = server.local_addr();
        assert!(addr.ip().is_loopback());
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(
                b"GET /cache-sync/status HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
            )
            .await
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        assert!(response.contains("\"node_id\":\"node-7\""), "{response}");
        server.shutdown().await.unwrap();
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "still listening after shutdown"
        );
    }
}
