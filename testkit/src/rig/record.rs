//! A rig's record on disk (`/run/ucxkit-rig/NAME.json`): how many hosts it has, the rate
//! its links were made with, who owns it and which delay programs serve it, so that
//! `down` from any process, and the next `up` once the owner is gone, remove it whole.
//! Every change of records and namespaces happens under one lock ([`Lock`]).

use std::fs::{self, File};
use std::path::PathBuf;

use serde_json::{json, Value};

/// Where records live (a tmpfs, emptied at boot like `/run/netns`).
pub const DIR: &str = "/run/ucxkit-rig";

/// A process, told apart from a later one with the same pid by its start time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    /// Its process id.
    pub pid: u32,
    /// Its start time (clock ticks after boot, `/proc/PID/stat` field 22).
    pub start: u64,
}

impl Owner {
    /// Process `pid`, if it is running (not ended, nor a zombie).
    pub fn of(pid: u32) -> Option<Owner> {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // The command name (field 2) is in parentheses and may hold anything: count the
        // fields after its closing one (field 3 onwards).
        let mut rest = stat[stat.rfind(')')? + 1..].split_whitespace();
        // A zombie has ended; it waits only to be reaped.
        if matches!(rest.next()?, "Z" | "X") {
            return None;
        }
        let start = rest.nth(18)?.parse().ok()?;
        Some(Owner { pid, start })
    }

    /// This process.
    pub fn this() -> Owner {
        Owner::of(std::process::id()).expect("/proc/self/stat is readable")
    }

    /// Whether the process still runs (and is the same one).
    pub fn alive(&self) -> bool {
        Owner::of(self.pid) == Some(*self)
    }

    fn to_json(self) -> Value {
        json!({ "pid": self.pid, "start": self.start })
    }

    fn from_json(v: &Value) -> Option<Owner> {
        Some(Owner { pid: u32::try_from(v["pid"].as_u64()?).ok()?, start: v["start"].as_u64()? })
    }
}

/// A delay program serving one host's queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Daemon {
    /// The host's index.
    pub host: usize,
    /// The program's process.
    pub process: Owner,
}

/// What is kept of a rig between commands.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// The rig's name.
    pub name: String,
    /// How many hosts it has.
    pub hosts: usize,
    /// The rate each link was made with (`tc` units), if limited.
    pub rate: Option<String>,
    /// The process whose end ends the rig (`None`: it stays until `down`).
    pub owner: Option<Owner>,
    /// Delay programs started for it.
    pub daemons: Vec<Daemon>,
}

impl Record {
    fn path(name: &str) -> PathBuf {
        PathBuf::from(DIR).join(format!("{name}.json"))
    }

    /// The rig's record as JSON.
    pub fn to_json(&self) -> Value {
        json!({
            "name": self.name,
            "hosts": self.hosts,
            "rate": self.rate,
            "owner": self.owner.map(Owner::to_json),
            "daemons": self.daemons.iter().map(|d| json!({
                "host": d.host, "process": d.process.to_json(),
            })).collect::<Vec<_>>(),
        })
    }

    /// A record from its JSON; `None` when it is not one.
    pub fn from_json(v: &Value) -> Option<Record> {
        let daemons = v["daemons"]
            .as_array()?
            .iter()
            .map(|d| {
                Some(Daemon {
                    host: usize::try_from(d["host"].as_u64()?).ok()?,
                    process: Owner::from_json(&d["process"])?,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Record {
            name: v["name"].as_str()?.to_string(),
            hosts: usize::try_from(v["hosts"].as_u64()?).ok()?,
            rate: v["rate"].as_str().map(str::to_string),
            owner: if v["owner"].is_null() { None } else { Some(Owner::from_json(&v["owner"])?) },
            daemons,
        })
    }

    /// Writes the record (whole: a new file renamed over the old one).
    pub fn save(&self) -> Result<(), String> {
        fs::create_dir_all(DIR).map_err(|e| format!("making {DIR}: {e}"))?;
        let path = Record::path(&self.name);
        let tmp = path.with_extension("json.new");
        fs::write(&tmp, self.to_json().to_string()).map_err(|e| format!("writing {}: {e}", tmp.display()))?;
        fs::rename(&tmp, &path).map_err(|e| format!("writing {}: {e}", path.display()))
    }

    /// Rig `name`'s record, if there is one.
    pub fn load(name: &str) -> Result<Option<Record>, String> {
        let path = Record::path(name);
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("reading {}: {e}", path.display())),
        };
        let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        Record::from_json(&v).map(Some).ok_or_else(|| format!("{}: not a rig record", path.display()))
    }

    /// Deletes rig `name`'s record (nothing when there is none).
    pub fn delete(name: &str) -> Result<(), String> {
        match fs::remove_file(Record::path(name)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(format!("removing {name}'s record: {e}"))
            }
            _ => Ok(()),
        }
    }

    /// The names of the rigs with a record.
    pub fn names() -> Vec<String> {
        let Ok(dir) = fs::read_dir(DIR) else { return Vec::new() };
        let mut names: Vec<String> = dir
            .filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix(".json").map(str::to_string))
            .collect();
        names.sort();
        names
    }
}

/// The lock every change of rigs holds (an exclusive `flock` on `DIR/.lock`), so that one
/// process's `up` does not take another's half-made rig for a dead one's.
pub struct Lock(#[allow(dead_code)] File);

impl Lock {
    /// Waits for the lock.
    pub fn take() -> Result<Lock, String> {
        fs::create_dir_all(DIR).map_err(|e| format!("making {DIR}: {e}"))?;
        let path = PathBuf::from(DIR).join(".lock");
        let f = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| format!("opening {}: {e}", path.display()))?;
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a descriptor this function owns; no memory is passed.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(format!("locking {}: {}", path.display(), std::io::Error::last_os_error()));
        }
        // Released when the file is closed (on drop).
        Ok(Lock(f))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_bad_ones_are_refused() {
        let r = Record {
            name: "lab".into(),
            hosts: 3,
            rate: Some("100mbit".into()),
            owner: Some(Owner { pid: 7, start: 99 }),
            daemons: vec![Daemon { host: 2, process: Owner { pid: 8, start: 100 } }],
        };
        assert_eq!(Record::from_json(&r.to_json()), Some(r.clone()));
        let bare = Record { rate: None, owner: None, daemons: vec![], ..r };
        assert_eq!(Record::from_json(&bare.to_json()), Some(bare));
        for bad in [json!({}), json!({"name": "x", "hosts": -1, "daemons": []}), json!({"name": 1})] {
            assert_eq!(Record::from_json(&bad), None, "{bad}");
        }
    }

    #[test]
    fn this_process_is_alive_and_a_changed_start_is_not() {
        let me = Owner::this();
        assert!(me.alive());
        assert!(!Owner { start: me.start + 1, ..me }.alive());
        assert!(Owner::of(u32::MAX).is_none());
    }
}
