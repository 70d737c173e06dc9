//! One round seen from the parent: the participants it spawned (this
//! binary re-run with `--role`), a line protocol with each of them, and
//! the planned SIGKILL that fires at a random step of the round.

use crate::rng::Rng;
use crate::system::{daemons, TAG_VAR};
use std::collections::{BTreeMap, HashSet};
use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::Duration;

/// How long a participant may take to answer one command.
const REPLY_TIMEOUT: Duration = Duration::from_secs(20);

/// A participant's answer to a command.
#[derive(Debug)]
pub enum Reply {
    /// The line it answered, without the newline.
    Line(String),
    /// It was the victim of this round's kill (before or during the step).
    Killed,
}

struct Participant {
    role: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    killed: bool,
}

/// Where the round's kill lands.
pub struct KillPlan {
    /// The command number (1-based, over the whole round) it fires at.
    pub at_step: u32,
    /// Fire after sending that command (the victim may be mid-step), not before.
    pub during: bool,
    /// Kill the round's manager daemon instead of a participant, if there is one.
    pub manager: bool,
}

/// What the round did to whom.
#[derive(Default, Debug)]
pub struct KillRecord {
    /// Index of the participant killed, if one was.
    pub participant: Option<usize>,
    /// Whether the victim was the manager daemon.
    pub manager: bool,
    /// Whether the kill fired while the victim's own command was under way.
    pub mid_step: bool,
}

pub struct Round {
    pub rng: Rng,
    pub tag: String,
    participants: Vec<Participant>,
    plan: KillPlan,
    step: u32,
    pub kill: KillRecord,
    /// Segments participants said they created.
    pub created: u64,
    /// Checks of an exact count that held.
    pub exact_checks: u64,
    /// Every pid this round spawned (segment names carry the creator's pid).
    pub pids: HashSet<i32>,
    /// A scenario's own figures (summed over the run and printed by name).
    pub figures: BTreeMap<&'static str, u64>,
}

impl Round {
    pub fn new(mut rng: Rng, tag: String, max_steps: u32, manager_kill_allowed: bool) -> Round {
        let at_step = 1 + rng.below(max_steps as u64) as u32;
        let during = rng.one_in(2);
        let manager = manager_kill_allowed && rng.one_in(4);
        Round {
            rng,
            tag,
            participants: Vec::new(),
            plan: KillPlan { at_step, during, manager },
            step: 0,
            kill: KillRecord::default(),
            created: 0,
            exact_checks: 0,
            pids: HashSet::new(),
            figures: BTreeMap::new(),
        }
    }

    /// Adds `n` to the scenario's figure `what`.
    pub fn count(&mut self, what: &'static str, n: u64) {
        *self.figures.entry(what).or_insert(0) += n;
    }

    /// Starts `role` of `scenario` with `args`; `fd3`, if given, becomes
    /// the child's descriptor 3. Returns its index.
    pub fn spawn(&mut self, scenario: &str, role: &str, args: &[String], fd3: Option<OwnedFd>) -> usize {
        self.spawn_env(scenario, role, args, fd3, &[])
    }

    /// Like [`Round::spawn`], with extra environment variables.
    pub fn spawn_env(&mut self, scenario: &str, role: &str, args: &[String], fd3: Option<OwnedFd>, env: &[(&str, &OsStr)]) -> usize {
        let mut cmd = Command::new(std::env::current_exe().expect("own path"));
        cmd.arg("--role").arg(format!("{scenario}:{role}")).args(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.env(TAG_VAR, &self.tag).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        if let Some(fd) = &fd3 {
            let raw = fd.as_raw_fd();
            use std::os::unix::process::CommandExt;
            // SAFETY: dup2 is async-signal-safe; it runs in the child between
            // fork and exec and only touches the child's descriptor table.
            unsafe {
                cmd.pre_exec(move || {
                    // dup2 onto itself keeps close-on-exec: clear it instead.
                    let rc = if raw == 3 { libc::fcntl(3, libc::F_SETFD, 0) } else { libc::dup2(raw, 3) };
                    if rc < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child = cmd.spawn().expect("spawn participant");
        drop(fd3);
        self.pids.insert(child.id() as i32);
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        self.participants.push(Participant { role: role.to_string(), child, stdin, lines: rx, killed: false });
        self.participants.len() - 1
    }

    pub fn alive(&self, idx: usize) -> bool {
        !self.participants[idx].killed
    }

    /// The process id of participant `idx`.
    pub fn pid(&self, idx: usize) -> i32 {
        self.participants[idx].child.id() as i32
    }

    /// Sends `line` to participant `idx` and waits for its one-line answer.
    /// The round's kill fires when its step comes. A participant that dies
    /// without being the victim, or does not answer, is a failure.
    pub fn cmd(&mut self, idx: usize, line: &str) -> Result<Reply, String> {
        self.step += 1;
        let fire = self.kill.participant.is_none() && !self.kill.manager && self.step == self.plan.at_step;
        if fire && !self.plan.during {
            self.fire(&[idx], false);
        }
        if self.participants[idx].killed {
            return Ok(Reply::Killed);
        }
        let sent = {
            let p = &mut self.participants[idx];
            let stdin = p.stdin.as_mut().expect("stdin open");
            stdin.write_all(format!("{line}\n").as_bytes()).and_then(|_| stdin.flush())
        };
        if fire && self.plan.during {
            let pause = self.rng.below(3000);
            std::thread::sleep(Duration::from_micros(pause));
            self.fire(&[idx], true);
        }
        if self.participants[idx].killed {
            return Ok(Reply::Killed);
        }
        let p = &self.participants[idx];
        if let Err(e) = sent {
            return Err(format!("{} could not be sent <{line}>: {e}", p.role));
        }
        match p.lines.recv_timeout(REPLY_TIMEOUT) {
            Ok(reply) => Ok(Reply::Line(reply)),
            Err(_) => Err(format!("{} (pid {}) gave no answer to <{line}>: it crashed or hung", p.role, p.child.id())),
        }
    }

    /// Like [`Round::cmd`], for a participant that must answer: a kill of
    /// it is reported as `None`.
    pub fn ask(&mut self, idx: usize, line: &str) -> Result<Option<String>, String> {
        match self.cmd(idx, line)? {
            Reply::Line(l) => Ok(Some(l)),
            Reply::Killed => Ok(None),
        }
    }

    /// A collective step: sends one command to every live participant of
    /// `idxs` before waiting for any answer (each may need the others to
    /// be under way, as in a barrier), then collects every answer. It is
    /// one step of the round: the kill may fire before the command goes
    /// out or 0–3 ms after it went to all. `line` is told whether the kill
    /// has fired by the time the command is sent (a step after a kill can
    /// ask for a short timeout). Answers come in the order of `idxs`.
    pub fn collective(&mut self, idxs: &[usize], line: impl Fn(bool) -> String) -> Result<Vec<Reply>, String> {
        self.step += 1;
        let fire = self.kill.participant.is_none() && !self.kill.manager && self.step == self.plan.at_step;
        if fire && !self.plan.during {
            self.fire(idxs, false);
        }
        let line = line(self.fired());
        let mut sent = Vec::with_capacity(idxs.len());
        for &i in idxs {
            let p = &mut self.participants[i];
            if p.killed {
                sent.push(Ok(()));
                continue;
            }
            let stdin = p.stdin.as_mut().expect("stdin open");
            sent.push(stdin.write_all(format!("{line}\n").as_bytes()).and_then(|_| stdin.flush()));
        }
        if fire && self.plan.during {
            let pause = self.rng.below(3000);
            std::thread::sleep(Duration::from_micros(pause));
            self.fire(idxs, true);
        }
        let mut replies = Vec::with_capacity(idxs.len());
        for (k, &i) in idxs.iter().enumerate() {
            let p = &self.participants[i];
            if p.killed {
                replies.push(Reply::Killed);
                continue;
            }
            if let Err(e) = &sent[k] {
                return Err(format!("{} could not be sent <{line}>: {e}", p.role));
            }
            match p.lines.recv_timeout(REPLY_TIMEOUT) {
                Ok(reply) => replies.push(Reply::Line(reply)),
                Err(_) => return Err(format!("{} (pid {}) gave no answer to <{line}>: it crashed or hung", p.role, p.child.id())),
            }
        }
        Ok(replies)
    }

    /// Kills the round's victim (the manager when planned and present,
    /// else a random live participant); `mid_step` when the victim is one
    /// of `targets`, whose command is under way.
    fn fire(&mut self, targets: &[usize], during: bool) {
        if self.plan.manager {
            let found = daemons(&self.tag);
            if let Some(pid) = found.first() {
                // SAFETY: kill(2) on a pid of this round's manager daemon.
                unsafe { libc::kill(*pid, libc::SIGKILL) };
                self.kill.manager = true;
                return;
            }
        }
        let live: Vec<usize> = (0..self.participants.len()).filter(|i| !self.participants[*i].killed).collect();
        if live.is_empty() {
            return;
        }
        let victim = live[self.rng.below(live.len() as u64) as usize];
        let p = &mut self.participants[victim];
        let _ = p.child.kill();
        let _ = p.child.wait();
        p.killed = true;
        self.kill.participant = Some(victim);
        self.kill.mid_step = during && targets.contains(&victim);
    }

    /// What the kill did, in words (for `SS_SOAK_TRACE`).
    pub fn kill_text(&self) -> String {
        let when = if self.plan.during { "during" } else { "before" };
        match (self.kill.manager, self.kill.participant) {
            (true, _) => format!("manager killed at step {} ({when})", self.plan.at_step),
            (false, Some(i)) => format!(
                "{} (pid {}) killed at step {} ({when}{})",
                self.participants[i].role,
                self.participants[i].child.id(),
                self.plan.at_step,
                if self.kill.mid_step { ", mid-step" } else { "" }
            ),
            (false, None) => format!("no kill ({} steps, kill planned at {})", self.step, self.plan.at_step),
        }
    }

    /// Whether the round's kill has fired.
    pub fn fired(&self) -> bool {
        self.kill.participant.is_some() || self.kill.manager
    }

    /// Tells every live participant to exit and reaps them all; a survivor
    /// that exits with a failure is an error.
    pub fn finish(&mut self) -> Result<(), String> {
        let mut first_error = None;
        for p in &mut self.participants {
            if p.killed {
                continue;
            }
            if let Some(mut stdin) = p.stdin.take() {
                let _ = stdin.write_all(b"exit\n");
            }
            let status = wait_with_timeout(&mut p.child, REPLY_TIMEOUT);
            match status {
                Some(s) if s.success() => {}
                Some(s) => {
                    first_error.get_or_insert(format!("survivor {} (pid {}) exited with {s}", p.role, p.child.id()));
                }
                None => {
                    let _ = p.child.kill();
                    let _ = p.child.wait();
                    first_error.get_or_insert(format!("survivor {} (pid {}) did not exit", p.role, p.child.id()));
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl Drop for Round {
    fn drop(&mut self) {
        for p in &mut self.participants {
            if p.child.try_wait().ok().flatten().is_none() {
                let _ = p.child.kill();
                let _ = p.child.wait();
            }
        }
    }
}

fn wait_with_timeout(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let end = std::time::Instant::now() + limit;
    loop {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        if std::time::Instant::now() > end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A participant's loop: answers each line of stdin with `handle`'s line
/// until `exit` or end of input.
pub fn serve(mut handle: impl FnMut(&[&str]) -> String) -> i32 {
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.first() == Some(&"exit") {
            break;
        }
        let reply = handle(&words);
        if writeln!(out, "{reply}").and_then(|_| out.flush()).is_err() {
            return 1;
        }
    }
    0
}
