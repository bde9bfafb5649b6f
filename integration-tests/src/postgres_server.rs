//! A PostgreSQL server of the test's own, with `wal_level = logical`, in a
//! temporary directory on a free loopback port, that the test can kill,
//! stop and restart.
//!
//! The machine's shared server runs with `wal_level = replica`, and a
//! change of `wal_level` needs a restart: the CDC tests cannot use it. This
//! one comes from the Debian `postgresql-15` package's server binaries
//! (`initdb`, `postgres`, in `/usr/lib/postgresql/15/bin`, or on `PATH`).
//! As root (CI), they run as the `postgres` user: they refuse root.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::process::{ServerProcess, says_port_taken, start_on_free_ports, try_signal};
use crate::redis_server::free_port;

const MISSING: &str = "PostgreSQL's server binaries (initdb, postgres) were not found in \
     /usr/lib/postgresql/15/bin nor on PATH. Install them (Debian: `apt-get install postgresql-15`); \
     ./scripts/test installs them when they are missing";

/// A running server, killed on drop.
#[derive(Debug)]
pub struct PostgresServer {
    port: u16,
    dir: tempfile::TempDir,
    process: ServerProcess,
    /// Where this start's part of the log begins.
    log_from: usize,
    /// `-c name=value` settings after the harness's own.
    settings: Vec<String>,
    /// A start that fails is the test's to see (`restart_with`), not a
    /// panic.
    refusal_expected: bool,
}

fn bin(name: &str) -> PathBuf {
    let debian = Path::new("/usr/lib/postgresql/15/bin").join(name);
    if debian.exists() {
        return debian;
    }
    PathBuf::from(name)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

/// `program` as a command, run as `postgres` when this process is root.
fn command(program: &str) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin(program));
        c
    } else {
        Command::new(bin(program))
    }
}

impl PostgresServer {
    /// `initdb`, then starts the server.
    pub fn start() -> Self {
        Self::start_with(&[], &[])
    }

    /// [`start`](Self::start) with extra `initdb` arguments (say,
    /// `--wal-segsize=1`) and `name=value` settings.
    pub fn start_with(initdb: &[&str], settings: &[&str]) -> Self {
        start_on_free_ports("postgres", || {
            let dir = tempfile::tempdir().expect("temp dir for postgres");
            if is_root() {
                let ok = Command::new("chown")
                    .args(["-R", "postgres:postgres"])
                    .arg(dir.path())
                    .status()
                    .is_ok_and(|s| s.success());
                assert!(ok, "chown of the temp dir to the postgres user failed");
            }
            let out = match command("initdb")
                .arg("-D")
                .arg(dir.path().join("data"))
                .args([
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "-E",
                    "UTF8",
                    "--no-locale",
                    "--no-sync",
                ])
                .args(initdb)
                .stdin(Stdio::null())
                .output()
            {
                Ok(o) => o,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{MISSING}"),
                Err(e) => panic!("cannot run initdb: {e}"),
            };
            assert!(
                out.status.success(),
                "initdb failed: {}{}\n{MISSING}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            // Epoch 1: transaction ids past the first 2^32, as on any
            // server that has run for long, so that 32-bit xids off the
            // stream must be widened right (an epoch-0 server hides it).
            let out = command("pg_resetwal")
                .args(["-e", "1", "-D"])
                .arg(dir.path().join("data"))
                .stdin(Stdio::null())
                .output()
                .unwrap_or_else(|e| panic!("cannot run pg_resetwal: {e}"));
            assert!(
                out.status.success(),
                "pg_resetwal failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let mut server = Self {
                port: free_port(),
                dir,
                process: ServerProcess::default(),
                log_from: 0,
                settings: settings.iter().map(|s| (*s).to_owned()).collect(),
                refusal_expected: false,
            };
            server.spawn().map(|()| server)
        })
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("postgres.log")
    }

    fn spawn(&mut self) -> Result<(), String> {
        self.log_from = self.log().len();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("log file");
        let mut cmd = command("postgres");
        cmd.arg("-D")
            .arg(self.data())
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(self.dir.path())
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "wal_level=logical",
                "-c",
                "max_replication_slots=16",
                "-c",
                "max_wal_senders=16",
                "-c",
                "max_connections=200",
                // A walsender whose relay vanished without closing its
                // connection frees the slot after this long.
                "-c",
                "wal_sender_timeout=5s",
                "-c",
                "fsync=off",
                "-c",
                "logging_collector=off",
            ])
            .args(self.settings.iter().flat_map(|s| ["-c", s.as_str()]))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log);
        let child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{MISSING}"),
            Err(e) => panic!("cannot start postgres: {e}"),
        };
        self.process.set(child);
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let log = self.log();
            let this_start = log.get(self.log_from..).unwrap_or_default();
            if this_start.contains("database system is ready to accept connections")
                && std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
            {
                return Ok(());
            }
            if let Some(status) = self.process.exited() {
                if says_port_taken(this_start) {
                    return Err(format!("port {} was taken", self.port));
                }
                // The backends of a killed postmaster still hold its
                // shared memory for a moment.
                if this_start.contains("pre-existing shared memory block") {
                    return Err("the previous server's backends are still exiting".to_owned());
                }
                if self.refusal_expected {
                    return Err(format!("postgres exited with {status}; log:\n{this_start}"));
                }
                panic!("postgres exited with {status}; log:\n{log}");
            }
            assert!(
                Instant::now() < deadline,
                "postgres did not start in 30 s; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The postmaster's pid (the first line of `postmaster.pid`).
    fn postmaster(&self) -> Option<u32> {
        std::fs::read_to_string(self.data().join("postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }

    fn wait_gone(&mut self, pid: Option<u32>) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while pid.is_some_and(|p| Path::new(&format!("/proc/{p}")).exists()) {
            assert!(Instant::now() < deadline, "postgres did not exit in 30 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        self.process.kill();
    }

    /// `kill -9` of the postmaster: its backends notice and exit, and the
    /// next start recovers from the log.
    pub fn kill(&mut self) {
        let pid = self.postmaster();
        if let Some(p) = pid {
            try_signal("-KILL", p);
        }
        self.wait_gone(pid);
    }

    /// A fast shutdown (SIGINT): clients are disconnected, the server
    /// checkpoints and exits.
    pub fn stop(&mut self) {
        let pid = self.postmaster();
        if let Some(p) = pid {
            try_signal("-INT", p);
        }
        self.wait_gone(pid);
    }

    /// A fast shutdown, then a start with `settings` (`name=value`) added,
    /// for this start only: `Err` with what the server logged when it
    /// refuses to start with them (it exits), as PostgreSQL does for
    /// settings its data cannot run with.
    pub fn restart_with(&mut self, settings: &[&str]) -> Result<(), String> {
        self.stop();
        let kept = self.settings.clone();
        self.settings
            .extend(settings.iter().map(|s| (*s).to_owned()));
        self.refusal_expected = true;
        let started = self.spawn();
        self.refusal_expected = false;
        self.settings = kept;
        started
    }

    /// Starts again on the same port and data: after `kill`, once the old
    /// backends have gone (their shared memory blocks a new postmaster).
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match self.spawn() {
                Ok(()) => return,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("postgres restart: {e}; trying again");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => panic!("postgres restart: {e}"),
            }
        }
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        if let Some(p) = self.postmaster() {
            try_signal("-KILL", p);
        }
    }
}
