//! One command whose arguments include a long value (a key of megabytes: anyone who can write a
//! key chooses its length), sent on a connection opened for it and closed after, its long
//! arguments written to the socket as they are (docs/reliability.md#bounded-whatever-the-key).
//!
//! Sent through redis-rs's shared connections, a 16 MiB argument was held four times at once:
//! the command's arguments, its packed form, and the connection's write buffer, which keeps its
//! size for the connection's life (and a reply carrying it doubled the read buffer, kept too).
//! Here nothing but the caller's own bytes is as long as the value: the header of each argument
//! is written, then the argument from where it lies, and the connection, with whatever buffers
//! it grew, goes when the command is answered. It costs a connection per command, which only
//! values longer than [`crate::long_key::EXACT`] pay.

use std::time::Duration;

use bytes::Bytes;
use redis::{RedisResult, Value};

/// Longest the connection, the writing of the command or its answer may take.
const TIMEOUT: Duration = Duration::from_secs(10);

/// Arguments up to this length are gathered into the header written before the next long one.
const GATHER: usize = 64 * 1024;

/// Sends `args` (the command's name first) to `client`'s node on a connection of its own and
/// returns the answer; an error answer is an error. `asking`: preceded by `ASKING` (a cluster
/// node's `ASK` redirection: the key is on a slot being imported there). On a multi-threaded runtime the arguments
/// are written from where they lie, this thread given over to the command meanwhile
/// ([`tokio::task::block_in_place`]: the runtime's other tasks go on on other threads); else
/// (tests' single-threaded runtimes) they are copied once for a blocking task.
pub async fn send(client: redis::Client, args: &[&[u8]], asking: bool) -> RedisResult<Value> {
    use tokio::runtime::{Handle, RuntimeFlavor};
    if Handle::current().runtime_flavor() == RuntimeFlavor::MultiThread {
        return tokio::task::block_in_place(|| blocking(&client, args, asking));
    }
    let owned: Vec<Bytes> = args.iter().map(|a| Bytes::copy_from_slice(a)).collect();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&[u8]> = owned.iter().map(|a| &a[..]).collect();
        blocking(&client, &args, asking)
    })
    .await
    .map_err(|e| {
        redis::RedisError::from((
            redis::ErrorKind::Io,
            "a long command's task failed",
            e.to_string(),
        ))
    })?
}

/// [`send`], blocking this thread.
fn blocking(client: &redis::Client, args: &[&[u8]], asking: bool) -> RedisResult<Value> {
    let mut conn = client.get_connection_with_timeout(TIMEOUT)?;
    conn.set_write_timeout(Some(TIMEOUT))?;
    conn.set_read_timeout(Some(TIMEOUT))?;
    if asking {
        conn.send_packed_command(&redis::cmd("ASKING").get_packed_command())?;
        if let Value::ServerError(e) = conn.recv_response()? {
            return Err(e.into());
        }
    }
    let mut head = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        head.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        if a.len() <= GATHER {
            head.extend_from_slice(a);
        } else {
            conn.send_packed_command(&head)?;
            head.clear();
            conn.send_packed_command(a)?;
        }
        head.extend_from_slice(b"\r\n");
    }
    conn.send_packed_command(&head)?;
    match conn.recv_response()? {
        Value::ServerError(e) => Err(e.into()),
        v => Ok(v),
    }
}

crate::keyspace::commands::declare! {
    /// The commands this plumbing sends besides its callers' ([`crate::keyspace::commands`]).
    [
        Use::new(Server::Watched, "asking", "a long key's command sent again to the node a slot moves to")
            .when(When::Cluster),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value longer than what is gathered crosses whole, beside short arguments, and an error
    /// answer is an error; on either kind of runtime.
    #[tokio::test]
    async fn a_long_argument_crosses_whole_on_one_thread() {
        a_long_argument_crosses_whole_and_errors_are_errors().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_argument_crosses_whole_on_many_threads() {
        a_long_argument_crosses_whole_and_errors_are_errors().await
    }

    async fn a_long_argument_crosses_whole_and_errors_are_errors() {
        let (server, conn) = crate::local_redis::throwaway().await;
        let client = redis::Client::open(server.url()).unwrap();
        let long: Vec<u8> = (0..GATHER * 3 + 7).map(|i| (i % 251) as u8).collect();
        let set = send(
            client.clone(),
            &[b"SET", &long, b"v", b"PX", b"60000"],
            false,
        )
        .await
        .unwrap();
        assert_eq!(set, Value::Okay);
        let mut c = conn.clone();
        let got: String = redis::cmd("GET")
            .arg(&long[..])
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!(got, "v");
        let t = send(client.clone(), &[b"PEXPIRETIME", &long], false)
            .await
            .unwrap();
        assert!(matches!(t, Value::Int(n) if n > 0), "{t:?}");
        let wrong = send(client, &[b"NOSUCHCOMMAND"], false).await;
        assert!(wrong.is_err(), "{wrong:?}");
    }
}
