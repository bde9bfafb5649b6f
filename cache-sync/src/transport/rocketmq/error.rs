//! How the client's errors become cache-sync's [`Error`]. Every call maps
//! through this one function, so the line it draws (a disconnect, which a
//! node retries, or a refusal, which retrying will not mend) is the same
//! everywhere.

use rocketmq_client_rust::ClientError;

use super::KIND;
use crate::error::Error;

/// "Disconnected" only when the client says the broker or name server could
/// not be reached or did not answer in time; a refusal (no such topic, no
/// permission, a bad argument, a broker-side failure) is another transport
/// error, which retrying the same call will not mend.
pub(super) fn err(e: ClientError) -> Error {
    use rocketmq_error::CanonicalCondition as C;
    match e.descriptor().condition() {
        C::Unavailable | C::DeadlineExceeded | C::Aborted | C::Cancelled => {
            Error::disconnected(KIND, e.to_string())
        }
        _ => Error::Transport {
            transport: KIND,
            source: e.to_string().into(),
        },
    }
}
