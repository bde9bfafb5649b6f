//! A MariaDB server of the test's own, with a row-based binary log, in a
//! temporary directory on a free loopback port, that the test can kill,
//! stop, restart, and whose binary logs it can purge.
//!
//! The machine's shared server (127.0.0.1:3306) keeps no binary log, and
//! turning one on needs a restart and its configuration: the binlog tests
//! (issue 39) cannot use it. This one comes from the Debian
//! `mariadb-server` package's binaries (`mariadb-install-db`, `mariadbd`,
//! and the `mariadb` client for the harness's own statements). As root (CI)
//! the server is told to run as root, which it refuses otherwise.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::process::{ServerProcess, says_port_taken, start_on_free_ports, try_signal};
use crate::redis_server::free_port;

const MISSING: &str = "MariaDB's binaries (mariadb-install-db, mariadbd, mariadb) were not found \
     on PATH nor in /usr/sbin. Install them (Debian: `apt-get install mariadb-server`); \
     ./scripts/test installs them when they are missing";

/// A running server, killed on drop.
#[derive(Debug)]
pub struct MariaDbServer {
    port: u16,
    dir: tempfile::TempDir,
    process: ServerProcess,
    /// Where this start's part of the log begins.
    log_from: usize,
}

fn bin(name: &str) -> PathBuf {
    let sbin = PathBuf::from("/usr/sbin").join(name);
    if sbin.exists() {
        return sbin;
    }
    PathBuf::from(name)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

/// The server's own options: nothing read from the machine's
/// configuration files (`--no-defaults` comes first), its files in `dir`.
fn own_files(dir: &std::path::Path) -> Vec<String> {
    let mut args = vec![
        "--no-defaults".to_owned(),
        format!("--datadir={}", dir.join("data").display()),
    ];
    if is_root() {
        args.push("--user=root".to_owned());
    }
    args
}

/// A new data directory with its system tables. Installs run one at a
/// time in a process and are tried again once: two at once have failed
/// here in the bootstrap (`Unknown table 'mysql.tmp_user_sys'`).
fn install() -> tempfile::TempDir {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut last = String::new();
    for _ in 0..3 {
        let dir = tempfile::tempdir().expect("temp dir for mariadb");
        let out = match Command::new(bin("mariadb-install-db"))
            .args(own_files(dir.path()))
            .args([
                // root over TCP without a password, as on the machine's
                // shared server.
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ])
            .stdin(Stdio::null())
            .output()
        {
            Ok(o) => o,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{MISSING}"),
            Err(e) => panic!("cannot run mariadb-install-db: {e}"),
        };
        if out.status.success() {
            return dir;
        }
        last = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    panic!("mariadb-install-db failed three times: {last}\n{MISSING}");
}

impl MariaDbServer {
    /// A new data directory (`mariadb-install-db`), then the server.
    pub fn start() -> Self {
        start_on_free_ports("mariadb", || {
            let dir = install();
            let mut server = Self {
                port: free_port(),
                dir,
                process: ServerProcess::default(),
                log_from: 0,
            };
            server.spawn().map(|()| server)
        })
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("mariadb.log")
    }

    fn pid_path(&self) -> PathBuf {
        self.dir.path().join("mariadb.pid")
    }

    fn spawn(&mut self) -> Result<(), String> {
        self.log_from = self.log().len();
        let dir = self.dir.path();
        let mut cmd = Command::new(bin("mariadbd"));
        cmd.args(own_files(dir))
            .arg(format!("--port={}", self.port))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--socket={}", dir.join("mariadb.sock").display()))
            .arg(format!("--pid-file={}", self.pid_path().display()))
            .arg(format!("--log-error={}", self.log_path().display()))
            // What a binlog reader needs: every committed row change, whole.
            .arg(format!("--log-bin={}", dir.join("binlog").display()))
            .args([
                "--binlog-format=ROW",
                "--binlog-row-image=FULL",
                // Column names in every table map: a binlog relay reads
                // columns by name.
                "--binlog-row-metadata=FULL",
                "--server-id=1",
                "--skip-name-resolve",
                // Small: a test server holds a few tables.
                "--innodb-buffer-pool-size=16M",
                "--max-connections=200",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{MISSING}"),
            Err(e) => panic!("cannot start mariadbd: {e}"),
        };
        self.process.set(child);
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let log = self.log();
            let this_start = log.get(self.log_from..).unwrap_or_default();
            if this_start.contains("ready for connections")
                && std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
            {
                return Ok(());
            }
            if let Some(status) = self.process.exited() {
                if says_port_taken(this_start) || this_start.contains("Do you already have another")
                {
                    return Err(format!("port {} was taken", self.port));
                }
                panic!("mariadbd exited with {status}; log:\n{log}");
            }
            assert!(
                Instant::now() < deadline,
                "mariadbd did not start in 60 s; log:\n{log}"
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

    /// `mysql://root@127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/", self.port)
    }

    /// Runs `sql` (one or more statements) with the `mariadb` client over
    /// TCP, as root: the rows it returned, tab-separated, one per line,
    /// without column names; `Err` with the client's message when a
    /// statement fails.
    pub fn sql(&self, sql: &str) -> Result<String, String> {
        let out = match Command::new(bin("mariadb"))
            .args([
                "--no-defaults",
                "--protocol=TCP",
                "-h",
                "127.0.0.1",
                "-u",
                "root",
            ])
            .arg(format!("--port={}", self.port))
            .args(["--batch", "--skip-column-names", "-e", sql])
            .stdin(Stdio::null())
            .output()
        {
            Ok(o) => o,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{MISSING}"),
            Err(e) => panic!("cannot run mariadb: {e}"),
        };
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
        }
    }

    /// The binary logs the server holds, oldest first.
    pub fn binlogs(&self) -> Vec<String> {
        self.sql("SHOW BINARY LOGS")
            .unwrap_or_else(|e| panic!("SHOW BINARY LOGS: {e}"))
            .lines()
            .filter_map(|l| l.split('\t').next().map(str::to_owned))
            .collect()
    }

    /// Starts a new binary log and deletes every older one, as an operator
    /// (or `binlog_expire_logs_seconds`) would: a reader's position in them
    /// is gone.
    ///
    /// The server keeps a log a replica's dump thread still reads, and
    /// such a thread outlives its reader until the server next writes to
    /// it: this tries again for up to 20 s until only the newest log is
    /// left.
    pub fn purge_binlogs(&self) {
        self.sql("FLUSH BINARY LOGS")
            .unwrap_or_else(|e| panic!("FLUSH BINARY LOGS: {e}"));
        let newest = self.binlogs().pop().expect("a binary log after a flush");
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            self.sql(&format!("PURGE BINARY LOGS TO '{newest}'"))
                .unwrap_or_else(|e| panic!("PURGE BINARY LOGS: {e}"));
            let left = self.binlogs();
            if left == [newest.clone()] {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the server kept binary logs {left:?} (a dump thread reads them?)"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The server's pid, from its pid file.
    fn pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.pid_path())
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    fn wait_gone(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.process.exited().is_none() {
            assert!(Instant::now() < deadline, "mariadbd did not exit in 60 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        self.process.kill();
    }

    /// `kill -9`: the next start recovers from InnoDB's log, and the
    /// binary log is cut where the kill found it.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// A clean shutdown (SIGTERM): clients are disconnected, the server
    /// flushes and exits.
    pub fn stop(&mut self) {
        if let Some(p) = self.process.pid().or_else(|| self.pid()) {
            try_signal("-TERM", p);
        }
        self.wait_gone();
    }

    /// `kill -9`, then a start on the same port and data.
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match self.spawn() {
                Ok(()) => return,
                // The killed server's port may linger a moment.
                Err(e) if Instant::now() < deadline => {
                    eprintln!("mariadb restart: {e}; trying again");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => panic!("mariadb restart: {e}"),
            }
        }
    }

    /// SIGSTOP: it keeps its connections open and answers nothing.
    pub fn pause(&self) {
        self.process.pause();
    }

    /// SIGCONT.
    pub fn resume(&self) {
        self.process.resume();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The harness's own promises: a row-based binary log with the row
    /// changes in it, data that survives a `kill -9` and a clean stop,
    /// binary logs purged on request, and a paused server that answers
    /// again once resumed.
    #[test]
    fn a_server_with_a_row_binlog_that_survives_kills_and_purges() {
        let mut server = MariaDbServer::start();
        assert_eq!(
            server
                .sql("SELECT @@log_bin, @@binlog_format, @@binlog_row_image, @@server_id")
                .unwrap(),
            "1\tROW\tFULL\t1\n"
        );
        server
            .sql(
                "CREATE DATABASE app; \
                 CREATE TABLE app.dict (k VARCHAR(64) PRIMARY KEY, v TEXT) \
                 ENGINE=InnoDB DEFAULT CHARSET=utf8mb4; \
                 INSERT INTO app.dict VALUES ('de', 'Deutschland')",
            )
            .unwrap();
        let first = server.binlogs().last().cloned().expect("a binary log");
        let events = server
            .sql(&format!("SHOW BINLOG EVENTS IN '{first}'"))
            .unwrap();
        assert!(
            events.contains("Write_rows"),
            "row events in the binlog:\n{events}"
        );

        server.kill();
        server.restart();
        assert_eq!(
            server.sql("SELECT v FROM app.dict").unwrap(),
            "Deutschland\n"
        );
        server.stop();
        server.restart();
        assert_eq!(
            server.sql("SELECT v FROM app.dict").unwrap(),
            "Deutschland\n"
        );

        let before = server.binlogs();
        server.purge_binlogs();
        let after = server.binlogs();
        assert_eq!(after.len(), 1, "{after:?}");
        assert!(
            !before.contains(&after[0]),
            "a new log after the purge: {before:?} -> {after:?}"
        );
        assert!(
            server
                .sql(&format!("SHOW BINLOG EVENTS IN '{}'", before[0]))
                .is_err(),
            "the purged log is gone"
        );

        server.pause();
        let answered = std::thread::scope(|s| {
            let asked = s.spawn(|| server.sql("SELECT 1"));
            std::thread::sleep(Duration::from_millis(300));
            let early = asked.is_finished();
            server.resume();
            (early, asked.join().unwrap())
        });
        assert!(!answered.0, "a paused server answered");
        assert_eq!(answered.1.unwrap(), "1\n");
        assert!(server.log().contains("ready for connections"));
        assert!(server.url().starts_with("mysql://root@127.0.0.1:"));
        assert_ne!(server.port(), 0);
    }
}
