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
/// returns the answer; an error answer is an error.
pub async fn send(client: redis::Client, args: Vec<Bytes>) -> RedisResult<Value> {
    tokio::task::spawn_blocking(move || {
        let mut conn = client.get_connection_with_timeout(TIMEOUT)?;
        conn.set_write_timeout(Some(TIMEOUT))?;
        conn.set_read_timeout(Some(TIMEOUT))?;
        let mut head = format!("*{}\r\n", args.len()).into_bytes();
        for a in &args {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A value longer than what is gathered crosses whole, beside short arguments, and an error
    /// answer is an error.
    #[tokio::test]
    async fn a_long_argument_crosses_whole_and_errors_are_errors() {
        let (server, conn) = crate::local_redis::throwaway().await;
        let client = redis::Client::open(server.url()).unwrap();
        let long: Vec<u8> = (0..GATHER * 3 + 7).map(|i| (i % 251) as u8).collect();
        let set = send(
            client.clone(),
            vec![
                Bytes::from_static(b"SET"),
                Bytes::from(long.clone()),
                Bytes::from_static(b"v"),
                Bytes::from_static(b"PX"),
                Bytes::from_static(b"60000"),
            ],
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
        let t = send(
            client.clone(),
            vec![Bytes::from_static(b"PEXPIRETIME"), Bytes::from(long)],
        )
        .await
        .unwrap();
        assert!(matches!(t, Value::Int(n) if n > 0), "{t:?}");
        let wrong = send(client, vec![Bytes::from_static(b"NOSUCHCOMMAND")]).await;
        assert!(wrong.is_err(), "{wrong:?}");
    }
}
