//! The floor for one TCPStore set+get over loopback: a thread that answers
//! each request of that size with a reply of that size and does nothing
//! else. Shared by the store benchmarks.

use std::io::{Read, Write};
use std::net::TcpListener;

/// Bytes our client sends for one set+get (SET + COMPARE_SET of the 8-byte
/// key "/bench/k" and a 32-byte value, sentinel included).
pub const REQ_BYTES: usize = (1 + 8 + 8 + 8 + 32) + (1 + 8 + 8 + 8 + 27 + 8 + 27);
/// Bytes of the reply our client reads for it.
pub const REPLY_BYTES: usize = 8 + 32;

/// Starts the echo thread on a free loopback port and returns the port.
pub fn echo_server() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let mut c = c.unwrap();
            c.set_nodelay(true).unwrap();
            std::thread::spawn(move || {
                let mut buf = [0u8; REQ_BYTES];
                while c.read_exact(&mut buf).is_ok() {
                    c.write_all(&buf[..REPLY_BYTES]).unwrap();
                }
            });
        }
    });
    port
}
