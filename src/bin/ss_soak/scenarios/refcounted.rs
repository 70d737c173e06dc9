//! Refcounted maps without a manager (RefcountedMapAllocator): a creator
//! and two openers of one name incref and decref at random. The header
//! count is read from outside after each step and must match the model
//! exactly; a killed holder's references stay in the header (as in ATen),
//! so after the survivors close the count must equal the victim's share.

use crate::round::Round;
use crate::scenario::{err_reply, Cleanup, Expected, Scenario};
use crate::system::header_count;
use storage_sharing::shm::flags::{EXCLUSIVE, NOCREATE, SHAREDMEM};
use storage_sharing::shm::{new_process_wide_shm_handle, RefcountedMapAllocator};

pub struct Refcounted;

const HOLDERS: usize = 3;
const OPS: usize = 4;

impl Scenario for Refcounted {
    fn name(&self) -> &'static str {
        "refcounted"
    }
    fn max_steps(&self) -> u32 {
        (HOLDERS * (2 + OPS)) as u32
    }
    fn cleanup(&self) -> Cleanup {
        Cleanup::Gc
    }

    fn run(&self, r: &mut Round) -> Result<(), String> {
        let n = 1 + r.rng.below(64 << 10);
        let hs: Vec<usize> = (0..HOLDERS).map(|_| r.spawn(self.name(), "holder", &[], None)).collect();
        let Some(reply) = r.ask(hs[0], &format!("create {n}"))? else { return Ok(()) };
        let name = reply.strip_prefix("name ").ok_or_else(|| format!("create answered <{reply}>"))?.to_string();
        r.created += 1;
        let mut model = Expected { base: 1, slack: 0 };
        // References each participant holds: opens plus increfs not yet decref'd.
        let mut refs = [1i64, 0, 0];
        let check = |r: &mut Round, model: &Expected, what: &str| -> Result<(), String> {
            match header_count(&name) {
                Some(c) => model.check(r, what, c as i64),
                None => Err(format!("{what}: <{name}> is gone while the count should be {}", model.base)),
            }
        };
        for (i, &h) in hs.iter().enumerate().skip(1) {
            match r.ask(h, &format!("open {name} {n}"))? {
                Some(l) if l == "ok" => {
                    refs[i] += 1;
                    model.base += 1;
                }
                Some(l) => return Err(format!("open answered <{l}>")),
                None => model.slack += i64::from(r.kill.mid_step),
            }
            check(r, &model, "after an open")?;
        }
        for _ in 0..OPS {
            let i = r.rng.below(HOLDERS as u64) as usize;
            if !r.alive(hs[i]) || refs[i] == 0 {
                continue;
            }
            // A holder gives back only references it took beyond its open.
            let up = refs[i] <= 1 || r.rng.one_in(2);
            let (cmd, delta) = if up { ("incref", 1) } else { ("decref", -1) };
            match r.ask(hs[i], cmd)? {
                Some(l) if l == "ok" => {
                    refs[i] += delta;
                    model.base += delta;
                }
                Some(l) => return Err(format!("{cmd} answered <{l}>")),
                None if r.kill.mid_step && delta > 0 => model.slack += 1,
                None => give_back_maybe(&mut model, r.kill.mid_step),
            }
            check(r, &model, &format!("after {cmd}"))?;
        }
        // Survivors give back their extra references and close.
        for (i, &h) in hs.iter().enumerate() {
            if !r.alive(h) || refs[i] == 0 {
                continue;
            }
            while refs[i] > 1 && r.alive(h) {
                match r.ask(h, "decref")? {
                    Some(_) => {
                        refs[i] -= 1;
                        model.base -= 1;
                    }
                    None => give_back_maybe(&mut model, r.kill.mid_step),
                }
            }
            if r.alive(h) {
                match r.ask(h, "close")? {
                    Some(_) => {
                        refs[i] = 0;
                        model.base -= 1;
                    }
                    None => give_back_maybe(&mut model, r.kill.mid_step),
                }
            }
        }
        // What is left is exactly the victim's share, or nothing at all.
        match header_count(&name) {
            None if model.base == 0 => {}
            Some(c) => model.check(r, "after the survivors closed", c as i64)?,
            None => return Err(format!("<{name}> removed while the victim still held {} references", model.base)),
        }
        if model.base == 0 && model.slack == 0 && header_count(&name).is_some() {
            return Err(format!("<{name}> left with count 0 after every holder closed"));
        }
        Ok(())
    }

    fn participant(&self, _role: &str, _args: &[String]) -> i32 {
        let mut map: Option<RefcountedMapAllocator> = None;
        crate::round::serve(|w| match w {
            ["create", n] => {
                match RefcountedMapAllocator::open(&new_process_wide_shm_handle(), SHAREDMEM | EXCLUSIVE, n.parse().unwrap()) {
                    Ok(m) => {
                        let name = m.filename().to_string();
                        map = Some(m);
                        format!("name {name}")
                    }
                    Err(e) => err_reply(&e),
                }
            }
            ["open", name, n] => match RefcountedMapAllocator::open(name, SHAREDMEM | NOCREATE, n.parse().unwrap()) {
                Ok(m) => {
                    map = Some(m);
                    "ok".into()
                }
                Err(e) => err_reply(&e),
            },
            ["incref"] => map.as_ref().unwrap().incref().map_or_else(|e| err_reply(&e), |_| "ok".into()),
            ["decref"] => map.as_ref().unwrap().decref().map_or_else(|e| err_reply(&e), |_| "ok".into()),
            ["close"] => {
                map = None;
                "ok".into()
            }
            _ => format!("unknown command {w:?}"),
        })
    }
}

/// The victim was killed while giving a reference back: it may or may not
/// have reached the header.
fn give_back_maybe(model: &mut Expected, mid_step: bool) {
    if mid_step {
        model.base -= 1;
        model.slack += 1;
    }
}
