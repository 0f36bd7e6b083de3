//! UCX's posix shared-memory segment ids, as addresses and remote keys carry them: how a
//! segment is named (procfs or `/dev/shm`), whose process it is, and how long its file
//! is. Shared by the address and key validators ([`crate::ucx_address`],
//! [`crate::ucx_key`]).

/// The pid namespace UCX calls the default one (`ucs_sys_ns_is_default`): the initial
/// namespace's inode number.
const DEFAULT_PID_NS: u64 = 0xEFFF_FFFC;

/// Whether a process id UCX packed (with its pid namespace, which UCX adds for a
/// process outside the default one) is this process's.
pub(crate) fn is_this_process(pid: u64, ns: Option<u64>) -> bool {
    let me = crate::ProcessIdentity::current();
    pid == u64::from(me.pid) && ns.unwrap_or(DEFAULT_PID_NS) == me.pid_ns
}

/// The mode bits of a posix segment id (`UCT_POSIX_SEG_FLAG_PROCFS`, `_SHM_OPEN`).
pub(crate) const POSIX_MODE_BITS: u64 = (1 << 63) | (1 << 62);
/// `UCT_POSIX_SEG_FLAG_PID_NS`: the segment's process is outside the default pid
/// namespace, which follows the segment id.
pub(crate) const POSIX_PID_NS: u64 = 1 << 60;

/// The start of the name of each posix segment's file (`UCT_POSIX_FILE_FMT`).
pub(crate) const SEGMENT_PREFIX: &str = "ucx_shm_posix_";

/// The size of the posix segment named by `seg_id`, as UCX opens it: through procfs
/// (`/proc/PID/fd/FD`, the low 30 bits of the id the pid, the next 30 the descriptor) or
/// by name in `/dev/shm`; `None` when it cannot be opened, is not a UCX segment's file,
/// or is named a third way (a file in a directory the key names, which this check does
/// not follow).
pub(crate) fn posix_segment_len(seg_id: u64) -> Option<u64> {
    let mmid = seg_id & !(0xfu64 << 60);
    let meta = if let Some(pid) = posix_procfs_pid(seg_id) {
        let path = format!("/proc/{pid}/fd/{}", mmid >> 30);
        // Any descriptor of any process can be named this way: only a UCX segment's
        // (its file unlinked once opened) is one.
        let target = std::fs::read_link(&path).ok()?;
        let name = target.file_name()?.to_string_lossy().into_owned();
        if !name.starts_with(SEGMENT_PREFIX) {
            return None;
        }
        std::fs::metadata(path).ok()?
    } else if seg_id & (1 << 62) != 0 {
        // `UCT_POSIX_SEG_FLAG_SHM_OPEN`: named in /dev/shm.
        // `shm_open` does not follow a link there.
        std::fs::symlink_metadata(format!("/dev/shm/{SEGMENT_PREFIX}{mmid:x}")).ok()?
    } else {
        return None;
    };
    meta.is_file().then_some(meta.len())
}

/// The process whose descriptor a posix segment id names through procfs
/// (`UCT_POSIX_SEG_FLAG_PROCFS`: the low 30 bits of the id), if it is named that way.
pub(crate) fn posix_procfs_pid(seg_id: u64) -> Option<u64> {
    (seg_id & (1 << 63) != 0).then_some(seg_id & ((1 << 30) - 1))
}
