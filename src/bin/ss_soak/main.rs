//! `ss_soak`: the chaos soak. Each round picks a sharing path, runs its
//! producer/consumer processes (this binary re-run with `--role`), kills a
//! random one (or the path's manager daemon) with SIGKILL at a random
//! step, and checks the survivors' counts and bytes. At the end: no
//! segment of the run left in /dev/shm, no daemon of the run alive, no
//! descriptor leaked by this process.
//!
//! ss_soak --rounds N [--seed S] [--start R] [--only PATH[,PATH...]] [--minutes M]
//! A failure prints the seed and round: `--seed S --start R --rounds 1`
//! replays it.

mod rng;
mod round;
mod scenario;
mod scenarios;
mod system;

use rng::{round_seed, Rng};
use round::Round;
use scenario::{Cleanup, Scenario};
use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

/// How long the run waits at the end for managers to remove what killed
/// participants abandoned and to exit (2 s idle, 2 s re-checks).
const SETTLE: Duration = Duration::from_secs(30);

struct Options {
    rounds: u64,
    seed: u64,
    start: u64,
    only: Option<String>,
    minutes: Option<f64>,
}

fn usage() -> ! {
    let names: Vec<&str> = scenario::all().iter().map(|s| s.name()).collect();
    eprintln!("usage: ss_soak --rounds N [--seed S] [--start R] [--only {}] [--minutes M]", names.join("|"));
    std::process::exit(2)
}

fn parse(args: &[String]) -> Options {
    let mut o = Options { rounds: 30, seed: 0, start: 0, only: None, minutes: None };
    let mut seeded = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().cloned().unwrap_or_else(|| usage());
        match a.as_str() {
            "--rounds" => o.rounds = value().parse().unwrap_or_else(|_| usage()),
            "--seed" => {
                o.seed = value().parse().unwrap_or_else(|_| usage());
                seeded = true;
            }
            "--start" => o.start = value().parse().unwrap_or_else(|_| usage()),
            "--only" => o.only = Some(value()),
            "--minutes" => o.minutes = Some(value().parse().unwrap_or_else(|_| usage())),
            "-h" | "--help" => usage(),
            _ => usage(),
        }
    }
    if !seeded {
        let mut b = [0u8; 8];
        // SAFETY: getrandom writes at most 8 bytes into our buffer.
        unsafe { libc::getrandom(b.as_mut_ptr().cast(), 8, 0) };
        o.seed = u64::from_ne_bytes(b) >> 16;
    }
    o
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--role") {
        let spec = args.get(1).cloned().unwrap_or_else(|| usage());
        let (path, role) = spec.split_once(':').unwrap_or_else(|| usage());
        let s = scenario::all().into_iter().find(|s| s.name() == path).unwrap_or_else(|| usage());
        std::process::exit(s.participant(role, &args[2..]));
    }
    let o = parse(&args);
    std::process::exit(run(&o));
}

#[derive(Default)]
struct Totals {
    rounds: u64,
    kills: u64,
    manager_kills: u64,
    created: u64,
    exact_checks: u64,
    gc_removed: u64,
    /// Rounds per path, and the paths' own figures (`Round::count`).
    figures: BTreeMap<String, u64>,
    failures: Vec<String>,
}

fn run(o: &Options) -> i32 {
    // Participants find the manager next to this binary (cargo builds both).
    if std::env::var_os("SS_SHM_MANAGER").is_none() {
        if let Some(dir) = std::env::current_exe().ok().and_then(|p| p.parent().map(|d| d.to_path_buf())) {
            std::env::set_var("SS_SHM_MANAGER", dir.join("ss_shm_manager"));
        }
    }
    let table = scenario::all();
    let chosen: Vec<&dyn Scenario> = match &o.only {
        Some(names) => {
            let names: Vec<&str> = names.split(',').collect();
            if names.iter().any(|n| !table.iter().any(|s| s.name() == *n)) {
                usage();
            }
            table.iter().copied().filter(|s| names.contains(&s.name())).collect()
        }
        None => table.clone(),
    };
    if chosen.is_empty() {
        usage();
    }
    let run_tag = format!("{}-{}", std::process::id(), o.seed);
    let fds_before = system::open_fds();
    let started = Instant::now();
    let mut t = Totals::default();
    // Per round: its pids, time window and cleanup, for the checks at the end.
    let mut lives: Vec<(u64, HashSet<i32>, f64, f64, Cleanup)> = Vec::new();
    for i in o.start..o.start + o.rounds {
        if o.minutes.is_some_and(|m| started.elapsed().as_secs_f64() > m * 60.0) {
            break;
        }
        let rs = round_seed(o.seed, i);
        let mut pick = Rng::new(rs ^ 0x5eed);
        let s = chosen[pick.below(chosen.len() as u64) as usize];
        let from = system::now();
        let mut r = Round::new(Rng::new(rs), format!("{run_tag}:{i}"), s.max_steps(), s.has_manager());
        let outcome = s.run(&mut r).and_then(|_| r.finish());
        t.rounds += 1;
        t.kills += u64::from(r.fired());
        t.manager_kills += u64::from(r.kill.manager);
        t.created += r.created;
        t.exact_checks += r.exact_checks;
        *t.figures.entry(format!("rounds_{}", s.name())).or_insert(0) += 1;
        for (k, v) in &r.figures {
            *t.figures.entry(format!("{}.{k}", s.name())).or_insert(0) += v;
        }
        let replay = format!("--seed {} --start {i} --rounds 1", o.seed);
        if std::env::var_os("SS_SOAK_TRACE").is_some() {
            eprintln!(
                "round {i} [{}] pids {:?}: {}; {}",
                s.name(),
                r.pids,
                r.kill_text(),
                outcome.as_ref().map_or_else(|e| e.clone(), |_| "ok".into())
            );
        }
        if let Err(e) = outcome {
            t.failures.push(format!("round {i} [{}] failed: {e} (replay: {replay})", s.name()));
        }
        let pids = r.pids.clone();
        let killed = r.fired();
        drop(r);
        let to = system::now();
        // Segments must be gone now unless a kill left them to a manager
        // or to gc.
        let cleanup = if killed { s.cleanup() } else { Cleanup::Immediate };
        match cleanup {
            Cleanup::Immediate => {
                let left = system::segments_of(&pids, from, to);
                if !left.is_empty() {
                    t.failures.push(format!("round {i} [{}]: segments left {left:?} (replay: {replay})", s.name()));
                }
            }
            Cleanup::Gc => t.gc_removed += system::gc(&pids, from, to),
            Cleanup::Manager => {}
        }
        lives.push((i, pids, from, to, cleanup));
    }
    // Managers remove what was abandoned, then exit when idle.
    let left_now = |lives: &[(u64, HashSet<i32>, f64, f64, Cleanup)]| -> Vec<(u64, Cleanup, String)> {
        let mut left = Vec::new();
        for (name, pid, created) in system::our_segments() {
            if let Some((i, _, _, _, c)) = lives.iter().find(|(_, pids, from, to, _)| system::owned_by(pid, created, pids, *from, *to)) {
                left.push((*i, *c, name));
            }
        }
        left
    };
    let settle_end = Instant::now() + SETTLE;
    while Instant::now() < settle_end && !(left_now(&lives).is_empty() && system::daemons(&run_tag).is_empty()) {
        std::thread::sleep(Duration::from_millis(200));
    }
    let left = left_now(&lives);
    let daemons = system::daemons(&run_tag);
    for (round, how, name) in &left {
        t.failures
            .push(format!("segment {name} of round {round} left ({how:?} cleanup; replay: --seed {} --start {round} --rounds 1)", o.seed));
    }
    let fds_after = system::open_fds();
    if fds_after != fds_before {
        t.failures.push(format!("descriptors of the soak: {fds_before} before, {fds_after} after"));
    }
    if !daemons.is_empty() {
        t.failures.push(format!("manager daemons of the run still alive: {daemons:?}"));
    }
    for f in &t.failures {
        println!("FAIL {f}");
    }
    println!(
        "ss_soak: rounds {} kills {} (manager {}) segments_created {} segments_left {} daemons_left {} exact_count_checks {} gc_removed {} fds {}->{} failures {} seed {} elapsed {:.1}s",
        t.rounds,
        t.kills,
        t.manager_kills,
        t.created,
        left.len(),
        daemons.len(),
        t.exact_checks,
        t.gc_removed,
        fds_before,
        fds_after,
        t.failures.len(),
        o.seed,
        started.elapsed().as_secs_f64()
    );
    let figures: Vec<String> = t.figures.iter().map(|(k, v)| format!("{k} {v}")).collect();
    println!("ss_soak figures: {}", figures.join(" "));
    i32::from(!t.failures.is_empty())
}
