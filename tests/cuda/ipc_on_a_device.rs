//! CUDA IPC on a real device: producer and consumer in separate processes
//! (this binary re-executed), PyTorch interop both ways, and the
//! CUDA-unavailable statuses. Tests print "skipped: ..." and pass where
//! there is no device (or no torch with CUDA for the interop tests).

#[path = "../common/cuda_ctx.rs"]
mod cuda_ctx;

use cuda_ctx::{make_primary_current, ok};
use cudarc::driver::sys;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};
use storage_sharing::cuda::{self, IpcBackend, IpcHandle};
use storage_sharing::ErrorKind;

const ROLE_ENV: &str = "SS_CUDA_GPU_ROLE";
const PATTERN: u32 = 0x0C0F_FEE1;

/// True with device 0's primary context current on this thread; prints
/// why and returns false where CUDA cannot be used.
fn gpu_ready() -> bool {
    if let Err(e) = cuda::check_available() {
        println!("skipped: no usable CUDA device: {e}");
        return false;
    }
    make_primary_current();
    true
}

fn new_stream() -> u64 {
    let mut s = std::ptr::null_mut();
    // SAFETY: out-pointer is ours; 1 = CU_STREAM_NON_BLOCKING.
    ok(unsafe { sys::cuStreamCreate(&mut s, 1) }, "cuStreamCreate");
    s as u64
}

fn fill_async(ptr: u64, words: usize, value: u32, stream: u64) {
    // SAFETY: tests pass device memory of at least `words` u32.
    ok(unsafe { sys::cuMemsetD32Async(ptr, value, words, stream as sys::CUstream) }, "cuMemsetD32Async");
}

/// Device words, read after all work on the device is done.
fn read_words(ptr: u64, words: usize) -> Vec<u32> {
    let mut host = vec![0u32; words];
    // SAFETY: host buffer of `words` u32; device memory of the same size.
    unsafe {
        ok(sys::cuCtxSynchronize(), "cuCtxSynchronize");
        ok(sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), ptr, words * 4), "cuMemcpyDtoH");
    }
    host
}

fn read_words_on(ptr: u64, words: usize, stream: u64) -> Vec<u32> {
    let mut host = vec![0u32; words];
    // SAFETY: as above; the copy is ordered after the stream's event wait.
    unsafe {
        ok(sys::cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), ptr, words * 4, stream as sys::CUstream), "cuMemcpyDtoHAsync");
        ok(sys::cuStreamSynchronize(stream as sys::CUstream), "cuStreamSynchronize");
    }
    host
}

/// A child process spoken to by lines; its replies start with "@@ ".
struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    fn spawn(mut cmd: Command) -> Peer {
        let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Peer { child, stdin, stdout }
    }

    fn this_binary(role: &str) -> Peer {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", "gpu_child", "--ignored", "--nocapture", "--test-threads=1"]).env(ROLE_ENV, role);
        Peer::spawn(cmd)
    }

    fn reply(&mut self) -> String {
        loop {
            let mut line = String::new();
            assert!(self.stdout.read_line(&mut line).unwrap() > 0, "peer exited without replying");
            if let Some(at) = line.find("@@ ") {
                return line[at + 3..].trim_end().to_string();
            }
        }
    }

    fn cmd(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").unwrap();
        self.reply()
    }

    fn finish(mut self) {
        drop(self.stdin);
        assert!(self.child.wait().unwrap().success(), "peer failed");
    }
}

/// Entry of the child processes (ignored when run directly).
#[test]
#[ignore = "helper: run by other tests as a child process"]
fn gpu_child() {
    let Ok(role) = std::env::var(ROLE_ENV) else { return };
    match role.as_str() {
        "consumer" => gpu_consumer(),
        "no_device" => {
            let e = cuda::check_available().unwrap_err();
            assert_eq!(e.kind(), ErrorKind::CudaUnavailable);
            assert!(e.message().contains("no CUDA device is visible"), "{e}");
            check_unavailable_everywhere();
            println!("@@ {}", e.message());
        }
        r => panic!("unknown role {r}"),
    }
}

/// open <tuple text> | write <idx> <value> | free <idx>
fn gpu_consumer() {
    assert!(gpu_ready());
    let ipc = cuda::global();
    let stream = new_stream();
    let mut held = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let (cmd, rest) = line.split_once(' ').unwrap();
        let reply = match cmd {
            "open" => {
                let (pattern, text) = rest.split_once(' ').unwrap();
                let h = IpcHandle::from_text(text).unwrap();
                match ipc.open(&h, stream) {
                    Ok(r) => {
                        let words = read_words_on(r.data(), r.size() as usize / 4, stream);
                        let want: u32 = pattern.parse().unwrap();
                        let bad = words.iter().position(|w| *w != want);
                        held.push(Some(r));
                        match bad {
                            None => format!("ok {}", held.len() - 1),
                            Some(i) => format!("mismatch at word {i}: {:#x}", words[i]),
                        }
                    }
                    Err(e) => format!("err {:?} {}", e.kind(), e.message()),
                }
            }
            "write" => {
                let (i, v) = rest.split_once(' ').unwrap();
                let r = held[i.parse::<usize>().unwrap()].as_ref().unwrap();
                fill_async(r.data(), r.size() as usize / 4, v.parse().unwrap(), stream);
                "ok".to_string()
            }
            "free" => match ipc.received_free(held[rest.parse::<usize>().unwrap()].take().unwrap()) {
                Ok(()) => format!("ok {}", ipc.open_mappings()),
                Err(e) => format!("err {:?} {}", e.kind(), e.message()),
            },
            c => panic!("unknown command {c}"),
        };
        println!("@@ {reply}");
    }
}

/// Every CUDA entry point reports `CudaUnavailable`; the device-free parts
/// (counter release, collection) still work.
fn check_unavailable_everywhere() {
    let ipc = cuda::global();
    let e = ipc.share(0x1000, 8, 0, 0, None).map(|_| ()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::CudaUnavailable);
    assert!(e.message().starts_with("CUDA is not available: "), "{e}");
    let h = IpcHandle::from_text(&format!("0 - 0 0 - 0 {} 0", "00".repeat(64))).unwrap();
    assert_eq!(ipc.open(&h, 0).unwrap_err().kind(), ErrorKind::CudaUnavailable);
    assert_eq!(cuda::device_alloc(0, 64).unwrap_err().kind(), ErrorKind::CudaUnavailable);
    assert_eq!(cuda::device_free(0, 0x1000).unwrap_err().kind(), ErrorKind::CudaUnavailable);
    assert_eq!(ipc.collect(), 0);
    let gone = cuda::release_ipc_counter(&format!("/torch_gone_{}", std::process::id()), 0).unwrap_err();
    assert_eq!(gone.kind(), ErrorKind::PeerGone, "{gone}");
}

#[test]
fn cuda_unavailable_statuses() {
    match cuda::check_available() {
        Err(e) => {
            println!("no CUDA here ({e}): checking the unavailable statuses in this process");
            check_unavailable_everywhere();
        }
        Ok(()) => {
            println!("CUDA is present: checking the no-device statuses in a child with CUDA_VISIBLE_DEVICES=\"\"");
            let mut cmd = Command::new(std::env::current_exe().unwrap());
            cmd.args(["--exact", "gpu_child", "--ignored", "--nocapture", "--test-threads=1"])
                .env(ROLE_ENV, "no_device")
                .env("CUDA_VISIBLE_DEVICES", "");
            let mut peer = Peer::spawn(cmd);
            let why = peer.reply();
            println!("child says: {why}");
            peer.finish();
        }
    }
}

#[test]
fn gpu_producer_consumer_event_sync_and_limbo() {
    if !gpu_ready() {
        return;
    }
    let ipc = cuda::global();
    let words = 4 << 20; // 16 MiB
    let offset = 4096u64;
    let a = cuda::device_alloc(0, words * 4 + offset as usize).unwrap();
    let (base, size) = ipc.backend().allocation_range(0, a + offset + 12).unwrap();
    assert_eq!((base, size), (a, words * 4 + offset as usize), "pointer-to-base");
    let side = new_stream();
    // Queue work ahead of the pattern so a consumer that did not wait on
    // the event would read older values.
    for v in 0..64 {
        fill_async(a, words + offset as usize / 4, v, side);
    }
    fill_async(a + offset, words, PATTERN, side);
    let freed: Arc<Mutex<Vec<u64>>> = Arc::default();
    let log = freed.clone();
    let deleter = Box::new(move |p: u64| {
        log.lock().unwrap().push(p);
        cuda::device_free(0, p - 4096).unwrap();
    });
    let (h, sent) = ipc.share(a + offset, words * 4, 0, side, Some(deleter)).unwrap();
    let sent = sent.unwrap();
    assert!(h.event_sync_required && h.event_handle != [0; 64]);
    assert_eq!((h.offset_bytes, h.size_bytes), (offset, words as u64 * 4));
    assert_eq!((h.mem_handle[0], h.mem_handle[1], h.mem_handle.len()), (2, b'c', 66));

    let mut consumer = Peer::this_binary("consumer");
    assert_eq!(consumer.cmd(&format!("open {PATTERN} {}", h.to_text())), "ok 0");
    assert_eq!(consumer.cmd("write 0 3054"), "ok");
    assert_eq!(consumer.cmd("free 0"), "ok 0");
    assert_eq!(sent.counter_value(), 0, "the consumer released its slot");
    assert!(read_words(a + offset, words).iter().all(|w| *w == 3054), "the consumer's writes are here");
    assert!(!ipc.sent_free(sent), "released: freed at once");
    assert_eq!(*freed.lock().unwrap(), vec![a + offset]);

    // Limbo: the producer lets go first.
    let b = cuda::device_alloc(0, 1 << 20).unwrap();
    fill_async(b, 1 << 18, 77, side);
    let log = freed.clone();
    let deleter = Box::new(move |p: u64| {
        log.lock().unwrap().push(p);
        cuda::device_free(0, p).unwrap();
    });
    let (h, sent) = ipc.share(b, 1 << 20, 0, side, Some(deleter)).unwrap();
    assert_eq!(consumer.cmd(&format!("open 77 {}", h.to_text())), "ok 1");
    let limbo_before = ipc.limbo_size();
    assert!(ipc.sent_free(sent.unwrap()), "still used by the consumer: limbo");
    assert_eq!(ipc.limbo_size(), limbo_before + 1);
    assert_eq!(ipc.collect(), 0);
    assert_eq!(freed.lock().unwrap().len(), 1);
    assert_eq!(consumer.cmd("free 1"), "ok 0");
    assert_eq!(ipc.collect(), 1, "the limbo block is freed once released");
    assert_eq!(ipc.limbo_size(), limbo_before);
    assert_eq!(*freed.lock().unwrap(), vec![a + offset, b]);
    consumer.finish();
    // SAFETY: a stream made by this test.
    ok(unsafe { sys::cuStreamDestroy_v2(side as sys::CUstream) }, "cuStreamDestroy");
}

fn torch_python() -> Option<String> {
    let py = std::env::var("SS_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe =
        Command::new(&py).args(["-c", "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"]).stderr(Stdio::null()).status();
    match probe.map(|s| s.code()) {
        Ok(Some(0)) => Some(py),
        Ok(Some(3)) => {
            println!("skipped: torch has no CUDA device");
            None
        }
        _ => {
            println!("skipped: torch not installed");
            None
        }
    }
}

const TORCH_PRODUCER: &str = include_str!("../python/torch_cuda_producer.py");
const TORCH_CONSUMER: &str = include_str!("../python/torch_cuda_consumer.py");

#[test]
fn tensor_shared_by_pytorch_opens_here() {
    if !gpu_ready() {
        return;
    }
    let Some(py) = torch_python() else { return };
    let words = 1 << 20;
    let mut cmd = Command::new(py);
    cmd.args(["-c", TORCH_PRODUCER, &words.to_string()]);
    let mut torch = Peer::spawn(cmd);
    let info = torch.reply();
    println!("torch producer: {info}");
    let h = IpcHandle::from_text(&torch.reply()).unwrap();
    assert_eq!((h.mem_handle.len(), h.mem_handle[1]), (66, b'c'), "PyTorch's handle bytes");
    assert_eq!(h.size_bytes, words as u64 * 4);
    let ipc = cuda::global();
    let stream = new_stream();
    let r = ipc.open(&h, stream).unwrap();
    let got = read_words_on(r.data(), words, stream);
    assert!(got.iter().enumerate().all(|(i, w)| *w == i as u32), "torch.arange values");
    fill_async(r.data(), words, 7, stream);
    ipc.received_free(r).unwrap();
    assert_eq!(torch.cmd("released"), "ok", "PyTorch sees our writes and the released slot");
    torch.finish();
}

#[test]
fn our_tuple_rebuilt_by_pytorch() {
    if !gpu_ready() {
        return;
    }
    let Some(py) = torch_python() else { return };
    let ipc = cuda::global();
    let words = 1 << 20;
    let ptr = cuda::device_alloc(0, words * 4 + 8192).unwrap();
    let side = new_stream();
    fill_async(ptr + 8192, words, PATTERN, side);
    let (h, sent) = ipc.share(ptr + 8192, words * 4, 0, side, None).unwrap();
    let sent = sent.unwrap();
    let (h2, sent2) = ipc.share(ptr, 8192, 0, side, None).unwrap();
    let sent2 = sent2.unwrap();
    let mut cmd = Command::new(py);
    cmd.args(["-c", TORCH_CONSUMER, &PATTERN.to_string()]);
    let mut torch = Peer::spawn(cmd);
    assert_eq!(torch.cmd(&h.to_text()), "ok", "PyTorch read our pattern");
    assert_eq!(torch.cmd(&h2.to_text()), "released");
    torch.finish();
    assert_eq!(sent.counter_value(), 0, "PyTorch's (non-atomic) release reached our slot");
    assert_eq!(sent2.counter_value(), 0, "and its _release_ipc_counter_cuda too");
    assert!(read_words(ptr + 8192, words).iter().all(|w| *w == 9), "PyTorch's writes are here");
    assert!(!ipc.sent_free(sent));
    assert!(!ipc.sent_free(sent2));
    cuda::device_free(0, ptr).unwrap();
}
