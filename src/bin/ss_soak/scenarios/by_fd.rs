//! Sharing by file descriptor: the producer makes an fd-backed segment
//! (created O_EXCL and unlinked at once), passes the descriptor over a
//! Unix socket (SCM_RIGHTS) to the consumer, which maps it and checks the
//! bytes; a write on either side is seen by the other.

use crate::round::Round;
use crate::scenario::{err_reply, holds_pattern, pattern, Cleanup, Scenario};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use storage_sharing::storage::{recv_fds, send_fds, Storage};

pub struct ByFd;

/// The inherited socket end (see `Round::spawn`).
const SOCK_FD: i32 = 3;

impl Scenario for ByFd {
    fn name(&self) -> &'static str {
        "fd"
    }
    fn max_steps(&self) -> u32 {
        7
    }
    fn cleanup(&self) -> Cleanup {
        Cleanup::Immediate
    }

    fn run(&self, r: &mut Round) -> Result<(), String> {
        let n = 1 + r.rng.below(256 << 10) as usize;
        let seed = r.rng.next_u64();
        let (a, b) = UnixStream::pair().map_err(|e| format!("socketpair: {e}"))?;
        let p = r.spawn(self.name(), "producer", &[], Some(OwnedFd::from(a)));
        let c = r.spawn(self.name(), "consumer", &[], Some(OwnedFd::from(b)));
        match r.ask(p, &format!("create {n} {seed}"))? {
            Some(l) if l == "ok" => r.created += 1,
            Some(l) => return Err(format!("producer: create answered <{l}>")),
            None => {}
        }
        if r.alive(p) {
            match r.ask(p, "send")? {
                // The consumer may be gone already: a typed error, no signal.
                Some(l) if l != "ok" && !(r.fired() && l.starts_with("err PeerGone")) => {
                    return Err(format!("producer: send answered <{l}>"))
                }
                _ => {}
            }
        }
        // A dead producer closes its end: the consumer then sees EOF.
        match r.ask(c, &format!("recv {n} {seed}"))? {
            Some(l) if l == "ok" || (l == "eof" && r.fired()) => {}
            Some(l) => return Err(format!("consumer: recv answered <{l}>")),
            None => {}
        }
        let byte = r.rng.below(256);
        let at = r.rng.below(n as u64);
        if r.alive(p) && r.alive(c) {
            if let Some(l) = r.ask(p, &format!("poke {at} {byte}"))? {
                if l != "ok" {
                    return Err(format!("producer: poke answered <{l}>"));
                }
                match r.ask(c, &format!("peek {at}"))? {
                    Some(l) if l == byte.to_string() => {}
                    Some(l) => return Err(format!("consumer sees <{l}> at {at}, the producer wrote {byte}")),
                    None => {}
                }
            }
        } else {
            for who in [p, c] {
                if r.alive(who) {
                    if let Some(l) = r.ask(who, "verify")? {
                        if l != "ok" && l != "none" {
                            return Err(format!("a survivor's bytes changed: <{l}>"));
                        }
                    }
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
                match s.share_fd() {
                    Ok(_) => {
                        held = Some((s, seed));
                        "ok".into()
                    }
                    Err(e) => err_reply(&e),
                }
            }
            ("producer", ["send"]) => {
                let fd = held.as_ref().unwrap().0.get_shared_fd().unwrap();
                send_fds(SOCK_FD, b"s", &[fd]).map_or_else(|e| err_reply(&e), |_| "ok".into())
            }
            ("consumer", ["recv", n, seed]) => {
                let (n, seed): (usize, u64) = (n.parse().unwrap(), seed.parse().unwrap());
                let mut buf = [0u8; 1];
                match recv_fds(SOCK_FD, &mut buf, 1) {
                    Ok((0, _)) => "eof".into(),
                    Ok((_, fds)) if fds.len() == 1 => match Storage::new_shared_fd(fds[0].as_raw_fd(), n) {
                        Ok(s) => {
                            drop(fds);
                            let ok = holds_pattern(s.data(), n, seed);
                            held = Some((s, seed));
                            if ok {
                                "ok".into()
                            } else {
                                "bad bytes".into()
                            }
                        }
                        Err(e) => err_reply(&e),
                    },
                    Ok((_, fds)) => format!("got {} descriptors", fds.len()),
                    Err(e) => err_reply(&e),
                }
            }
            (_, ["poke", at, byte]) => held
                .as_ref()
                .unwrap()
                .0
                .write_at(at.parse().unwrap(), &[byte.parse().unwrap()])
                .map_or_else(|e| err_reply(&e), |_| "ok".into()),
            (_, ["peek", at]) => held.as_ref().unwrap().0.to_vec()[at.parse::<usize>().unwrap()].to_string(),
            (_, ["verify"]) => match &held {
                None => "none".into(),
                Some((s, seed)) => {
                    if holds_pattern(s.data(), s.nbytes(), *seed) {
                        "ok".into()
                    } else {
                        "bad bytes".into()
                    }
                }
            },
            _ => format!("unknown command {w:?} for {role}"),
        })
    }
}
