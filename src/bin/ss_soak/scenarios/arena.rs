//! The shareable arena: a producer allocates blocks of an arena (memfd
//! segments, or named `ss_arena_*` segments registered with its manager
//! daemon; small and large blocks, so several segments), fills them and
//! sends them over a Unix socket (`send_block`: the handle, plus the
//! segment's fd once per segment by fd); the consumer receives, checks
//! and holds the views; a write on one side is seen by the other; the
//! producer frees blocks the consumer holds, the consumer drops some
//! views, and the producer collects. The victim is the producer, the
//! consumer, or (by name, in a quarter of the rounds) the manager.
//!
//! Exact counts: blocks the producer freed while their handles are held
//! or in flight are deferred (exactly the freed ones it sent); `collect`
//! then recycles exactly the freed blocks whose holds are gone and, when
//! the consumer is dead, reclaims exactly the holds it had. Survivors'
//! bytes are checked (a consumer keeps reading a dead producer's blocks).
//! After the run no `ss_arena_*` name of the run is left in /dev/shm.

use crate::round::Round;
use crate::scenario::{err_reply, holds_pattern, pattern, Cleanup, Expected, Scenario};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use storage_sharing::arena::transport::{recv_block, send_block};
use storage_sharing::arena::{trim_cache, Arena, ArenaOptions, RemoteView, Strategy};

pub struct ArenaPath;

/// The inherited socket end (see `Round::spawn`).
const SOCK_FD: i32 = 3;
const MAX_BLOCKS: u64 = 10;
/// Small blocks come from 1 MiB segments; blocks above 128 KiB get one
/// of their own.
const OPTS_SEGMENT: usize = 1 << 20;
const OPTS_LARGE: usize = 128 << 10;

/// A range of values a count may take: `lo..=hi`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Span(i64, i64);

impl Span {
    fn exact(v: i64) -> Span {
        Span(v, v)
    }
    fn min_with(self, f: i64) -> Span {
        Span(self.0.min(f), self.1.min(f))
    }
    fn expected(self) -> Expected {
        Expected { base: self.0, slack: self.1 - self.0 }
    }
}

impl Scenario for ArenaPath {
    fn name(&self) -> &'static str {
        "arena"
    }
    fn max_steps(&self) -> u32 {
        // make, send, recv, poke, peek, free, stats, drop, collect,
        // verify, close × 2; two more: about one round in seven has no kill.
        14
    }
    fn has_manager(&self) -> bool {
        true
    }
    fn cleanup(&self) -> Cleanup {
        Cleanup::Manager
    }

    fn run(&self, r: &mut Round) -> Result<(), String> {
        let strategy = if r.rng.one_in(2) { "name" } else { "fd" };
        r.count(if strategy == "name" { "rounds_by_name" } else { "rounds_by_fd" }, 1);
        let n = 2 + r.rng.below(MAX_BLOCKS - 1) as usize;
        let sizes: Vec<usize> = (0..n)
            .map(|_| if r.rng.one_in(4) { OPTS_LARGE + 1 + r.rng.below(512 << 10) as usize } else { 1 + r.rng.below(64 << 10) as usize })
            .collect();
        let seed = r.rng.next_u64() >> 8;
        let list = sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",");
        let (a, b) = UnixStream::pair().map_err(|e| format!("socketpair: {e}"))?;
        let p = r.spawn(self.name(), "producer", &[strategy.to_string()], Some(OwnedFd::from(a)));
        let c = r.spawn(self.name(), "consumer", &[], Some(OwnedFd::from(b)));
        let fired_in = |r: &Round, before: bool| !before && r.fired();

        // 1. make
        match r.ask(p, &format!("make {seed} {list}"))? {
            Some(l) => {
                let segs: u64 =
                    l.strip_prefix("ok ").and_then(|v| v.parse().ok()).ok_or_else(|| format!("producer: make answered <{l}>"))?;
                r.created += segs;
            }
            None => return self.consumer_tail(r, c, &sizes, seed, None),
        }
        // 2. send: how many handles went out.
        let mut sent = Span(0, 0);
        if r.alive(p) {
            let before = r.fired();
            match r.ask(p, "send")? {
                Some(l) => {
                    let (k, rest) = l
                        .strip_prefix("sent ")
                        .and_then(|v| v.split_once(' ').or(Some((v, ""))))
                        .ok_or_else(|| format!("send answered <{l}>"))?;
                    let k: i64 = k.parse().map_err(|_| format!("send answered <{l}>"))?;
                    // Short only when the consumer is gone: a typed error.
                    if (k as usize) < n && !(r.fired() && !r.alive(c) && rest.starts_with("err PeerGone")) {
                        return Err(format!("producer: send answered <{l}>"));
                    }
                    sent = Span::exact(k);
                }
                None if fired_in(r, before) && r.kill.mid_step => sent = Span(0, n as i64),
                None => {}
            }
        }
        // 3. recv: how many views the consumer opened.
        let mut opened = Span(0, 0);
        if r.alive(c) {
            let before = r.fired();
            match r.ask(c, &format!("recv {n} {seed} {list}"))? {
                Some(l) => {
                    let mut words = l.splitn(3, ' ');
                    let got: i64 = match (words.next(), words.next().and_then(|v| v.parse().ok())) {
                        (Some("got"), Some(g)) => g,
                        _ => return Err(format!("consumer: recv answered <{l}>")),
                    };
                    let err = words.next().unwrap_or("");
                    // Fewer only when the producer died (its socket closed,
                    // or by name its unopened segment removed).
                    let excused =
                        r.fired() && !r.alive(p) && ["err PeerGone ", "err NotFound ", "err Protocol "].iter().any(|k| err.starts_with(k));
                    if (got < n as i64 && !excused) || err.starts_with("bad") {
                        return Err(format!("consumer: recv answered <{l}>"));
                    }
                    opened = Span::exact(got);
                }
                None if fired_in(r, before) && r.kill.mid_step => opened = Span(0, sent.1),
                None => {}
            }
        }
        // 4. a write on each side is seen by the other.
        let j = r.rng.below(n as u64) as usize;
        let at = r.rng.below(sizes[j] as u64) as usize;
        let byte = r.rng.below(256) as u8;
        let original = pattern(sizes[j], seed + j as u64)[at];
        let mut poked = (original, original);
        if r.alive(p) && r.alive(c) && opened.0 as usize > j {
            let before = r.fired();
            match r.ask(p, &format!("poke {j} {at} {byte}"))? {
                Some(l) if l == "ok" => {
                    poked = (byte, byte);
                    if let Some(l) = r.ask(c, &format!("peek {j} {at}"))? {
                        if l != byte.to_string() {
                            return Err(format!("consumer sees <{l}> at byte {at} of block {j}; the producer wrote {byte}"));
                        }
                    }
                }
                Some(l) => return Err(format!("producer: poke answered <{l}>")),
                None if fired_in(r, before) && r.kill.mid_step => poked = (original, byte),
                None => {}
            }
        }
        // 5. the producer frees blocks the consumer holds or that are in flight.
        let f = 1 + r.rng.below(n as u64) as i64;
        let mut freed = false;
        if r.alive(p) {
            if let Some(l) = r.ask(p, &format!("free {f}"))? {
                if l != "ok" {
                    return Err(format!("producer: free answered <{l}>"));
                }
                freed = true;
            }
        }
        if freed && r.alive(p) {
            if let Some(l) = r.ask(p, "stats")? {
                let deferred = parse_field(&l, "deferred")?;
                // Deferred: exactly the freed blocks whose handle went out
                // (opened or in flight: a dead consumer's holds stay until
                // collect).
                sent.min_with(f).expected().check(r, "blocks deferred after free", deferred)?;
            }
        }
        // 6. the consumer lets go of the first views.
        let d = r.rng.below(opened.0 as u64 + 1) as i64;
        let mut dropped = Span(0, 0);
        if r.alive(c) && opened.0 > 0 {
            let before = r.fired();
            match r.ask(c, &format!("drop {d}"))? {
                Some(l) if l == "ok" => dropped = Span::exact(d),
                Some(l) => return Err(format!("consumer: drop answered <{l}>")),
                None if fired_in(r, before) && r.kill.mid_step => dropped = Span(0, d),
                None => {}
            }
        }
        // 7. collect: reclaims a dead consumer's holds, recycles the freed
        // blocks nobody holds any more.
        if freed && r.alive(p) {
            let consumer_alive_before = r.alive(c);
            let before = r.fired();
            if let Some(l) = r.ask(p, "collect")? {
                let (reclaimed, recycled, deferred) =
                    (parse_field(&l, "reclaimed")?, parse_field(&l, "recycled")?, parse_field(&l, "deferred")?);
                let out_f = sent.min_with(f);
                let alive_model = (Span::exact(0), Span::exact(dropped.0.min(f)));
                let dead_model = (Span((opened.0 - dropped.1).max(0), opened.1 - dropped.0), opened.min_with(f));
                // The consumer killed while the collect ran: either model.
                let ambiguous = consumer_alive_before && !r.alive(c) && fired_in(r, before);
                let check = |r: &mut Round, (rec, recy): (Span, Span)| -> Result<(), String> {
                    rec.expected().check(r, "holds reclaimed by collect", reclaimed)?;
                    recy.expected().check(r, "blocks recycled by collect", recycled)?;
                    let left = Span(out_f.0 - recy.1, out_f.1 - recy.0);
                    left.expected().check(r, "blocks still deferred after collect", deferred)
                };
                if r.alive(c) {
                    check(r, alive_model)?;
                } else if ambiguous {
                    if check(r, alive_model).is_err() {
                        check(r, dead_model)?;
                    }
                } else {
                    check(r, dead_model)?;
                }
            }
        }
        let held = r.alive(c).then_some(Held { from: dropped.1 as usize, opened: opened.0 as usize, j, at, poked });
        self.consumer_tail(r, c, &sizes, seed, held)?;
        if r.alive(p) {
            if let Some(l) = r.ask(p, "close")? {
                if l != "ok" {
                    return Err(format!("producer: close answered <{l}>"));
                }
            }
        }
        Ok(())
    }

    fn participant(&self, role: &str, args: &[String]) -> i32 {
        let mut arena: Option<Arena> = None;
        let mut blocks: Vec<(*mut u8, usize)> = Vec::new();
        let mut views: Vec<Option<RemoteView>> = Vec::new();
        crate::round::serve(|w| match (role, w) {
            ("producer", ["make", seed, list]) => {
                let strategy = if args[0] == "name" { Strategy::Name } else { Strategy::Fd };
                let opts = ArenaOptions { segment_size: OPTS_SEGMENT, strategy, max_holds: 64, large_threshold: OPTS_LARGE };
                let a = match Arena::new(opts) {
                    Ok(a) => a,
                    Err(e) => return err_reply(&e),
                };
                let seed: u64 = seed.parse().unwrap();
                for (i, size) in list.split(',').map(|s| s.parse::<usize>().unwrap()).enumerate() {
                    match a.alloc(size, 64) {
                        Ok(ptr) => {
                            let bytes = pattern(size, seed + i as u64);
                            // SAFETY: a fresh block of `size` bytes.
                            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, size) };
                            blocks.push((ptr, size));
                        }
                        Err(e) => return err_reply(&e),
                    }
                }
                let segs = match a.stats() {
                    Ok(s) => s.segments,
                    Err(e) => return err_reply(&e),
                };
                arena = Some(a);
                format!("ok {segs}")
            }
            ("producer", ["send"]) => {
                let a = arena.as_ref().unwrap();
                for (k, (ptr, _)) in blocks.iter().enumerate() {
                    if let Err(e) = send_block(a, SOCK_FD, *ptr) {
                        return format!("sent {k} {}", err_reply(&e));
                    }
                }
                format!("sent {}", blocks.len())
            }
            ("producer", ["poke", j, at, byte]) => {
                let (ptr, size) = blocks[j.parse::<usize>().unwrap()];
                let at: usize = at.parse().unwrap();
                assert!(at < size);
                // SAFETY: inside the block.
                unsafe { *ptr.add(at) = byte.parse().unwrap() };
                "ok".into()
            }
            ("producer", ["free", f]) => {
                let a = arena.as_ref().unwrap();
                for (ptr, _) in blocks.drain(..f.parse::<usize>().unwrap()) {
                    if let Err(e) = a.free(ptr) {
                        return err_reply(&e);
                    }
                }
                "ok".into()
            }
            ("producer", ["stats"]) => {
                let s = match arena.as_ref().unwrap().stats() {
                    Ok(s) => s,
                    Err(e) => return err_reply(&e),
                };
                format!("deferred {} live {} segments {}", s.deferred_blocks, s.live_blocks, s.segments)
            }
            ("producer", ["collect"]) => {
                let a = arena.as_ref().unwrap();
                let (c, s) = match a.collect().and_then(|c| Ok((c, a.stats()?))) {
                    Ok(v) => v,
                    Err(e) => return err_reply(&e),
                };
                format!("reclaimed {} recycled {} deferred {}", c.reclaimed_holds, c.recycled_blocks, s.deferred_blocks)
            }
            ("producer", ["close"]) => {
                blocks.clear();
                arena = None;
                "ok".into()
            }
            ("consumer", ["recv", n, seed, list]) => {
                let seed: u64 = seed.parse().unwrap();
                let sizes: Vec<usize> = list.split(',').map(|s| s.parse().unwrap()).collect();
                for (i, &size) in sizes.iter().enumerate().take(n.parse().unwrap()) {
                    match recv_block(SOCK_FD) {
                        Ok(v) => {
                            // A block is its size class (or page-rounded segment): at least what was asked.
                            if v.size() < size || !holds_pattern(v.data(), size, seed + i as u64) {
                                return format!("bad bytes in block {i} ({} bytes)", v.size());
                            }
                            views.push(Some(v));
                        }
                        Err(e) => return format!("got {} {}", views.len(), err_reply(&e)),
                    }
                }
                format!("got {}", views.len())
            }
            ("consumer", ["peek", j, at]) => {
                let v = views[j.parse::<usize>().unwrap()].as_ref().unwrap();
                // SAFETY: `at` lies inside the view (checked by the driver).
                unsafe { *v.data().add(at.parse().unwrap()) }.to_string()
            }
            ("consumer", ["drop", d]) => {
                for v in views.iter_mut().take(d.parse().unwrap()) {
                    *v = None;
                }
                "ok".into()
            }
            ("consumer", ["verify", seed, list, from, j, at, b1, b2]) => {
                let seed: u64 = seed.parse().unwrap();
                let sizes: Vec<usize> = list.split(',').map(|s| s.parse().unwrap()).collect();
                let (j, at, b1, b2): (usize, usize, u8, u8) =
                    (j.parse().unwrap(), at.parse().unwrap(), b1.parse().unwrap(), b2.parse().unwrap());
                for (i, v) in views.iter().enumerate().skip(from.parse().unwrap()) {
                    let Some(v) = v else { continue };
                    // SAFETY: the view's bytes, mapped while it lives.
                    let bytes = unsafe { std::slice::from_raw_parts(v.data(), sizes[i].min(v.size())) };
                    let mut want = pattern(sizes[i], seed + i as u64);
                    if i == j {
                        if bytes[at] != b1 && bytes[at] != b2 {
                            return format!("byte {at} of block {i} is {}, not {b1} or {b2}", bytes[at]);
                        }
                        want[at] = bytes[at];
                    }
                    if bytes != want.as_slice() {
                        return format!("bad bytes in held block {i}");
                    }
                }
                "ok".into()
            }
            ("consumer", ["close"]) => {
                views.clear();
                trim_cache();
                "ok".into()
            }
            _ => format!("unknown command {w:?} for {role}"),
        })
    }
}

/// The views a live consumer still holds: from `from` to `opened`; block
/// `j`'s byte `at` may hold either value of `poked`.
struct Held {
    from: usize,
    opened: usize,
    j: usize,
    at: usize,
    poked: (u8, u8),
}

impl ArenaPath {
    /// The consumer's last steps: its held views still hold their bytes
    /// (whatever happened to the producer), then it lets go of all.
    /// `held`: which views to check, or None to skip the check.
    fn consumer_tail(&self, r: &mut Round, c: usize, sizes: &[usize], seed: u64, held: Option<Held>) -> Result<(), String> {
        if !r.alive(c) {
            return Ok(());
        }
        let list = sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",");
        if let Some(Held { from, opened, j, at, poked: (b1, b2) }) = held {
            if from < opened {
                if let Some(l) = r.ask(c, &format!("verify {seed} {list} {from} {j} {at} {b1} {b2}"))? {
                    if l != "ok" {
                        return Err(format!("a survivor's bytes changed: <{l}>"));
                    }
                    r.count("views_verified", (opened - from) as u64);
                }
            }
        }
        if r.alive(c) {
            if let Some(l) = r.ask(c, "close")? {
                if l != "ok" {
                    return Err(format!("consumer: close answered <{l}>"));
                }
            }
        }
        Ok(())
    }
}

/// The number after `key` in a `key value key value` line.
fn parse_field(line: &str, key: &str) -> Result<i64, String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    words
        .iter()
        .position(|w| *w == key)
        .and_then(|i| words.get(i + 1))
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("no {key} in <{line}>"))
}
