//! CUDA IPC ref-counter files, the device-independent part: a producer
//! creates a counter file and sets one slot to the number of consumers it
//! "sent" to; each consumer releases the slot (atomic −1, refusing to go
//! below 0) as torch's consumers do. The slot is read from outside after
//! each step and must match exactly; the producer's close removes the file.

use crate::round::Round;
use crate::scenario::{err_reply, Cleanup, Expected, Scenario};
use crate::system::read_i64;
use std::sync::atomic::Ordering;
use storage_sharing::cuda::counters::{release_slot, CounterFile, SLOTS_PER_FILE};
use storage_sharing::shm::HEADER_SIZE;

pub struct CudaCounters;

const CONSUMERS: i64 = 3;

impl Scenario for CudaCounters {
    fn name(&self) -> &'static str {
        "cuda_counters"
    }
    fn max_steps(&self) -> u32 {
        2 + CONSUMERS as u32 + 1
    }
    fn cleanup(&self) -> Cleanup {
        Cleanup::Gc
    }

    fn run(&self, r: &mut Round) -> Result<(), String> {
        let slot = r.rng.below(SLOTS_PER_FILE as u64);
        let p = r.spawn(self.name(), "producer", &[], None);
        let cs: Vec<usize> = (0..CONSUMERS).map(|_| r.spawn(self.name(), "consumer", &[], None)).collect();
        let Some(reply) = r.ask(p, &format!("create {slot} {CONSUMERS}"))? else { return Ok(()) };
        let name = reply.strip_prefix("file ").ok_or_else(|| format!("create answered <{reply}>"))?.to_string();
        r.created += 1;
        let mut model = Expected { base: CONSUMERS, slack: 0 };
        let at = (HEADER_SIZE + 8 * slot as usize) as u64;
        for &c in &cs {
            match r.ask(c, &format!("release {name} {slot}"))? {
                Some(l) if l == "ok" => model.base -= 1,
                // The producer's death removes nothing (no manager): the
                // file stays until gc, so a release still succeeds.
                Some(l) => return Err(format!("consumer: release answered <{l}>")),
                None if r.kill.mid_step => {
                    model.base -= 1;
                    model.slack += 1;
                }
                None => {}
            }
            match read_i64(&name, at) {
                Some(v) => model.check(r, "slot after a release", v)?,
                None if !r.alive(p) => {}
                None => return Err(format!("<{name}> gone while its producer lives")),
            }
        }
        if r.alive(p) {
            if let Some(l) = r.ask(p, &format!("close {slot}"))? {
                let v: i64 = l.strip_prefix("slot ").and_then(|v| v.parse().ok()).ok_or_else(|| format!("close answered <{l}>"))?;
                model.check(r, "slot seen by the producer", v)?;
                if !r.fired() && read_i64(&name, 0).is_some() {
                    return Err(format!("<{name}> left after its producer closed it, with no kill"));
                }
            }
        }
        Ok(())
    }

    fn participant(&self, role: &str, _args: &[String]) -> i32 {
        let mut file: Option<CounterFile> = None;
        crate::round::serve(|w| match (role, w) {
            ("producer", ["create", slot, n]) => match CounterFile::create() {
                Ok(f) => {
                    f.slot(slot.parse().unwrap()).store(n.parse().unwrap(), Ordering::SeqCst);
                    let name = f.name().to_string();
                    file = Some(f);
                    format!("file {name}")
                }
                Err(e) => err_reply(&e),
            },
            ("producer", ["close", slot]) => {
                let f = file.take().unwrap();
                let v = f.slot(slot.parse().unwrap()).load(Ordering::SeqCst);
                drop(f);
                format!("slot {v}")
            }
            ("consumer", ["release", name, slot]) => {
                release_slot(name, slot.parse().unwrap()).map_or_else(|e| err_reply(&e), |_| "ok".into())
            }
            _ => format!("unknown command {w:?} for {role}"),
        })
    }
}
