//! `ss_log_set_callback` routes the library's messages to the host: here
//! the shared-memory manager's log, from a manager served in this process.

use std::ffi::{c_void, CStr};
use std::os::raw::{c_char, c_int};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use storage_sharing::ffi::log::{ss_log_set_callback, SS_LOG_INFO};
use storage_sharing::manager::server::Server;
use storage_sharing::manager::Client;

static GOT: Mutex<Vec<(c_int, String, usize)>> = Mutex::new(Vec::new());

unsafe extern "C" fn record(level: c_int, message: *const c_char, user_data: *mut c_void) {
    // SAFETY: the library passes a NUL-terminated message valid for the call.
    let text = unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned();
    GOT.lock().unwrap().push((level, text, user_data as usize));
}

/// Waits (as a hang guard only) until a message containing `needle` arrived.
fn wait_for(needle: &str) -> (c_int, String, usize) {
    let start = Instant::now();
    loop {
        if let Some(m) = GOT.lock().unwrap().iter().find(|m| m.1.contains(needle)) {
            return m.clone();
        }
        assert!(start.elapsed() < Duration::from_secs(60), "no message with <{needle}>; got {:?}", GOT.lock().unwrap());
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn callback_receives_the_managers_log() {
    let user_data = 0x5eed_usize;
    // SAFETY: `record` is thread-safe and never calls into the library.
    unsafe { ss_log_set_callback(Some(record), user_data as *mut c_void) };
    // The manager logs when this is set (read by `Server::bind`); this test
    // binary has a single test, so nothing else reads the environment.
    std::env::set_var("SS_SHM_MANAGER_LOG", "1");
    let mut server = Server::bind().unwrap();
    let socket = server.socket_path().to_str().unwrap().to_string();
    let serving = std::thread::spawn(move || server.run());

    let client = Client::connect(&socket).unwrap();
    let (level, text, data) = wait_for("connected");
    assert_eq!((level, data), (SS_LOG_INFO, user_data), "{text}");
    assert!(text.starts_with(&format!("ss_shm_manager[{}]: client", std::process::id())), "{text}");
    drop(client);
    wait_for("gone");
    // The manager exits once idle; its last words go to the callback too.
    serving.join().unwrap().unwrap();
    wait_for("idle, exiting");

    // SAFETY: NULL restores the default (stderr).
    unsafe { ss_log_set_callback(None, std::ptr::null_mut()) };
    let before = GOT.lock().unwrap().len();
    storage_sharing::log::warn("log_hook test: after the callback was removed");
    assert_eq!(GOT.lock().unwrap().len(), before, "a removed callback gets nothing");
}
