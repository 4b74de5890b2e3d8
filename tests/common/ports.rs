//! Free loopback ports.
//!
//! There is no race-free way to hand a port to a child process: we bind `127.0.0.1:0`, read the
//! port and close the listener, and the child binds it a moment later. Callers therefore retry on
//! "Address already in use". Within this process we at least never hand out the same port twice,
//! which removes the collisions between tests running in parallel threads.

use std::collections::HashSet;
use std::net::TcpListener;
use std::sync::{Mutex, OnceLock};

fn handed_out() -> &'static Mutex<HashSet<u16>> {
    static PORTS: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    PORTS.get_or_init(|| Mutex::new(HashSet::new()))
}

/// A loopback port that was free a moment ago and that this process has not handed out before.
pub fn free_port() -> u16 {
    for _ in 0..1000 {
        let listener =
            TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0 to find a free port");
        let port = listener
            .local_addr()
            .expect("local_addr of a bound listener")
            .port();
        if reserve(port) {
            return port;
        }
    }
    panic!("no free loopback port found in 1000 attempts");
}

/// Marks `port` as used by this process (for listeners bound to port 0 directly, so that a port
/// they give up for a while, like a receiver that is "down", is not handed to a redis-server).
/// Returns false when it was already marked.
pub fn reserve(port: u16) -> bool {
    handed_out()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(port)
}

/// A loopback port where nothing listens, held for as long as this lives: bound without `listen`,
/// so a connection to it is refused, and no other process can bind it meanwhile. A port that was
/// only free a moment ago ([`free_port`]) was taken by another suite's receiver running beside
/// this one, which answered `404` where a test expected "cannot connect".
pub struct ClosedPort {
    _socket: socket2::Socket,
    pub port: u16,
}

pub fn closed_port() -> ClosedPort {
    for _ in 0..1000 {
        let socket = bound(0, false).expect("bind 127.0.0.1:0");
        let port = socket
            .local_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .expect("the bound socket's address")
            .port();
        if reserve(port) {
            return ClosedPort {
                _socket: socket,
                port,
            };
        }
    }
    panic!("no free loopback port found in 1000 attempts");
}

/// Holds `port`, which this process just stopped listening on, bound without `listen` (see
/// [`ClosedPort`]): a receiver that is "down" refuses connections as a port where nothing
/// listens does, and a bind to port 0 elsewhere (another suite's receiver or redis-server) does
/// not pick its port meanwhile, as Linux passes over a port with a socket bound to it before
/// it honours `SO_REUSEADDR`. With `SO_REUSEADDR` itself, to bind beside the connections just
/// cut, which linger in `TIME_WAIT` on the port. `None` when it cannot be bound; the receiver is
/// down all the same.
pub fn hold(port: u16) -> Option<socket2::Socket> {
    bound(port, true).ok()
}

/// A TCP socket bound to loopback `port` (0: any free one), not listening.
fn bound(port: u16, reuse_address: bool) -> std::io::Result<socket2::Socket> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    socket.set_reuse_address(reuse_address)?;
    let at: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    socket.bind(&at.into())?;
    Ok(socket)
}
