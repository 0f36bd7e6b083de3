//! Where this process stands in its group, read from the variables the launchers set:
//!
//! | launcher | rank | size | local rank | store |
//! |---|---|---|---|---|
//! | Open MPI `mpirun` | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` | [`STORE_ENV`] |
//! | Slurm `srun` | `SLURM_PROCID` | `SLURM_NTASKS` | `SLURM_LOCALID` | [`STORE_ENV`] |
//! | torchrun and the like | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` | `MASTER_ADDR`:`MASTER_PORT` |
//!
//! The one variable of ucxkit's own, [`STORE_ENV`], says where the store is where the
//! launcher does not (and overrides `MASTER_ADDR`/`MASTER_PORT`): `host:port` for a
//! [`super::TcpStore`] that rank 0 serves on that address, or `file:DIR` for a
//! [`super::FileStore`] in DIR (a directory of this job's own: keys of an earlier job
//! left there would be read as this one's).

use crate::error::{Error, Result};

/// The variable that names the store: `host:port` or `file:DIR`.
pub const STORE_ENV: &str = "UCXKIT_STORE";

/// The launcher that described the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// Open MPI's `mpirun`.
    OpenMpi,
    /// Slurm's `srun`.
    Slurm,
    /// torchrun, or anything else that sets `RANK` and `WORLD_SIZE`.
    Torchrun,
}

/// Where the ranks meet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreAddr {
    /// A TCP store rank 0 serves on this `host:port`.
    Tcp(String),
    /// A file store in this directory.
    File(std::path::PathBuf),
}

impl std::str::FromStr for StoreAddr {
    type Err = Error;
    fn from_str(s: &str) -> Result<StoreAddr> {
        match s.strip_prefix("file:") {
            Some(dir) if !dir.is_empty() => Ok(StoreAddr::File(dir.into())),
            Some(_) => Err(Error::Bootstrap("file: needs a directory (file:/path)".into())),
            None if s.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok()) => {
                Ok(StoreAddr::Tcp(s.into()))
            }
            None => Err(Error::Bootstrap(format!("{s:?} is neither host:port nor file:DIR"))),
        }
    }
}

/// This process's place in its group, as its launcher described it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Which launcher.
    pub launcher: Launcher,
    /// This process's rank.
    pub rank: usize,
    /// The number of ranks.
    pub size: usize,
    /// The rank among the processes on this host, when the launcher says.
    pub local_rank: Option<usize>,
    /// Where the ranks meet.
    pub store: StoreAddr,
}

/// Reads this process's environment (see the module docs).
///
/// # Errors
/// [`Error::Bootstrap`] when no launcher's variables are set, when they do not parse,
/// or when nothing says where the store is.
pub fn detect() -> Result<Launch> {
    detect_from(|k| std::env::var(k).ok())
}

/// [`detect`] over any source of variables.
///
/// # Errors
/// As for [`detect`].
pub fn detect_from(var: impl Fn(&str) -> Option<String>) -> Result<Launch> {
    let num = |k: &str| -> Result<Option<usize>> {
        var(k)
            .map(|v| {
                v.trim().parse::<usize>().map_err(|_| Error::Bootstrap(format!("{k}={v:?} is not a number")))
            })
            .transpose()
    };
    let forms = [
        (Launcher::OpenMpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        (Launcher::Slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
        (Launcher::Torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ];
    for (launcher, rank, size, local) in forms {
        let (Some(r), Some(n)) = (num(rank)?, num(size)?) else { continue };
        if n == 0 || r >= n {
            return Err(Error::Bootstrap(format!("{rank}={r} is not a rank of {size}={n}")));
        }
        let store = match (var(STORE_ENV), var("MASTER_ADDR"), var("MASTER_PORT")) {
            (Some(s), _, _) => s.parse()?,
            (None, Some(a), Some(p)) if launcher == Launcher::Torchrun => format!("{a}:{p}").parse()?,
            _ => {
                return Err(Error::Bootstrap(format!(
                    "{launcher:?} says rank {r} of {n} but not where the ranks meet: set {STORE_ENV}=host:port (rank 0 serves it) or {STORE_ENV}=file:DIR"
                )))
            }
        };
        return Ok(Launch { launcher, rank: r, size: n, local_rank: num(local)?, store });
    }
    Err(Error::Bootstrap(
        "no launcher's variables found (OMPI_COMM_WORLD_RANK, SLURM_PROCID or RANK with their sizes)".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn each_launcher_is_read() {
        let l = detect_from(env(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            (STORE_ENV, "node0:7000"),
        ]))
        .expect("mpirun");
        assert_eq!((l.launcher, l.rank, l.size, l.local_rank), (Launcher::OpenMpi, 2, 4, Some(0)));
        assert_eq!(l.store, StoreAddr::Tcp("node0:7000".into()));
        let dir = std::env::temp_dir().join("job");
        let store = format!("file:{}", dir.display());
        let l =
            detect_from(env(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2"), (STORE_ENV, store.as_str())]))
                .expect("srun");
        assert_eq!((l.launcher, l.local_rank, l.store), (Launcher::Slurm, None, StoreAddr::File(dir)));
        let l = detect_from(env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .expect("torchrun");
        assert_eq!((l.launcher, l.store), (Launcher::Torchrun, StoreAddr::Tcp("127.0.0.1:29500".into())));
    }

    #[test]
    fn missing_or_bad_variables_are_explained() {
        let e = detect_from(env(&[])).expect_err("nothing");
        assert!(e.to_string().contains("OMPI_COMM_WORLD_RANK"), "{e}");
        let e = detect_from(env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")])).expect_err("no store");
        assert!(e.to_string().contains(STORE_ENV), "{e}");
        assert!(detect_from(env(&[("RANK", "x"), ("WORLD_SIZE", "2")])).is_err());
        assert!(detect_from(env(&[("RANK", "2"), ("WORLD_SIZE", "2"), (STORE_ENV, "h:1")])).is_err());
        assert!(detect_from(env(&[("RANK", "0"), ("WORLD_SIZE", "2"), (STORE_ENV, "nonsense")])).is_err());
        assert!("file:".parse::<StoreAddr>().is_err());
    }
}
