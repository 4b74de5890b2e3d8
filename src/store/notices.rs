//! Notices on keywatch's own channel, `{prefix}poke` (the ledger's marker channel, which every
//! instance's subscriber listens to): what one instance, or `keywatch silence`, changed that the
//! others would otherwise find only at a slow safety round (docs/performance.md#an-idle-instance).
//! Published on the watched Redis, where the subscribers are (on a cluster, any node: pub/sub
//! reaches every node's subscribers). A notice lost while a subscriber reconnects is made up for
//! by the resubscription, after which every instance reads silences and the queue again.

use crate::keyspace::Conn;

/// What a notice says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Notice {
    /// A silence was added or removed: read them again.
    Silences,
    /// Jobs wait in the queue for an instance with a free place (one that had none sent them
    /// to wait, or `keywatch dead retry` put them back): look at the queue now.
    Work,
}

impl Notice {
    fn payload(self) -> &'static str {
        match self {
            Notice::Silences => "notice:silences",
            Notice::Work => "notice:work",
        }
    }

    /// The notice `payload` is, if it is one (else a ledger marker, or noise).
    pub fn parse(payload: &[u8]) -> Option<Notice> {
        [Notice::Silences, Notice::Work]
            .into_iter()
            .find(|n| n.payload().as_bytes() == payload)
    }
}

/// Publishes `notice` on `conn` (the watched Redis).
pub async fn publish(conn: &mut Conn, prefix: &str, notice: Notice) -> redis::RedisResult<()> {
    redis::cmd("PUBLISH")
        .arg(super::ledger::marker_channel(prefix))
        .arg(notice.payload())
        .exec_async(conn)
        .await
}

crate::keyspace::commands::declare! {
    /// The command that publishes notices ([`crate::keyspace::commands`]).
    [
        Use::new(Server::Watched, "publish", "notices to the other instances (a silence, work waiting)")
            .access(Access::Write)
            .channel(PubSub::Marker)
            .args("{channel} keywatch-doctor"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_are_told_from_markers() {
        for n in [Notice::Silences, Notice::Work] {
            assert_eq!(Notice::parse(n.payload().as_bytes()), Some(n));
        }
        assert_eq!(Notice::parse(b"0123456789abcdef:0:17"), None);
    }
}
