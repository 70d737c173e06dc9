//! Sharing by name through the manager daemon, with torch's reference
//! protocol: the producer increfs once per send (in flight), each consumer
//! opens (+1, registering with the producer's manager) and decrefs the
//! sender's +1. The header count is checked against a model after every
//! step; the victim may be the manager itself.

use crate::round::Round;
use crate::scenario::{err_reply, holds_pattern, pattern, Cleanup, Expected, Scenario};
use storage_sharing::storage::Storage;

pub struct ByName;

const CONSUMERS: usize = 2;

impl Scenario for ByName {
    fn name(&self) -> &'static str {
        "name"
    }
    fn max_steps(&self) -> u32 {
        // create, 2 × (incref, open, count), 3 × (verify, close)
        1 + 3 * CONSUMERS as u32 + 6
    }
    fn has_manager(&self) -> bool {
        true
    }
    fn cleanup(&self) -> Cleanup {
        Cleanup::Manager
    }

    fn run(&self, r: &mut Round) -> Result<(), String> {
        let n = 1 + r.rng.below(256 << 10) as usize;
        let seed = r.rng.next_u64();
        let p = r.spawn(self.name(), "producer", &[], None);
        let cs: Vec<usize> = (0..CONSUMERS).map(|_| r.spawn(self.name(), "consumer", &[], None)).collect();
        let Some(reply) = r.ask(p, &format!("create {n} {seed}"))? else { return Ok(()) };
        // The manager killed while it starts: the producer gets a typed error.
        if reply.starts_with("err PeerGone") && r.kill.manager {
            return Ok(());
        }
        let handle = reply.strip_prefix("handle ").ok_or_else(|| format!("producer: create answered <{reply}>"))?.to_string();
        r.created += 1;
        let mut model = Expected { base: 1, slack: 0 };
        // Which participants hold a reference of their own.
        let mut holders = vec![p];
        for &c in &cs {
            if !r.alive(p) {
                break;
            }
            match r.ask(p, "incref")? {
                Some(l) if l == "ok" => model.base += 1,
                Some(l) => return Err(format!("producer: incref answered <{l}>")),
                // No more sends: nothing below reads the model again.
                None => break,
            }
            match r.ask(c, &format!("open {handle} {seed}"))? {
                Some(l) if l == "ok" => holders.push(c),
                Some(l) if l.starts_with("err ") && r.fired() => {
                    // The manager or the producer is gone: a typed error is
                    // the promise; the sender cancels its in-flight +1.
                    let cancelled = r.alive(p) && r.ask(p, "decref")?.is_some();
                    if cancelled {
                        model.base -= 1;
                    }
                }
                Some(l) => return Err(format!("consumer: open answered <{l}>")),
                None if r.kill.mid_step => model.slack += 1,
                None => {}
            }
            let live: Vec<usize> = holders.iter().copied().filter(|h| r.alive(*h)).collect();
            if let Some(&h) = live.first() {
                if let Some(l) = r.ask(h, "count")? {
                    let seen: i64 = l.parse().map_err(|_| format!("count answered <{l}>"))?;
                    model.check(r, "after a send", seen)?;
                }
            }
        }
        // Survivors still see the producer's bytes, then close in random order.
        let mut order = holders.clone();
        for i in (1..order.len()).rev() {
            order.swap(i, r.rng.below(i as u64 + 1) as usize);
        }
        for h in order {
            if !r.alive(h) {
                continue;
            }
            if let Some(l) = r.ask(h, "verify")? {
                if l != "ok" {
                    return Err(format!("a survivor's bytes changed: verify answered <{l}>"));
                }
            }
            if let Some(l) = r.ask(h, "close")? {
                if l != "closed" {
                    return Err(format!("close answered <{l}>"));
                }
            }
        }
        Ok(())
    }

    fn participant(&self, role: &str, _args: &[String]) -> i32 {
        let mut held: Option<(Storage, u64)> = None;
        crate::round::serve(|w| match (role, w) {
            ("producer", ["create", n, seed]) => {
                let (n, seed): (usize, u64) = (n.parse().unwrap(), seed.parse().unwrap());
                let s = Storage::from_bytes(&pattern(n, seed)).unwrap();
                match s.share_filename() {
                    Ok(h) => {
                        held = Some((s, seed));
                        format!("handle {} {} {}", h.manager_handle, h.filename, h.nbytes)
                    }
                    Err(e) => err_reply(&e),
                }
            }
            ("producer", ["incref"]) => held.as_ref().unwrap().0.shared_incref().map_or_else(|e| err_reply(&e), |_| "ok".into()),
            ("producer", ["decref"]) => held.as_ref().unwrap().0.shared_decref().map_or_else(|e| err_reply(&e), |_| "ok".into()),
            ("consumer", ["open", mgr, file, n, seed]) => {
                let (n, seed): (usize, u64) = (n.parse().unwrap(), seed.parse().unwrap());
                match Storage::new_shared_filename(mgr, file, n) {
                    Ok(s) => {
                        s.shared_decref().unwrap();
                        let ok = holds_pattern(s.data(), n, seed);
                        held = Some((s, seed));
                        if ok {
                            "ok".into()
                        } else {
                            "bad bytes at open".into()
                        }
                    }
                    Err(e) => err_reply(&e),
                }
            }
            (_, ["count"]) => held.as_ref().unwrap().0.shared_refcount().map_or_else(|e| err_reply(&e), |c| c.to_string()),
            (_, ["verify"]) => {
                let (s, seed) = held.as_ref().unwrap();
                if holds_pattern(s.data(), s.nbytes(), *seed) {
                    "ok".into()
                } else {
                    "bad bytes".into()
                }
            }
            (_, ["close"]) => {
                held = None;
                "closed".into()
            }
            _ => format!("unknown command {w:?} for {role}"),
        })
    }
}
