//! The shared-memory manager daemon. Run with no arguments it does what
//! torch_shm_manager does: prints its socket path on stdout and serves the
//! libshm protocol until it has had no clients for 2 s (up to 10 s while a
//! segment of a killed client is still in flight to a receiver). Set
//! SS_SHM_MANAGER_LOG=1 to log connections and removals on stderr.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("usage: ss_shm_manager\n\nStarts a shared-memory manager (libshm protocol), prints its socket path,\nand exits when it has had no clients for 2 seconds (up to 10 while a\nsegment is in flight to a receiver).\nEnvironment: TMPDIR (socket folder), SS_SHM_MANAGER_LOG=1 (log to stderr).");
        return;
    }
    if !args.is_empty() {
        println!("ERROR: unexpected arguments {args:?} (ss_shm_manager takes none)");
        std::process::exit(2);
    }
    std::process::exit(storage_sharing::manager::server::daemon_main());
}
