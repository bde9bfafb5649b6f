//! The replication session's settings, read from the relay's database
//! address as sqlx reads it for the pool: host, user, password and TLS.

use std::time::Duration;

use pgwire_replication::{ReplicationConfig, SslMode, TlsConfig};

use super::slot;
use crate::error::{Error, Result};

/// Messages the replication client reads ahead of the relay. With
/// `max_row_bytes` this bounds what it holds: 128 × 8 MiB by default.
const READ_AHEAD: usize = 128;

/// The replication session's settings, from the same address the SQL pool
/// uses.
pub(super) fn replication_config(
    url: &str,
    options: &sqlx::postgres::PgConnectOptions,
    slot: &str,
    publication: &str,
) -> Result<ReplicationConfig> {
    use sqlx::postgres::PgSslMode;
    let bad = |why: String| Error::Config(format!("the relay's database address: {why}"));
    // Host, port, user, database and TLS mode as sqlx read them (the
    // address, then PGHOST, PGPORT, PGUSER, PGDATABASE, PGSSLMODE), so
    // both connections go to the same place the same way. sqlx does not
    // give the password back: it is read here, from the address, its
    // `password` parameter or PGPASSWORD (not ~/.pgpass).
    let parsed = url::Url::parse(url).map_err(|e| bad(e.to_string()))?;
    if !matches!(parsed.scheme(), "postgres" | "postgresql") {
        return Err(bad(format!(
            "scheme {:?}, not postgres://",
            parsed.scheme()
        )));
    }
    // sqlx takes a mode it does not know for its default; a typo must not
    // turn verification off.
    if let Some((_, mode)) = parsed.query_pairs().find(|(k, _)| k == "sslmode")
        && !matches!(
            &*mode,
            "disable" | "allow" | "prefer" | "require" | "verify-ca" | "verify-full"
        )
    {
        return Err(bad(format!("unknown sslmode {mode:?}")));
    }
    // Read as sqlx reads it for the pool, so both connections log in with
    // the same password: the address's, %-decoded (an escape that is not
    // one stays as written), unless a `password` parameter follows (the
    // last one), then PGPASSWORD.
    let in_address = match parsed.password() {
        Some(p) => Some(
            percent_encoding::percent_decode_str(p)
                .decode_utf8()
                .map_err(|_| bad("the password is not UTF-8 once %-decoded".into()))?
                .into_owned(),
        ),
        None => None,
    };
    let in_query = parsed
        .query_pairs()
        .filter(|(k, _)| k == "password")
        .last()
        .map(|(_, v)| v.into_owned());
    let password = in_query
        .or(in_address)
        .unwrap_or_else(|| std::env::var("PGPASSWORD").unwrap_or_default());
    let host = match options.get_socket() {
        Some(dir) => dir.to_string_lossy().into_owned(),
        None => options.get_host().to_owned(),
    };
    let mut tls = TlsConfig::disabled();
    tls.mode = match options.get_ssl_mode() {
        PgSslMode::Disable => SslMode::Disable,
        PgSslMode::Allow | PgSslMode::Prefer => SslMode::Prefer,
        PgSslMode::Require => SslMode::Require,
        PgSslMode::VerifyCa => SslMode::VerifyCa,
        PgSslMode::VerifyFull => SslMode::VerifyFull,
    };
    let root = parsed
        .query_pairs()
        .find(|(k, _)| k == "sslrootcert")
        .map(|(_, v)| v.into_owned())
        .or_else(|| std::env::var("PGSSLROOTCERT").ok());
    tls.ca_pem_path = root.map(Into::into);
    let user = options.get_username().to_owned();
    let database = options.get_database().unwrap_or(&user).to_owned();
    Ok(
        ReplicationConfig::new(host, user, password, database, slot, publication)
            .with_port(options.get_port())
            .with_tls(tls)
            // The confirmed position reaches the server within 200 ms of
            // a publish: a takeover publishes again at most that much.
            .with_status_interval(Duration::from_millis(200))
            .with_wakeup_interval(Duration::from_secs(1))
            .with_buffer_size(READ_AHEAD)
            .with_application_name(slot::APPLICATION_NAME),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(url: &str) -> ReplicationConfig {
        let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
        replication_config(url, &options, "s", "p").unwrap()
    }

    #[test]
    fn the_replication_session_goes_where_the_pool_goes() {
        let c = config("postgres://app:pa+ss%2Fw%40rd@db.example:6543/shop");
        assert_eq!(
            (&*c.host, c.port, &*c.user, &*c.password, &*c.database),
            ("db.example", 6543, "app", "pa+ss/w@rd", "shop")
        );
        // sqlx's default, not plaintext.
        assert_eq!(c.tls.mode, SslMode::Prefer);
        let c = config("postgres://u@h/d?sslmode=verify-full&sslrootcert=/ca.pem");
        assert_eq!(c.tls.mode, SslMode::VerifyFull);
        assert_eq!(
            c.tls.ca_pem_path.as_deref(),
            Some(std::path::Path::new("/ca.pem"))
        );
        let c = config("postgres://u@h");
        assert_eq!(c.database, "u", "no database: the user's");
        let c = config("postgres://u@h/d?sslmode=disable");
        assert_eq!(c.tls.mode, SslMode::Disable);
    }

    /// The password as sqlx's pool reads it from the same address: `%XX`
    /// decoded, a `+` kept, an escape that is not one kept as written, and
    /// one that decodes to no UTF-8 refused.
    #[test]
    fn the_password_decodes_as_the_pools_does() {
        let password = |p: &str| {
            let url = format!("postgres://u:{p}@h/d");
            let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
            replication_config(&url, &options, "s", "p").map(|c| c.password)
        };
        assert_eq!(password("a%20b+c").unwrap(), "a b+c");
        // A `password` parameter wins over the address's, the last of them.
        let url = "postgres://u:inaddress@h/d?password=first&password=la%73t";
        let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
        let c = replication_config(url, &options, "s", "p").unwrap();
        assert_eq!(c.password, "last");
        assert_eq!(password("%C3%A9").unwrap(), "\u{e9}");
        for kept in ["%", "%2", "%zz", "%+1", "a%-1"] {
            assert_eq!(password(kept).unwrap(), kept);
        }
        // sqlx refuses this address itself, before the relay reads it; the
        // relay refuses it too rather than log in with other bytes.
        assert!(
            "postgres://u:%ff@h/d"
                .parse::<sqlx::postgres::PgConnectOptions>()
                .is_err()
        );
        let options: sqlx::postgres::PgConnectOptions = "postgres://u@h/d".parse().unwrap();
        let e = replication_config("postgres://u:%ff@h/d", &options, "s", "p").unwrap_err();
        assert!(e.is_config(), "{e}");
    }
}
