//! Creating a communicator: joining a rendezvous over TCP (from a unique id or the launcher's
//! environment), or a mesh of in-memory ranks.

use super::*;

/// What ends the waits of a child being made ([`Communicator::join_under`]); nothing by default.
#[derive(Clone, Copy, Default)]
pub(crate) struct Under<'a> {
    /// The parent's channels finding a member dead (split, shrink, grow), whether or not the
    /// parent failed before.
    pub(crate) meeting: Option<&'a crate::control::Meeting>,
    /// The parent's failure for any reason (a split, on a parent that was well when it began).
    pub(crate) parent: Option<&'a Communicator>,
}

impl Under<'_> {
    /// Whether the parent's meeting found a member dead or the parent was aborted.
    fn stopped(&self) -> bool {
        self.meeting.is_some_and(|m| m.is_down()) || self.parent.is_some_and(|p| p.aborted.load(Ordering::Relaxed))
    }

    /// Joins the rendezvous of `id` ([`bootstrap::rendezvous_with`]), ended at once when
    /// [`Under::stopped`]. The root connection is lent to the meeting, which shuts it when a
    /// member is found dead, and goes in the parent's sockets while the rendezvous lasts, so
    /// the parent's failure shuts it.
    fn rendezvous(
        &self,
        id: &UniqueId,
        nranks: usize,
        rank: usize,
        deadline: Instant,
        start_root: bool,
    ) -> Result<Bootstrap> {
        let Under { meeting, parent } = *self;
        let lent = Mutex::new(Vec::new());
        let on_socket = |s: &std::net::TcpStream| {
            if let Some(m) = meeting {
                m.lend(s);
            }
            if let (Some(p), Ok(c)) = (parent, s.try_clone()) {
                lock(&lent).push(std::os::fd::AsRawFd::as_raw_fd(&c));
                lock(&p.sockets).push(c);
            }
        };
        let stop = || self.stopped();
        let boot = bootstrap::rendezvous_with(id, nranks, rank, deadline, start_root, &on_socket, &stop);
        if let Some(m) = meeting {
            m.release();
        }
        if let Some(p) = parent {
            let lent = lock(&lent);
            lock(&p.sockets).retain(|s| !lent.contains(&std::os::fd::AsRawFd::as_raw_fd(s)));
        }
        boot
    }
}

/// A name for a communicator, alike on every rank (the rendezvous' table is the same
/// everywhere): a hash of every rank's address and host.
fn table_tag(boot: &Bootstrap) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for p in &boot.peers {
        p.addr.hash(&mut h);
        p.host.hash(&mut h);
    }
    format!("{:016x}", h.finish())
}

impl Communicator {
    /// Joins the group described by `id` as `rank` of `nranks` (`ncclCommInitRank`), with the
    /// settings of the environment ([`Config::from_env`]).
    ///
    /// With `OXCCL_COMM_ID` set, rank 0 starts the rendezvous root at that address.
    pub fn init_rank(nranks: usize, id: &UniqueId, rank: usize) -> Result<Communicator> {
        Self::init_rank_with_config(nranks, id, rank, Config::from_env())
    }

    /// [`Communicator::init_rank`] with the given settings instead of the environment's
    /// (every rank must pass the same plan-shaping settings).
    pub fn init_rank_with_config(nranks: usize, id: &UniqueId, rank: usize, config: Config) -> Result<Communicator> {
        let start_root = rank == 0 && crate::config::BootstrapSettings::from_env().comm_id.is_some();
        Self::join(nranks, id, rank, start_root, Arc::new(config))
    }

    /// Joins the rendezvous of `id`; with `start_root`, this rank first starts the root at the
    /// id's address.
    pub(crate) fn join(
        nranks: usize,
        id: &UniqueId,
        rank: usize,
        start_root: bool,
        config: Arc<Config>,
    ) -> Result<Communicator> {
        Self::join_under(nranks, id, rank, start_root, config, Under::default())
    }

    /// [`Communicator::join`] of a child made from a parent (split, shrink, grow): `under`
    /// says what ends the child's rendezvous and connection waits at once.
    pub(crate) fn join_under(
        nranks: usize,
        id: &UniqueId,
        rank: usize,
        start_root: bool,
        config: Arc<Config>,
        under: Under<'_>,
    ) -> Result<Communicator> {
        if nranks < 1 {
            return Err(Error::invalid_argument(format!("nranks must be at least 1 (got {nranks})")));
        }
        if rank >= nranks {
            return Err(Error::invalid_argument(format!("rank {rank} is out of range for nranks {nranks}")));
        }
        crate::log::banner();
        crate::log::config_warnings(&config);
        let deadline = Instant::now() + config.timeout;
        let boot = under.rendezvous(id, nranks, rank, deadline, start_root)?;
        match boot.listener.local_addr() {
            Ok(a) => crate::info!("rank {rank} of {nranks} joined; data listener {a}"),
            Err(e) => crate::info!("rank {rank} of {nranks} joined; data listener address unknown ({e})"),
        }
        let comm = Self::from_table(boot, rank, nranks, config, under, deadline)?;
        if nranks > 1 {
            let me = comm.order.iter().position(|&r| r == rank).expect("every rank is in the order");
            let ring = [comm.order[(me + 1) % nranks], comm.order[(me + nranks - 1) % nranks]];
            let mut inner = lock(&comm.inner);
            comm.ensure_links(&mut inner, &ring, deadline).map_err(|e| comm.record(e))?;
        }
        Ok(comm)
    }

    /// The communicator of rank `rank` once the rendezvous gave every rank's address and host
    /// (`boot`): its hosts, ring order and placement, its control channels (several ranks),
    /// no data links yet.
    fn from_table(
        mut boot: Bootstrap,
        rank: usize,
        nranks: usize,
        config: Arc<Config>,
        under: Under<'_>,
        deadline: Instant,
    ) -> Result<Communicator> {
        let hosts: Vec<String> = boot.peers.iter().map(|p| p.host.clone()).collect();
        let tag = table_tag(&boot);
        // The cost model's link kind (an invalid OXCCL_TRANSPORT fails when links are built).
        let shm_allowed = config.transport != Ok(crate::config::TransportMode::Tcp);
        let transport = TransportKind::for_hosts(&hosts, shm_allowed);
        let groups = crate::algo::hier::host_groups(&hosts);
        let order = crate::algo::hier::ring_order(&groups);
        let nhosts = groups.iter().max().map_or(1, |&m| m + 1);
        if nhosts > 1 && rank == 0 {
            crate::info!("{nranks} ranks on {nhosts} hosts; ring order {order:?}");
        }
        let fixed = Fixed::new(rank, &hosts, groups, &config);
        let aborted = Arc::new(AtomicBool::new(false));
        let failure: Arc<Mutex<Option<Error>>> = Default::default();
        let sockets: Arc<Mutex<Vec<std::net::TcpStream>>> = Default::default();
        let mut inner = Inner::new((0..nranks).map(|_| None).collect(), None, None);
        let control = if nranks > 1 {
            let stop = || under.stopped();
            let mine = crate::transport::rails::local(&config);
            // Before any peer can learn this rank's rails: data links reach it on each of them.
            boot.listen_on_rails(&mine);
            let (chans, rails) =
                crate::control::open(&boot, &mut inner.handshakes, &mut inner.pending, &mine, deadline, &stop)?;
            // Each peer's further-rail addresses: where a data link is dialled when its
            // bootstrap address does not answer.
            for r in &rails {
                boot.detours[r.peer] = r
                    .more
                    .iter()
                    .filter_map(|(name, c)| c.stream.peer_addr().ok().map(|a| (name.clone(), a.ip())))
                    .collect();
            }
            let (a, f, s) = (aborted.clone(), failure.clone(), sockets.clone());
            let hooks = crate::control::Hooks::new(rank, &hosts, config.liveness, a, f, s);
            let m = crate::control::watch(hooks, chans)?;
            // Several rails: the channel to each peer gets a connection on each further one.
            m.add_rails(rails);
            Some(m)
        } else {
            None
        };
        inner.boot = Some(boot);
        Ok(Communicator {
            rank,
            size: nranks,
            hosts,
            order,
            inner: Mutex::new(inner),
            aborted,
            failure,
            last_error: Mutex::new(String::new()),
            sockets,
            control,
            timeout_ms: AtomicU64::new(duration_ms(config.timeout)),
            transport,
            tuning: Mutex::new(Overrides::default()),
            plans: Default::default(),
            shrinks: Default::default(),
            grow_id: Mutex::new(None),
            fixed,
            last_plan: Mutex::new(None),
            guard: Default::default(),
            config,
            flight: crate::flight::Recorder::new(rank, nranks, tag),
            probe: Default::default(),
            host_fence: Default::default(),
        })
    }

    /// Joins the group described by the launcher's environment (torchrun, mpirun, srun, or
    /// `OXCCL_RANK`/`OXCCL_NRANKS`); see [`bootstrap::env`] for the variables read.
    pub fn from_env() -> Result<Communicator> {
        let launch = bootstrap::env::detect()?.ok_or_else(|| {
            Error::invalid_argument("no launcher environment found: expected RANK/WORLD_SIZE (torchrun), OMPI_COMM_WORLD_RANK/SIZE (mpirun), PMI_RANK/PMI_SIZE, SLURM_PROCID/SLURM_NTASKS or OXCCL_RANK/OXCCL_NRANKS")
        })?;
        match bootstrap::env::rendezvous()? {
            bootstrap::env::Rendezvous::UniqueId(hex) => {
                Self::join(launch.size, &UniqueId::from_hex(&hex)?, launch.rank, false, Arc::new(Config::from_env()))
            }
            bootstrap::env::Rendezvous::Address(a) => Self::join(
                launch.size,
                &UniqueId::for_address(&a, bootstrap::env_secret())?,
                launch.rank,
                launch.rank == 0,
                Arc::new(Config::from_env()),
            ),
        }
    }

    /// Builds `n` communicators joined by in-memory links, one per rank, for running ranks as
    /// threads of one process (tests, single-process multi-rank use).
    pub fn in_memory(n: usize) -> Vec<Communicator> {
        Self::in_memory_with_config(n, Config::from_env())
    }

    /// [`Communicator::in_memory`] with the given settings instead of the environment's.
    pub fn in_memory_with_config(n: usize, config: Config) -> Vec<Communicator> {
        let config = Arc::new(config);
        crate::log::banner();
        crate::log::config_warnings(&config);
        let (mesh, notifiers) = mem::mesh(n, mem::PIPE_CAPACITY);
        static MESHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let tag = format!("mem{}-{}", std::process::id(), MESHES.fetch_add(1, Ordering::Relaxed));
        let hosts = vec!["in-memory".to_string(); n];
        let flags: Vec<crate::control::Flags> = (0..n).map(|_| Default::default()).collect();
        let hooks = flags
            .iter()
            .enumerate()
            .map(|(rank, (a, f))| {
                crate::control::Hooks::new(rank, &hosts, None, a.clone(), f.clone(), Default::default())
            })
            .collect();
        let mut controls: Vec<Option<crate::control::Membership>> =
            if n > 1 { crate::control::mesh(hooks).into_iter().map(Some).collect() } else { vec![None] };
        mesh.into_iter()
            .zip(notifiers)
            .zip(flags)
            .enumerate()
            .map(|(rank, ((links, notifier), (aborted, failure)))| Communicator {
                rank,
                size: n,
                hosts: vec!["in-memory".into(); n],
                order: (0..n).collect(),
                inner: Mutex::new(Inner::new(
                    links.into_iter().map(|l| l.map(|l| Box::new(l) as Box<dyn Link>)).collect(),
                    None,
                    Some(notifier),
                )),
                aborted,
                failure,
                last_error: Mutex::new(String::new()),
                sockets: Default::default(),
                control: controls[rank].take(),
                timeout_ms: AtomicU64::new(duration_ms(config.timeout)),
                transport: TransportKind::Mem,
                tuning: Mutex::new(Overrides::default()),
                plans: Default::default(),
                shrinks: Default::default(),
                grow_id: Mutex::new(None),
                fixed: Fixed::new(rank, &vec!["in-memory".to_string(); n], vec![0; n], &config),
                last_plan: Mutex::new(None),
                guard: Default::default(),
                config: config.clone(),
                flight: crate::flight::Recorder::new(rank, n, tag.clone()),
                probe: Default::default(),
                host_fence: Default::default(),
            })
            .collect()
    }
}
