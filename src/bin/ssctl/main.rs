//! ssctl: the storage-sharing command-line tool.

mod demo;

fn usage() -> ! {
    eprintln!("usage: ssctl <command>\n\ncommands:\n  demo [MiB]   share a buffer with a second process and show what happened and how fast");
    std::process::exit(2);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = match args.first().map(String::as_str) {
        Some("demo") => demo::run(&args[1..]),
        Some(demo::CHILD_COMMAND) => demo::child(&args[1..]),
        _ => usage(),
    };
    std::process::exit(code);
}
