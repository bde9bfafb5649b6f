//! A `redis-server` of the test's own, on a free loopback port, that the test
//! can kill, restart on the same data, pause, and cut connections to.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};

pub use crate::process::signal;
use crate::process::{ServerProcess, says_port_taken, start_on_free_ports};
use std::time::{Duration, Instant};

/// A running `redis-server`, stopped on drop.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    dir: tempfile::TempDir,
    extra: Vec<String>,
    process: ServerProcess,
}

const MISSING: &str = "redis-server is not on PATH. Install it (Debian: `apt-get install redis-server`); \
                       ./scripts/test installs it when it is missing";

impl RedisServer {
    /// Starts a server with persistence on (append-only file, fsync always),
    /// so a `kill -9` and restart keep every acknowledged write.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a server with extra `redis-server` arguments.
    pub fn start_with(extra: &[&str]) -> Self {
        Self::start_made(|| extra.iter().map(|s| (*s).to_owned()).collect())
    }

    /// Starts a server in cluster mode, not yet in any cluster: its cluster
    /// bus on a free port of its own (not the default port + 10000, which
    /// may be taken or past 65535), `node_timeout_ms` before its peers
    /// count it failed. See `redis_cluster`.
    pub fn start_cluster_node(node_timeout_ms: u64) -> Self {
        Self::start_made(|| {
            // Taken by the time the server binds it: the server's log says
            // so, and the start is tried again on other ports.
            let bus = free_port();
            vec![
                "--cluster-enabled".into(),
                "yes".into(),
                "--cluster-config-file".into(),
                "nodes.conf".into(),
                "--cluster-node-timeout".into(),
                node_timeout_ms.to_string(),
                "--cluster-port".into(),
                bus.to_string(),
            ]
        })
    }

    /// Starts a server with the arguments `extra()` makes, fresh for each
    /// try on other ports.
    fn start_made(mut extra: impl FnMut() -> Vec<String>) -> Self {
        start_on_free_ports("redis-server", || {
            let mut server = Self {
                port: free_port(),
                dir: tempfile::tempdir().expect("temp dir for redis-server"),
                extra: extra(),
                process: ServerProcess::default(),
            };
            server.spawn().map(|()| server)
        })
    }

    /// Starts the server on its port; `Err` when another process has it.
    fn spawn(&mut self) -> Result<(), String> {
        let log = std::fs::File::create(self.dir.path().join("redis.log")).expect("log file");
        let mut cmd = Command::new("redis-server");
        cmd.args([
            "--port",
            &self.port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ])
        .args([
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--daemonize",
            "no",
        ])
        .arg("--dir")
        .arg(self.dir.path())
        .args(&self.extra)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log file"))
        .stderr(log);
        let child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{MISSING}"),
            Err(e) => panic!("cannot start redis-server: {e}"),
        };
        self.process.set(child);
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if self
                .command(&["PING"])
                .is_ok_and(|r| r.starts_with("+PONG"))
            {
                // Another test's server may answer on a port taken from
                // under this one.
                let ours = self
                    .process
                    .pid()
                    .map(|pid| format!("process_id:{pid}\r\n"));
                return match self.info_server() {
                    Ok(info) if ours.is_some_and(|p| info.contains(&p)) => Ok(()),
                    _ => {
                        self.process.kill();
                        Err(format!("another server answers on port {}", self.port))
                    }
                };
            }
            if let Some(status) = self.process.exited() {
                let log = self.log();
                if says_port_taken(&log) {
                    return Err(format!("port {} was taken", self.port));
                }
                panic!("redis-server exited with {status}; log:\n{log}");
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not answer PING in 10 s; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }

    /// The CPU time (user and system) the server has used so far, from
    /// `/proc`; `None` when it is not running.
    pub fn cpu_time(&self) -> Option<std::time::Duration> {
        crate::process::cpu_time(self.process.pid()?)
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether its process runs (it may be paused): not killed, not exited.
    pub fn is_running(&mut self) -> bool {
        self.process.pid().is_some() && self.process.exited().is_none()
    }

    /// Its cluster bus port, for a cluster node.
    pub fn cluster_bus_port(&self) -> Option<u16> {
        let at = self.extra.iter().position(|a| a == "--cluster-port")?;
        self.extra.get(at + 1)?.parse().ok()
    }

    /// `CONFIG SET name value` now, and the same argument on every later
    /// start ([`RedisServer::restart`]).
    pub fn configure(&mut self, name: &str, value: &str) {
        match self.query(&["CONFIG", "SET", name, value]) {
            Ok(Reply::Status(s)) if s == "OK" => {}
            other => panic!("CONFIG SET {name} {value} answered {other:?}"),
        }
        self.extra.push(format!("--{name}"));
        self.extra.push(value.to_owned());
    }

    /// Its loopback address, for a proxy in front of it.
    pub fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `redis://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The data directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `kill -9`: no shutdown, no goodbye to clients.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// Starts again on the same port and data directory.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn().unwrap_or_else(|e| panic!("redis-server: {e}"));
    }

    /// `kill -9`, then starts again on the same port with no data at all: a
    /// server that lost its disk, or one without persistence.
    pub fn wipe(&mut self) {
        self.kill();
        for entry in std::fs::read_dir(self.dir.path())
            .expect("redis dir")
            .flatten()
        {
            if entry.file_name() == "redis.log" {
                continue;
            }
            let path = entry.path();
            let _ = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
        }
        self.spawn().unwrap_or_else(|e| panic!("redis-server: {e}"));
    }

    /// SIGSTOP: the server holds connections open but answers nothing.
    pub fn pause(&self) {
        self.process.pause();
    }

    /// SIGCONT.
    pub fn resume(&self) {
        self.process.resume();
    }

    /// Closes every client connection of a type (`normal`, `pubsub`), as
    /// `CLIENT KILL TYPE` does. Returns how many were closed.
    pub fn kill_clients(&self, kind: &str) -> u64 {
        let reply = self
            .command(&["CLIENT", "KILL", "TYPE", kind])
            .expect("CLIENT KILL");
        reply.trim_start_matches(':').trim().parse().unwrap_or(0)
    }

    /// `INFO server`, whole.
    fn info_server(&self) -> std::io::Result<String> {
        match self.query(&["INFO", "server"])? {
            Reply::Bulk(Some(body)) => Ok(String::from_utf8_lossy(&body).into_owned()),
            other => Err(std::io::Error::other(format!("INFO answered {other:?}"))),
        }
    }

    /// Runs one command and returns its whole reply, parsed.
    pub fn query(&self, args: &[&str]) -> std::io::Result<Reply> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        stream.write_all(&request(args))?;
        read_reply(&mut BufReader::new(&mut stream))
    }

    /// Runs one command and returns the first line of the reply (enough for
    /// status, integer and error replies).
    pub fn command(&self, args: &[&str]) -> std::io::Result<String> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        stream.write_all(&request(args))?;
        let mut line = String::new();
        BufReader::new(&mut stream).read_line(&mut line)?;
        Ok(line.trim_end().to_owned())
    }
}

/// A command as RESP: an array of bulk strings.
fn request(args: &[&str]) -> Vec<u8> {
    let mut req = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        req.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        req.extend_from_slice(a.as_bytes());
        req.extend_from_slice(b"\r\n");
    }
    req
}

/// A RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Status(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
}

impl Reply {
    /// A status or bulk reply as text.
    pub fn text(&self) -> Option<String> {
        match self {
            Reply::Status(s) => Some(s.clone()),
            Reply::Bulk(Some(b)) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        }
    }

    /// An array reply's elements (none for a nil or non-array reply).
    pub fn items(&self) -> &[Reply] {
        match self {
            Reply::Array(Some(items)) => items,
            _ => &[],
        }
    }
}

/// Reads one RESP2 reply.
fn read_reply(r: &mut impl BufRead) -> std::io::Result<Reply> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(std::io::Error::other("connection closed before a reply"));
    }
    let line = line.trim_end_matches(['\r', '\n']);
    let (kind, rest) = line.split_at(line.len().min(1));
    let number = || {
        rest.parse::<i64>()
            .map_err(|_| std::io::Error::other(format!("not a RESP length: {line:?}")))
    };
    Ok(match kind {
        "+" => Reply::Status(rest.to_owned()),
        "-" => Reply::Error(rest.to_owned()),
        ":" => Reply::Int(number()?),
        "$" => match usize::try_from(number()?) {
            Err(_) => Reply::Bulk(None),
            Ok(len) => {
                let mut body = vec![0; len + 2];
                r.read_exact(&mut body)?;
                body.truncate(len);
                Reply::Bulk(Some(body))
            }
        },
        "*" => match usize::try_from(number()?) {
            Err(_) => Reply::Array(None),
            Ok(n) => Reply::Array(Some(
                (0..n)
                    .map(|_| read_reply(r))
                    .collect::<std::io::Result<_>>()?,
            )),
        },
        _ => return Err(std::io::Error::other(format!("not a RESP reply: {line:?}"))),
    })
}

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local addr").port()
}

/// The rate of a `redis-benchmark` run, from its summary line ("  throughput
/// summary: 69686.41 requests per second"); `None` without one. For the
/// benches that compare against `redis-benchmark`.
pub fn requests_per_second(stdout: &[u8]) -> Option<f64> {
    let text = String::from_utf8_lossy(stdout);
    text.split(['\r', '\n'])
        .filter_map(|l| {
            let before = l.split_once("requests per second")?.0;
            before.split_whitespace().next_back()?.parse::<f64>().ok()
        })
        .next_back()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A port another server holds is reported as taken (for a start on
    /// other ports), never taken for this server's: whichever comes first,
    /// the bind failing or the other server answering the probe.
    #[test]
    fn a_taken_port_is_noticed() {
        let other = RedisServer::start();
        let mut second = RedisServer {
            port: other.port,
            dir: tempfile::tempdir().expect("temp dir"),
            extra: Vec::new(),
            process: ServerProcess::default(),
        };
        let taken = second.spawn();
        assert!(taken.is_err(), "started on a port another server holds");
        assert!(
            other.command(&["PING"]).is_ok_and(|r| r == "+PONG"),
            "the other server was disturbed"
        );
    }

    #[test]
    fn a_redis_benchmark_rate_is_read_from_its_summary_line() {
        let out = b"XADD: rps=0.0\r  throughput summary: 69686.41 requests per second\n  latency summary\n";
        assert_eq!(requests_per_second(out), Some(69686.41));
        assert_eq!(requests_per_second(b"Could not connect\n"), None);
        assert_eq!(requests_per_second(b""), None);
    }
}
