//! PyTorch's c10d `TCPStore`, wire-compatible: a client that joins an
//! existing job's store, and a server a master rank runs.

pub mod client;
pub mod protocol;
pub mod server;

use super::deadline::{deadline, expired, Backoff};
use super::{Store, Timeout};
use crate::error::{Error, ErrorKind, Result};
use client::TcpClient;
use server::TcpServer;
use std::time::Duration;

/// A TCPStore connection, plus the server when this rank is the master.
pub struct TcpStore {
    client: TcpClient,
    // Dropped after the client, so our own connection closes first.
    server: Option<TcpServer>,
    port: u16,
    /// The fork generation that started the server (see `Drop`).
    generation: u64,
}

impl Drop for TcpStore {
    /// A forked child that drops a master's store must leave the server
    /// alone: its threads live in the parent only, and shutting down the
    /// sockets it shares with the parent would cut the parent's clients.
    fn drop(&mut self) {
        if self.generation != crate::fork_safe::fork_generation() {
            std::mem::forget(self.server.take());
        }
    }
}

impl TcpStore {
    /// As `torch.distributed.TCPStore(host, port, world_size, is_master,
    /// timeout)`: the master serves on `host:port` (port 0 picks a free
    /// one); every rank connects. With `world_size > 0` each rank adds 1 to
    /// the `init/` counter, and the master returns only once all
    /// `world_size` ranks have (within `timeout`), as PyTorch's
    /// `wait_for_workers` does. `timeout` also bounds connecting and every
    /// reply.
    pub fn open(host: &str, port: u16, is_master: bool, world_size: u32, timeout: Timeout) -> Result<TcpStore> {
        let end = deadline(timeout);
        let generation = crate::fork_safe::fork_generation();
        let server = if is_master { Some(TcpServer::start(host, port)?) } else { None };
        let port = server.as_ref().map_or(port, TcpServer::port);
        let connect_host = match (is_master, host) {
            (true, "0.0.0.0") | (true, "") => "127.0.0.1",
            (true, "::") => "::1",
            _ => host,
        };
        let client = TcpClient::connect(connect_host, port, timeout)?;
        if world_size > 0 {
            client.add_raw(protocol::INIT_KEY.as_bytes().to_vec(), 1)?;
            if is_master {
                Self::wait_for_workers(&client, world_size, timeout, end)?;
            }
        }
        Ok(TcpStore { client, server, port, generation })
    }

    fn wait_for_workers(client: &TcpClient, world_size: u32, timeout: Timeout, end: Option<std::time::Instant>) -> Result<()> {
        let mut backoff = Backoff::new(Duration::from_millis(1), Duration::from_millis(10));
        loop {
            let joined = client.add_raw(protocol::INIT_KEY.as_bytes().to_vec(), 0)?;
            if joined >= i64::from(world_size) {
                return Ok(());
            }
            if expired(end) {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "timed out after {} ms waiting for ranks to join TCPStore at {}: {joined} of {world_size} joined",
                        timeout.map_or(0, |t| t.as_millis()),
                        client.addr()
                    ),
                ));
            }
            backoff.sleep(end);
        }
    }

    /// The server's port (the one picked when 0 was asked for).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether this store runs the server.
    pub fn is_master(&self) -> bool {
        self.server.is_some()
    }
}

impl Store for TcpStore {
    fn set(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.client.set(key, value)
    }

    fn get(&self, key: &[u8], timeout: Timeout) -> Result<Vec<u8>> {
        self.client.get(key, timeout)
    }

    fn add(&self, key: &[u8], delta: i64) -> Result<i64> {
        self.client.add(key, delta)
    }

    fn wait(&self, keys: &[&[u8]], timeout: Timeout) -> Result<()> {
        self.client.wait(keys, timeout)
    }

    fn check(&self, keys: &[&[u8]]) -> Result<bool> {
        self.client.check(keys)
    }

    fn compare_set(&self, key: &[u8], expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.client.compare_set(key, expected, desired)
    }

    fn delete_key(&self, key: &[u8]) -> Result<bool> {
        self.client.delete_key(key)
    }

    fn num_keys(&self) -> Result<i64> {
        self.client.num_keys()
    }

    fn describe(&self) -> String {
        format!("TCPStore at {}", self.client.addr())
    }

    fn tcp_port(&self) -> Option<u16> {
        Some(self.port)
    }
}
