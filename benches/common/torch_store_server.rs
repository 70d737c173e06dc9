//! PyTorch's TCPStore server in a Python child (benches/store_torch.py),
//! for the store benches to time ours beside it.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// The Python with torch: $SS_TEST_PYTHON, else python3.
pub fn python() -> String {
    std::env::var("SS_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// The bench's Python side.
pub fn script() -> String {
    format!("{}/benches/store_torch.py", env!("CARGO_MANIFEST_DIR"))
}

/// Whether that Python can import torch.distributed.
pub fn torch_ok() -> bool {
    Command::new(python()).args(["-c", "import torch.distributed"]).output().is_ok_and(|o| o.status.success())
}

/// A running PyTorch TCPStore server, stopped when dropped.
pub struct TorchServer {
    child: Child,
    pub port: u16,
}

impl TorchServer {
    /// Starts PyTorch's libuv server (`libuv`) or its classic one.
    pub fn start(libuv: bool) -> TorchServer {
        let mut child = Command::new(python())
            .args([script().as_str(), "server", if libuv { "1" } else { "0" }])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
        let port = line.trim().strip_prefix("PORT ").expect("python server port").parse().unwrap();
        TorchServer { child, port }
    }
}

impl Drop for TorchServer {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}
