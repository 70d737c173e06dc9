//! Symmetric memory, CPU backend: a group of 2–4 ranks (this binary re-run
//! with `--role symm:rank`) meets through a key-value store — a file store
//! in the round's own folder, or (every other round) a TCPStore whose
//! server runs in rank 0 — and the folder is also the ranks' TMPDIR (their
//! descriptor sockets).
//! The ranks rendezvous, write patterns, barrier, read every peer's
//! buffer in place, and pass a value round the ring with put_signal /
//! wait_signal; each collective is one step, sent to every rank at once.
//!
//! A rank may be SIGKILLed at any step. The survivors must then get a
//! typed error (`Timeout` or `PeerGone`) from the first collective they
//! cannot complete, within its timeout (plus scheduling slack) — never a
//! hang or a crash —, still read the bytes every rank wrote (the dead
//! rank's too: its memfd stays mapped), and free their block. Nothing of
//! the run may be named in /dev/shm (blocks are memfds), no survivor may
//! leave its `symm_mem-<pid>` socket, and the folder goes with the round.

use crate::round::{Reply, Round};
use crate::scenario::{err_reply, holds_pattern, pattern, shm_entries_since, Cleanup, RoundDir, Scenario};
use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use storage_sharing::store::tcp::server::TcpServer;
use storage_sharing::store::{FileStore, StoreRef, TcpStore};
use storage_sharing::symm::{self, group, DeviceType, SymmetricMemory};

pub struct Symm;

/// Timeout of a collective while every rank lives (ms): a timeout then is
/// a failure, so it is generous for a loaded 2-core machine.
const LONG_MS: u64 = 2000;
/// Timeout of a collective the driver knows cannot complete (a rank is
/// dead): it must expire, and quickly.
const SHORT_MS: u64 = 200;
/// How much later than its timeout a survivor may answer.
const LATE_MS: u128 = 5000;
/// Bytes at the start of each buffer that carry the ring's value; the
/// pattern fills the rest.
const RING: usize = 64;
const GROUP: &str = "soak";
const STEPS: u32 = 8;

/// What one rank answered to a step.
#[derive(PartialEq, Eq)]
enum Answer {
    Ok,
    /// `Timeout` or `PeerGone`, with the message.
    Typed(String),
    /// No rendezvous handle (its rendezvous failed after a kill).
    NoHandle,
    Killed,
}

impl Symm {
    /// Checks the answers of a step: every live rank answers `ok`, except
    /// after a kill, when a collective may fail with a typed error and a
    /// rank without a handle says so.
    fn judge(&self, r: &mut Round, what: &str, ranks: &[usize], replies: Vec<Reply>, collective: bool) -> Result<Vec<Answer>, String> {
        let mut out = Vec::with_capacity(replies.len());
        for (&rank, reply) in ranks.iter().zip(replies) {
            out.push(match reply {
                Reply::Killed => Answer::Killed,
                Reply::Line(l) if l == "ok" => Answer::Ok,
                Reply::Line(l) if l == "none" && r.fired() => Answer::NoHandle,
                Reply::Line(l) if collective && r.fired() && (l.starts_with("err Timeout ") || l.starts_with("err PeerGone ")) => {
                    r.count("typed_errors", 1);
                    if l.starts_with("err PeerGone ") {
                        r.count("typed_errors_peer_gone", 1);
                    }
                    Answer::Typed(l)
                }
                Reply::Line(l) => {
                    return Err(format!("rank {rank}: {what} answered <{l}>{}", if r.fired() { " after a kill" } else { "" }))
                }
            });
        }
        Ok(out)
    }

    /// After the kill: the survivors' collective must fail with a typed
    /// error in time; their data must still read; they free their blocks.
    fn aftermath(&self, r: &mut Round, ranks: &[usize], st: &State) -> Result<(), String> {
        let victim = r.kill.participant.expect("a rank was killed");
        let live: Vec<usize> = ranks.iter().copied().filter(|&i| r.alive(i)).collect();
        let with_handle: Vec<usize> = live.iter().copied().filter(|&i| st.handle[i]).collect();
        let mut alloc_ok = st.alloc_ok.clone();
        if !st.alloc_tried {
            // Killed before the group was made. In a TCPStore round whose
            // server (rank 0) died, connecting fails (`Timeout`): no group.
            let Some(medium) = st.medium.clone() else { return Ok(()) };
            let replies = r.collective(&live, |_| format!("alloc {medium} {SHORT_MS}"))?;
            for (k, a) in self.judge(r, "alloc after the kill", &live, replies, true)?.into_iter().enumerate() {
                alloc_ok[live[k]] = a == Answer::Ok;
            }
        }
        let ready: Vec<usize> = live.iter().copied().filter(|&i| alloc_ok[i]).collect();
        if !st.rendezvous_tried && !ready.is_empty() {
            // The victim never arrives: every survivor's rendezvous times
            // out; with the TCPStore's server (rank 0) dead, the store is
            // gone: `PeerGone`.
            let server_dead = st.tcp && victim == 0;
            let begun = Instant::now();
            let replies = r.collective(&ready, |_| format!("rdv {SHORT_MS}"))?;
            let took = begun.elapsed().as_millis();
            for (k, a) in self.judge(r, "rendezvous without the victim", &ready, replies, true)?.into_iter().enumerate() {
                match a {
                    Answer::Typed(m) if m.contains(&format!("rank(s) {victim} never arrived")) => {}
                    Answer::Typed(m) if server_dead && m.starts_with("err PeerGone ") => {}
                    Answer::Typed(m) => {
                        return Err(format!("rank {}: the rendezvous error does not name the dead rank {victim}: <{m}>", ready[k]))
                    }
                    _ => return Err(format!("rank {}: a rendezvous without rank {victim} (killed) did not fail", ready[k])),
                }
            }
            self.in_time(r, took, SHORT_MS)?;
        } else if !with_handle.is_empty() && !st.freed {
            // Every byte a rank acknowledged writing is there, the dead
            // rank's included.
            let list =
                if st.wrote.is_empty() { "-".to_string() } else { st.wrote.iter().map(|w| w.to_string()).collect::<Vec<_>>().join(",") };
            let replies = r.collective(&with_handle, |_| format!("check {} {list}", st.seed))?;
            self.judge(r, "check after the kill", &with_handle, replies, false)?;
            r.count("buffers_checked", (with_handle.len() * st.wrote.len()) as u64);
            // A barrier on a channel never used: the dead rank cannot
            // put its signal, so every survivor must time out naming it.
            let begun = Instant::now();
            let replies = r.collective(&with_handle, |_| format!("barrier 3 {SHORT_MS}"))?;
            let took = begun.elapsed().as_millis();
            // Ranks whose rendezvous failed do not take part either.
            let absent: Vec<usize> = ranks.iter().copied().filter(|i| !with_handle.contains(i)).collect();
            for (k, a) in self.judge(r, "barrier without the victim", &with_handle, replies, true)?.into_iter().enumerate() {
                match a {
                    Answer::Typed(m) if absent.iter().any(|x| m.contains(&format!("rank {x} "))) => {}
                    Answer::Typed(m) => {
                        return Err(format!("rank {}: the barrier error names none of the absent ranks {absent:?}: <{m}>", with_handle[k]))
                    }
                    _ => return Err(format!("rank {}: a barrier with rank {victim} dead did not fail", with_handle[k])),
                }
            }
            self.in_time(r, took, SHORT_MS)?;
        }
        if !st.freed {
            let replies = r.collective(&live, |_| "free".to_string())?;
            self.judge(r, "free after the kill", &live, replies, false)?;
        }
        Ok(())
    }

    fn in_time(&self, r: &mut Round, took_ms: u128, timeout_ms: u64) -> Result<(), String> {
        if took_ms > timeout_ms as u128 + LATE_MS {
            return Err(format!("the survivors took {took_ms} ms to report a {timeout_ms} ms timeout"));
        }
        r.count("error_steps_in_time", 1);
        Ok(())
    }
}

/// The driver's view of the group.
struct State {
    /// TCPStore round (rank 0 serves), else a file store.
    tcp: bool,
    /// What `alloc` is told to meet through: `file`, or `tcp <port>` once
    /// rank 0 serves.
    medium: Option<String>,
    alloc_tried: bool,
    /// Which ranks made their block (and joined the store).
    alloc_ok: Vec<bool>,
    /// Which ranks hold a rendezvous handle.
    handle: Vec<bool>,
    rendezvous_tried: bool,
    /// Ranks that acknowledged writing their pattern.
    wrote: Vec<usize>,
    seed: u64,
    freed: bool,
}

impl Scenario for Symm {
    fn name(&self) -> &'static str {
        "symm"
    }
    fn max_steps(&self) -> u32 {
        // Two more than a round has: about one round in five has no kill.
        STEPS + 2
    }
    fn cleanup(&self) -> Cleanup {
        Cleanup::Immediate
    }

    fn run(&self, r: &mut Round) -> Result<(), String> {
        let ws = 2 + r.rng.below(3) as usize;
        let size = RING + 1 + r.rng.below(256 << 10) as usize;
        let seed = r.rng.next_u64() >> 8;
        let dir = RoundDir::new(self.name(), &r.tag)?;
        let started = crate::system::now();
        let ranks: Vec<usize> = (0..ws)
            .map(|rank| {
                let args = [dir.arg(), rank.to_string(), ws.to_string(), size.to_string()];
                r.spawn_env(self.name(), "rank", &args, None, &[("TMPDIR", OsStr::new(&dir.0))])
            })
            .collect();
        let tcp = r.rng.one_in(2);
        r.count(if tcp { "rounds_tcp_store" } else { "rounds_file_store" }, 1);
        let mut st = State {
            tcp,
            medium: None,
            alloc_tried: false,
            alloc_ok: vec![false; ws],
            handle: vec![false; ws],
            rendezvous_tried: false,
            wrote: Vec::new(),
            seed,
            freed: false,
        };
        if tcp {
            // Rank 0 serves the store first (one step, where the kill may land).
            if let Some(l) = r.ask(ranks[0], "serve")? {
                let port: u16 =
                    l.strip_prefix("port ").and_then(|p| p.parse().ok()).ok_or_else(|| format!("rank 0: serve answered <{l}>"))?;
                st.medium = Some(format!("tcp {port}"));
            }
        } else {
            st.medium = Some("file".into());
        }
        let medium = st.medium.clone().unwrap_or_default();
        let long = |fired: bool| if fired { SHORT_MS } else { LONG_MS };
        let all = ranks.clone();
        // Each step: (what, command given whether the kill fired, collective).
        let mut step = 0;
        while step < STEPS && !r.fired() {
            step += 1;
            let (what, collective): (&str, bool) = match step {
                // Connecting to a TCPStore whose server died is a typed error.
                1 => ("alloc", true),
                2 => ("rendezvous", true),
                3 => ("write", false),
                4 => ("barrier after writing", true),
                5 => ("check", false),
                6 => ("ring", true),
                7 => ("last barrier", true),
                _ => ("free", false),
            };
            let everyone = (0..ws).map(|i| i.to_string()).collect::<Vec<_>>().join(",");
            let begun = Instant::now();
            let replies = r.collective(&all, |fired| match step {
                1 => format!("alloc {medium} {}", long(fired)),
                2 => format!("rdv {}", long(fired)),
                3 => format!("write {seed}"),
                4 => format!("barrier 0 {}", long(fired)),
                5 => format!("check {seed} {everyone}"),
                6 => format!("ring 1 {} {step}", long(fired)),
                7 => format!("barrier 2 {}", long(fired)),
                _ => "free".to_string(),
            })?;
            let took = begun.elapsed().as_millis();
            let answers = self.judge(r, what, &all, replies, collective)?;
            if answers.iter().any(|a| matches!(a, Answer::Typed(_))) {
                self.in_time(r, took, LONG_MS)?;
            }
            match step {
                1 => {
                    st.alloc_tried = true;
                    for (i, a) in answers.iter().enumerate() {
                        st.alloc_ok[i] = *a == Answer::Ok;
                    }
                    r.created += answers.iter().filter(|a| **a == Answer::Ok).count() as u64;
                }
                2 => {
                    st.rendezvous_tried = true;
                    for (i, a) in answers.iter().enumerate() {
                        st.handle[i] = *a == Answer::Ok;
                    }
                }
                3 => st.wrote = (0..ws).filter(|&i| answers[i] == Answer::Ok).collect(),
                5 => r.count("buffers_checked", (answers.iter().filter(|a| **a == Answer::Ok).count() * ws) as u64),
                8 => st.freed = true,
                _ => {}
            }
        }
        if r.fired() {
            self.aftermath(r, &all, &st)?;
        }
        r.finish()?;
        // The kill's victim may leave its socket (killed inside the ring);
        // a survivor never does.
        let victim_pid = r.kill.participant.map(|i| r.pid(i));
        for e in std::fs::read_dir(&dir.0).map_err(|e| format!("cannot list {}: {e}", dir.0.display()))?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix("symm_mem-") {
                if pid.parse::<i32>().ok() == victim_pid {
                    r.count("victim_sockets_removed", 1);
                } else {
                    return Err(format!("socket {name} of a survivor left in the round's folder"));
                }
            }
        }
        let named = shm_entries_since(started, "symm");
        if !named.is_empty() {
            return Err(format!("symmetric memory named in /dev/shm: {named:?}"));
        }
        Ok(())
    }

    fn participant(&self, _role: &str, args: &[String]) -> i32 {
        let dir = PathBuf::from(&args[0]);
        let (rank, ws, size): (usize, usize, usize) = (args[1].parse().unwrap(), args[2].parse().unwrap(), args[3].parse().unwrap());
        let mut block: Option<*mut u8> = None;
        let mut mem: Option<Arc<SymmetricMemory>> = None;
        let mut server: Option<TcpServer> = None;
        let ms = |t: &str| Some(Duration::from_millis(t.parse().unwrap()));
        let ok = |res: storage_sharing::Result<()>| res.map_or_else(|e| err_reply(&e), |_| "ok".to_string());
        crate::round::serve(|w| match w {
            ["serve"] => match TcpServer::start("127.0.0.1", 0) {
                Ok(s) => {
                    let port = s.port();
                    server = Some(s);
                    format!("port {port}")
                }
                Err(e) => err_reply(&e),
            },
            ["alloc", medium @ ..] => {
                let store: storage_sharing::Result<StoreRef> = match medium {
                    ["file", _] => FileStore::open(dir.join("store")).map(|s| Arc::new(s) as StoreRef),
                    // The timeout bounds connecting (retried until then, as
                    // PyTorch's client does) and every reply.
                    ["tcp", port, t] => {
                        TcpStore::open("127.0.0.1", port.parse().unwrap(), false, 0, ms(t)).map(|s| Arc::new(s) as StoreRef)
                    }
                    _ => return format!("unknown store {medium:?}"),
                };
                let store = match store {
                    Ok(s) => s,
                    Err(e) => return err_reply(&e),
                };
                if let Err(e) = group::set_group_info(GROUP, rank as i64, ws as i64, store) {
                    return err_reply(&e);
                }
                match symm::alloc(DeviceType::Cpu, 0, size, Some(GROUP)) {
                    Ok(p) => {
                        block = Some(p);
                        "ok".into()
                    }
                    Err(e) => err_reply(&e),
                }
            }
            ["rdv", _] if block.is_none() => "none".into(),
            ["rdv", t] => match symm::rendezvous(block.unwrap(), None, ms(t)) {
                Ok(h) => {
                    mem = Some(h);
                    "ok".into()
                }
                Err(e) => err_reply(&e),
            },
            ["write", _] if block.is_none() => "none".into(),
            ["write", seed] => {
                let p = pattern(size - RING, seed.parse::<u64>().unwrap() + rank as u64);
                // SAFETY: our own buffer holds `size` bytes.
                unsafe { std::ptr::copy_nonoverlapping(p.as_ptr(), block.unwrap().add(RING), p.len()) };
                "ok".into()
            }
            ["barrier", ch, t] => match &mem {
                None => "none".into(),
                Some(h) => ok(h.barrier(ch.parse().unwrap(), ms(t), 0)),
            },
            ["check", seed, list] => {
                let Some(h) = &mem else { return "none".into() };
                let seed: u64 = seed.parse().unwrap();
                for peer in list.split(',').filter(|s| *s != "-") {
                    let peer: usize = peer.parse().unwrap();
                    let p = match h.buffer_ptr(peer as i64) {
                        Ok(p) => p,
                        Err(e) => return err_reply(&e),
                    };
                    // SAFETY: every rank's buffer is mapped here for `size` bytes.
                    if !holds_pattern(unsafe { p.add(RING) }, size - RING, seed + peer as u64) {
                        return format!("bad bytes in the buffer of rank {peer}");
                    }
                }
                "ok".into()
            }
            ["ring", ch, t, step] => {
                let Some(h) = &mem else { return "none".into() };
                let (next, prev) = ((rank + 1) % ws, (rank + ws - 1) % ws);
                let step: u64 = step.parse().unwrap();
                let value = |from: usize| (step << 16 | from as u64).to_ne_bytes();
                match h.buffer_ptr(next as i64) {
                    // SAFETY: the next rank's buffer is mapped for at least RING bytes;
                    // only this rank writes its first 8 bytes in this step.
                    Ok(p) => unsafe { std::ptr::copy_nonoverlapping(value(rank).as_ptr(), p, 8) },
                    Err(e) => return err_reply(&e),
                }
                let ch: i64 = ch.parse().unwrap();
                if let Err(e) = h.put_signal(next as i64, ch, ms(t), 0).and_then(|_| h.wait_signal(prev as i64, ch, ms(t), 0)) {
                    return err_reply(&e);
                }
                let mut got = [0u8; 8];
                // SAFETY: our own buffer; the previous rank wrote it before its signal.
                unsafe { std::ptr::copy_nonoverlapping(block.unwrap(), got.as_mut_ptr(), 8) };
                if got == value(prev) {
                    "ok".into()
                } else {
                    format!("ring value {got:?} from rank {prev}, expected {:?}", value(prev))
                }
            }
            ["free"] => {
                mem = None;
                match block.take() {
                    Some(p) => ok(symm::free(p)),
                    None => "ok".into(),
                }
            }
            _ => format!("unknown command {w:?}"),
        })
    }
}
