//! Redis Cluster: who the masters are, and keywatch's state keys on one slot.
//!
//! Keyspace events are published only on the node that owns the key and are not passed over the
//! cluster bus, so keywatch must subscribe on every master, and find the new one after a
//! failover or a reshard. [`discover`] asks any node it knows for `CLUSTER NODES` (every
//! version has it; `CLUSTER SHARDS` is 7.0+ and says nothing more that keywatch needs);
//! [`crate::source::cluster`] follows the answer over time.

use std::time::Duration;

/// A master that serves slots, as `CLUSTER NODES` reports it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Master {
    /// `host:port`, the name keywatch uses for the node in metrics, logs and `/readyz`.
    pub addr: String,
    pub id: String,
}

impl Master {
    pub fn host_port(&self) -> Option<(&str, u16)> {
        host_port(&self.addr)
    }
}

/// `host:port` → (host, port); IPv6 hosts come bracket-less from Redis (`::1:6379`).
pub fn host_port(addr: &str) -> Option<(&str, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    Some((host, port.parse().ok()?))
}

/// What one `CLUSTER NODES` answer says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct View {
    /// Masters that serve at least one slot and are not marked failed, sorted by address.
    pub masters: Vec<Master>,
    /// Every address in the answer (replicas too): where to ask next time if the seed is gone.
    pub known: Vec<String>,
    /// The slots each of `masters` serves, as ranges: where a command for one key goes
    /// ([`crate::keyspace::Conn::direct`]), sorted by their first slot.
    pub slots: Vec<Slots>,
}

/// Slots `first..=last`, served by the master at `addr`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Slots {
    pub first: u16,
    pub last: u16,
    pub addr: String,
}

/// The slots of a cluster: 16,384, each served by one master.
const SLOTS: u16 = 16384;

/// The slot of `key`: CRC16 (XMODEM) of its hash tag, the part between the first `{` and the
/// next `}` when that is not empty, or of the whole key (the cluster specification's
/// `HASH_SLOT`).
pub fn slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.iter()
                .position(|&b| b == b'}')
                .map(|close| &rest[..close])
        })
        .filter(|tag| !tag.is_empty());
    crc16::State::<crc16::XMODEM>::calculate(tagged.unwrap_or(key)) % SLOTS
}

/// The master of `slot` in `slots` (as [`View::slots`] holds them), if one serves it.
pub fn master_of(slots: &[Slots], slot: u16) -> Option<&str> {
    let i = slots.partition_point(|s| s.first <= slot).checked_sub(1)?;
    let s = &slots[i];
    (slot <= s.last).then_some(s.addr.as_str())
}

/// Parses `CLUSTER NODES`: `<id> <ip:port@cport[,hostname]> <flags> <master> <ping> <pong>
/// <epoch> <link> <slot>...`.
///
/// A master flagged `fail` is left out (its replica is being promoted; until then its keys are
/// unreachable anyway), but one only suspected (`fail?`) by the node asked is kept: it may well
/// be up. A master without slots holds no keys, so there is nothing to hear from it.
pub fn parse_nodes(text: &str) -> View {
    let mut view = View::default();
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < 8 {
            continue;
        }
        let addr = fields[1].split(['@', ',']).next().unwrap_or_default();
        let Some((host, port)) = host_port(addr) else {
            continue;
        };
        if host.is_empty() || port == 0 {
            continue; // `noaddr`: a node that is being forgotten
        }
        view.known.push(addr.to_string());
        let flags: Vec<&str> = fields[2].split(',').collect();
        let usable = flags.contains(&"master")
            && !flags
                .iter()
                .any(|f| matches!(*f, "fail" | "handshake" | "noaddr"));
        // `[slot->-id]` and `[slot-<-id]` are slots on the move: the node named owns them
        // until the move ends, and answers `ASK` for keys already moved.
        let ranges: Vec<(u16, u16)> = fields[8..]
            .iter()
            .filter(|s| !s.starts_with('['))
            .filter_map(|s| match s.split_once('-') {
                Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                None => s.parse().ok().map(|a| (a, a)),
            })
            .collect();
        if usable && !ranges.is_empty() {
            view.masters.push(Master {
                addr: addr.to_string(),
                id: fields[0].to_string(),
            });
            view.slots
                .extend(ranges.into_iter().map(|(first, last)| Slots {
                    first,
                    last,
                    addr: addr.to_string(),
                }));
        }
    }
    view.slots.sort();
    view.masters.sort();
    view.known.sort();
    view.known.dedup();
    view
}

/// How long one node may take to answer `CLUSTER NODES` before the next one is asked.
const ASK_TIMEOUT: Duration = Duration::from_secs(5);

/// Why no node could say who the masters are.
#[derive(Debug, thiserror::Error)]
#[error("cannot read the cluster's nodes from any of {tried}: {last}")]
pub struct DiscoverError {
    pub tried: String,
    pub last: String,
}

/// Asks each of `clients` (name, client) in turn for `CLUSTER NODES`; the first answer wins.
pub async fn discover(clients: &[(String, redis::Client)]) -> Result<View, DiscoverError> {
    let mut last = String::from("no node to ask");
    for (name, client) in clients {
        let answer = tokio::time::timeout(ASK_TIMEOUT, async {
            let mut c = client.get_multiplexed_async_connection().await?;
            redis::cmd("CLUSTER")
                .arg("NODES")
                .query_async::<String>(&mut c)
                .await
        })
        .await;
        match answer {
            Ok(Ok(text)) => {
                let view = parse_nodes(&text);
                if !view.masters.is_empty() {
                    return Ok(view);
                }
                last = format!("{name} knows no master that serves slots");
            }
            Ok(Err(e)) => last = format!("{name}: {e}"),
            Err(_) => last = format!("{name}: no answer within {}s", ASK_TIMEOUT.as_secs()),
        }
    }
    Err(DiscoverError {
        tried: clients
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        last,
    })
}

crate::keyspace::commands::declare! {
    /// The commands cluster discovery sends ([`crate::keyspace::commands`]).
    [
        Use::new(Server::Watched, "cluster|nodes", "finds the cluster's masters").when(When::Cluster),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    const NODES: &str = "\
07c37dfeb235213a872192d90877d0cd55635b91 127.0.0.1:30004@31004,host4 slave e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 0 1426238317239 4 connected
67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1 127.0.0.1:30002@31002 master - 0 1426238316232 2 connected 5461-10922
292f8b365bb7edb5e285caf0b7e6ddc7265d2f4f 127.0.0.1:30003@31003 master - 0 1426238318243 3 connected 10923-16383
6ec23923021cf3ffec47632106199cb7f496ce01 127.0.0.1:30005@31005 master,fail - 0 1426238316232 5 disconnected
824fe116063bc5fcf9f4ffd895bc17aee7731ac3 127.0.0.1:30006@31006 master - 0 1426238317741 6 connected
e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 127.0.0.1:30001@31001 myself,master,fail? - 0 0 1 connected 0-5460 [5461->-67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1]
aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa :0@0 master,noaddr - 0 0 0 disconnected 1-2
";

    #[test]
    fn masters_that_serve_slots_and_every_known_address() {
        let v = parse_nodes(NODES);
        let masters: Vec<&str> = v.masters.iter().map(|m| m.addr.as_str()).collect();
        // 30005 failed, 30006 has no slots, the noaddr node has no address; a suspected
        // (`fail?`) master is kept.
        assert_eq!(
            masters,
            ["127.0.0.1:30001", "127.0.0.1:30002", "127.0.0.1:30003"]
        );
        assert_eq!(v.known.len(), 6);
        assert_eq!(v.masters[0].host_port(), Some(("127.0.0.1", 30001)));
        // A slot on the move belongs to the node that has it until the move ends.
        assert_eq!(master_of(&v.slots, 0), Some("127.0.0.1:30001"));
        assert_eq!(master_of(&v.slots, 5460), Some("127.0.0.1:30001"));
        assert_eq!(master_of(&v.slots, 5461), Some("127.0.0.1:30002"));
        assert_eq!(master_of(&v.slots, 16383), Some("127.0.0.1:30003"));
        // Those of the failed and the address-less masters are served by nobody known.
        let v = parse_nodes("a 127.0.0.1:1@2 master - 0 0 1 connected 100 200-300\n");
        assert_eq!(master_of(&v.slots, 99), None);
        assert_eq!(master_of(&v.slots, 100), Some("127.0.0.1:1"));
        assert_eq!(master_of(&v.slots, 101), None);
        assert_eq!(master_of(&v.slots, 250), Some("127.0.0.1:1"));
        assert_eq!(master_of(&v.slots, 301), None);
    }

    /// Slots as Redis computes them (`CLUSTER KEYSLOT`), hash tags included.
    #[test]
    fn a_key_s_slot_is_redis_s() {
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"123456789"), 12739);
        assert_eq!(slot(b"{user1000}.following"), slot(b"user1000"));
        assert_eq!(slot(b"foo{}{bar}"), slot(b"foo{}{bar}"));
        assert_ne!(slot(b"foo{}{bar}"), slot(b"bar"));
        assert_eq!(slot(b"foo{{bar}}zap"), slot(b"{bar"));
        assert_eq!(slot(b"{keywatch}:ledger:0:at:1"), slot(b"keywatch"));
    }
}
