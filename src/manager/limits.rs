//! What one client, and all clients together, may hold in the manager
//! daemon: connections and registered names. Without bounds a client of
//! our own uid could grow the daemon by gigabytes (each name costs a few
//! hundred bytes) and slow every other client.
//!
//! A connection over the limits is closed at once; a client that registers
//! a name over them is dropped (its names are then handled as those of any
//! client gone without freeing, and its memory is given back). Each bound
//! can be lowered or raised for a daemon through its environment (names
//! below), read once at start.

/// The bounds a daemon enforces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Distinct names one connection may hold registered.
    pub names_per_client: usize,
    /// Names tracked in all (held, or left by gone clients and watched).
    pub names: usize,
    /// Connections one process (peer pid) may have open.
    pub clients_per_pid: usize,
    /// Connections in all.
    pub clients: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { names_per_client: 262_144, names: 1_048_576, clients_per_pid: 256, clients: 4096 }
    }
}

/// The environment variables, in the order of [`Limits`]' fields.
pub const ENV: [&str; 4] =
    ["SS_SHM_MANAGER_MAX_NAMES_PER_CLIENT", "SS_SHM_MANAGER_MAX_NAMES", "SS_SHM_MANAGER_MAX_CLIENTS_PER_PID", "SS_SHM_MANAGER_MAX_CLIENTS"];

impl Limits {
    /// The defaults, each replaced by its environment variable when that
    /// holds a positive integer.
    pub fn from_env() -> Limits {
        let d = Limits::default();
        let get = |name: &str, default: usize| {
            std::env::var(name).ok().and_then(|v| v.trim().parse::<usize>().ok()).filter(|n| *n > 0).unwrap_or(default)
        };
        Limits {
            names_per_client: get(ENV[0], d.names_per_client),
            names: get(ENV[1], d.names),
            clients_per_pid: get(ENV[2], d.clients_per_pid),
            clients: get(ENV[3], d.clients),
        }
    }
}
