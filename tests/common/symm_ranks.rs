//! The ranks of the multi-process symmetric-memory tests (CPU and CUDA):
//! each rank is the test binary run again with arguments
//! `[dir, rank, world size, extra...]`, meeting through a file store in
//! `dir`, which is also its TMPDIR (where the descriptor sockets live).

#![allow(dead_code)]

use crate::common::child_command;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use storage_sharing::store::{FileStore, StoreRef};
use storage_sharing::symm::group;

/// A fresh folder for one test's ranks, named by `prefix`, this process
/// and `tag`.
pub fn test_dir(prefix: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("{prefix}-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The command that runs rank `rank` of `ws` in `role`, output captured.
pub fn rank_command(role: &str, dir: &Path, rank: usize, ws: usize, extra: &[&str]) -> Command {
    let (d, rs, wss) = (dir.to_str().unwrap().to_string(), rank.to_string(), ws.to_string());
    let mut args = vec![d.as_str(), rs.as_str(), wss.as_str()];
    args.extend_from_slice(extra);
    let mut cmd = child_command(role, &args);
    cmd.env("TMPDIR", dir).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

pub fn finish(children: Vec<(usize, Child)>) -> Vec<(usize, Output)> {
    children.into_iter().map(|(r, c)| (r, c.wait_with_output().unwrap())).collect()
}

/// The `symm_mem-<pid>` sockets in `dir`: none may outlive a rendezvous.
pub fn sockets_left(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("symm_mem-"))
        .collect()
}

/// This rank's view, from its arguments.
pub struct Rank {
    pub dir: PathBuf,
    pub rank: usize,
    pub ws: usize,
    pub extra: Vec<String>,
    pub store: StoreRef,
}

impl Rank {
    pub fn from_args(args: Vec<String>) -> Rank {
        let dir = PathBuf::from(&args[0]);
        let store: StoreRef = Arc::new(FileStore::open(dir.join("store")).unwrap());
        Rank { rank: args[1].parse().unwrap(), ws: args[2].parse().unwrap(), extra: args[3..].to_vec(), dir, store }
    }

    /// Registers group `name` with this rank's store.
    pub fn join(&self, name: &str) {
        group::set_group_info(name, self.rank as i64, self.ws as i64, self.store.clone()).unwrap();
    }
}
