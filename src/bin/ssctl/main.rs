//! ssctl: the storage-sharing command-line tool.

mod demo;
mod demo_symm;

mod gc;
mod ls;
mod store;

const USAGE: &str = "usage: ssctl <command> [args]\ncommands:\n  demo [MiB]  share a buffer with a second process and show what happened and how fast\n  demo symm [KiB]  two ranks exchange data through symmetric memory (file store rendezvous)\n  ls          list segments in /dev/shm named like ours or PyTorch's\n  gc          remove those whose creator is dead and that nobody maps (--dry-run)\n  store ls|show|verify|gc PATH  look into, check or clean a content store";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = match args.first().map(String::as_str) {
        Some("demo") if args.get(1).map(String::as_str) == Some("symm") => demo_symm::run(&args[2..]),
        Some("demo") => demo::run(&args[1..]),
        Some(demo_symm::CHILD_COMMAND) => demo_symm::child(&args[1..]),
        Some(demo::CHILD_COMMAND) => demo::child(&args[1..]),
        Some("ls") => ls::run(&args[1..]),
        Some("gc") => gc::run(&args[1..]),
        Some("store") => store::run(&args[1..]),
        Some("-h" | "--help") => {
            println!("{USAGE}");
            0
        }
        _ => {
            eprintln!("{USAGE}");
            2
        }
    };
    std::process::exit(code);
}
