//! Reading the launcher's environment: torchrun, Open MPI's mpirun, PMI (MPICH/Hydra), Slurm.
//!
//! Rank and size come from the first launcher whose variables are present, in this order:
//! `OXCCL_RANK`/`OXCCL_NRANKS` (explicit), torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`),
//! Open MPI (`OMPI_COMM_WORLD_RANK`, `..._SIZE`, `..._LOCAL_RANK`), PMI (`PMI_RANK`,
//! `PMI_SIZE`, `MPI_LOCALRANKID`), Slurm (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`).
//!
//! The rendezvous point comes from, in order: `OXCCL_UNIQUE_ID` (hex of a unique id, used by
//! oxccl-perf for the ranks it spawns), `OXCCL_COMM_ID` / `NCCL_COMM_ID` (`host:port`, rank 0
//! listens there), `MASTER_ADDR` + `MASTER_PORT` (rank 0 listens on `MASTER_PORT + 1`, because
//! torchrun's own store already holds `MASTER_PORT`; override with `OXCCL_MASTER_PORT`).

use crate::error::{Error, Result};

/// What a launcher told this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks in the job.
    pub size: usize,
    /// Rank among the processes on this host (0 when unknown).
    pub local_rank: usize,
    /// Which launcher's variables were found (`oxccl`, `torchrun`, `mpirun`, `pmi`, `slurm`).
    pub launcher: &'static str,
}

fn var(name: &str) -> Option<String> {
    crate::config::environ::var(name)
}

fn num(name: &str) -> Result<Option<usize>> {
    match var(name) {
        None => Ok(None),
        Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
            Error::invalid_argument(format!("environment variable {name}={v} is not a non-negative integer"))
        }),
    }
}

/// Detects the launcher from the environment; `Ok(None)` when no launcher variables are set.
pub fn detect() -> Result<Option<Launch>> {
    const LAUNCHERS: [(&str, &str, &str, &str); 5] = [
        ("oxccl", "OXCCL_RANK", "OXCCL_NRANKS", "OXCCL_LOCAL_RANK"),
        ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
        ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
        ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ];
    for (launcher, r, s, l) in LAUNCHERS {
        if let (Some(rank), Some(size)) = (num(r)?, num(s)?) {
            if size == 0 || rank >= size {
                return Err(Error::invalid_argument(format!(
                    "{launcher} environment: {r}={rank} is not below {s}={size}"
                )));
            }
            return Ok(Some(Launch { rank, size, local_rank: num(l)?.unwrap_or(0), launcher }));
        }
    }
    Ok(None)
}

/// Where ranks started by a launcher meet, as found in the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rendezvous {
    /// A full unique id (hex), e.g. passed by oxccl-perf to the processes it spawns.
    UniqueId(String),
    /// `host:port` where rank 0 listens.
    Address(String),
}

/// Finds the rendezvous point in the environment (see the module documentation).
pub fn rendezvous() -> Result<Rendezvous> {
    if let Some(id) = var("OXCCL_UNIQUE_ID") {
        return Ok(Rendezvous::UniqueId(id));
    }
    if let Some(addr) = crate::config::BootstrapSettings::from_env().comm_id {
        return Ok(Rendezvous::Address(addr));
    }
    if let Some(host) = var("MASTER_ADDR") {
        let port = match num("OXCCL_MASTER_PORT")? {
            Some(p) => p,
            None => {
                num("MASTER_PORT")?
                    .ok_or_else(|| Error::invalid_argument("MASTER_ADDR is set but MASTER_PORT is not"))?
                    + 1
            }
        };
        let port = u16::try_from(port)
            .map_err(|_| Error::invalid_argument(format!("rendezvous port {port} is out of range")))?;
        return Ok(Rendezvous::Address(if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        }));
    }
    Err(Error::invalid_argument(
        "no rendezvous point in the environment: set OXCCL_COMM_ID=host:port (or NCCL_COMM_ID), \
         or MASTER_ADDR and MASTER_PORT as torchrun does",
    ))
}
