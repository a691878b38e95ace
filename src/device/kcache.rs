//! Compiled kernel images kept on disk, so that NVRTC runs once per machine rather than once
//! per process (a cubin of `cuda/reduce.cu` takes seconds to build).
//!
//! The directory is `OXCCL_KERNEL_CACHE` (`0` turns the cache off), by default
//! `$XDG_CACHE_HOME/oxccl` or `$HOME/.cache/oxccl`, created with mode 0700. An entry's name is
//! the SHA-256 of everything that shapes the image: NVRTC's version, the target (`sm_90` cubin
//! or `compute_90` PTX), the options and the source. An entry is written under a fresh
//! temporary name (`O_EXCL`) and renamed into place, so readers never see half a file; it
//! holds a magic line, the SHA-256 of the image and the image, and is used only when that hash
//! matches. That hash catches damage, not tampering (anyone who can write the file can recompute
//! it): what makes an entry trusted is who can write it. The directory must be owned by the
//! effective uid and writable by nobody else, and so must each entry, opened with `O_NOFOLLOW`
//! (a symbolic link is never followed); a directory that fails this is neither read nor written,
//! an entry that fails it is not loaded. Any failure to read or write the cache is a WARN line
//! and a compile, never an error.

use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// First bytes of an entry.
const MAGIC: &[u8] = b"oxccl-kernel-cache-1\n";

/// The key of an image: hex SHA-256 over the inputs, each length-prefixed.
pub(crate) fn key(nvrtc: (i32, i32), target: &str, options: &[&str], source: &str) -> String {
    let mut h = Sha256::new();
    let mut part = |b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    part(MAGIC);
    part(format!("nvrtc {}.{}", nvrtc.0, nvrtc.1).as_bytes());
    part(target.as_bytes());
    for o in options {
        part(o.as_bytes());
    }
    part(source.as_bytes());
    hex(&h.finalize())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The file of `key` in `dir`.
pub(crate) fn entry(dir: &Path, key: &str) -> PathBuf {
    dir.join(format!("{key}.bin"))
}

/// Why a file or directory with metadata `md` may have been written by someone else: `None`
/// when it is owned by the effective uid and neither group- nor world-writable.
fn foreign(md: &std::fs::Metadata) -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if md.uid() != me {
        Some(format!("owned by uid {}, not by this user (uid {me})", md.uid()))
    } else if md.mode() & 0o022 != 0 {
        Some(format!("writable by others (mode {:o})", md.mode() & 0o7777))
    } else {
        None
    }
}

/// True when `dir` may hold kernels this process runs: it does not exist yet (a store creates
/// it, private), or it is a directory owned by the effective uid that no one else can write.
/// Otherwise one WARN line per process, and the cache is neither read nor written.
pub(crate) fn usable(dir: &Path) -> bool {
    let why = match std::fs::metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return true,
        Err(e) => format!("cannot be inspected: {e}"),
        Ok(md) if !md.is_dir() => "is not a directory".to_string(),
        Ok(md) => match foreign(&md) {
            None => return true,
            Some(why) => why,
        },
    };
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        crate::warn!(
            "kernel cache: {} is {why}; its entries could be planted by another user, so it is neither read nor \
             written (kernels are compiled in every process); point OXCCL_KERNEL_CACHE at a private directory",
            dir.display()
        )
    });
    false
}

/// The image stored under `key`, when present, intact and written by this user (see the module
/// documentation; [`usable`] has checked the directory).
pub(crate) fn load(dir: &Path, key: &str) -> Option<Vec<u8>> {
    let path = entry(dir, key);
    // O_NONBLOCK: a planted FIFO must not block the open (regular files ignore it).
    let opened = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(&path);
    let mut file = match opened {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            crate::warn!("kernel cache: {} is a symbolic link; not loaded, compiling", path.display());
            return None;
        }
        Err(e) => {
            crate::warn!("kernel cache: cannot read {}: {e}; compiling", path.display());
            return None;
        }
    };
    let why = match file.metadata() {
        Ok(md) if !md.is_file() => Some("not a regular file".to_string()),
        Ok(md) => foreign(&md),
        Err(e) => Some(format!("cannot be inspected: {e}")),
    };
    if let Some(why) = why {
        crate::warn!("kernel cache: {} is {why}; not loaded, compiling", path.display());
        return None;
    }
    let mut data = Vec::new();
    if let Err(e) = file.read_to_end(&mut data) {
        crate::warn!("kernel cache: cannot read {}: {e}; compiling", path.display());
        return None;
    }
    let body = data.strip_prefix(MAGIC).filter(|b| b.len() >= 32);
    match body {
        Some(b) if Sha256::digest(&b[32..]).as_slice() == &b[..32] => Some(b[32..].to_vec()),
        _ => {
            crate::warn!("kernel cache: {} is damaged (hash mismatch); compiling again", path.display());
            None
        }
    }
}

/// Stores `image` under `key` (best effort: a failure is a WARN line).
pub(crate) fn store(dir: &Path, key: &str, image: &[u8]) {
    if let Err(e) = try_store(dir, key, image) {
        crate::warn!("kernel cache: cannot store a kernel image in {}: {e}", dir.display());
    }
}

fn try_store(dir: &Path, key: &str, image: &[u8]) -> std::io::Result<()> {
    create_private_dir(dir)?;
    if let Some(why) = std::fs::metadata(dir).ok().as_ref().and_then(foreign) {
        return Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, format!("the directory is {why}")));
    }
    let tmp = dir.join(format!(".{key}.{}.{}.tmp", std::process::id(), unique()));
    let res = (|| {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
        f.write_all(MAGIC)?;
        f.write_all(&Sha256::digest(image))?;
        f.write_all(image)?;
        f.sync_all()?;
        std::fs::rename(&tmp, entry(dir, key))
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// How long a process waits for another to finish compiling the same entry before compiling
/// it itself (the whole of `cuda/reduce.cu` takes real NVRTC about a minute; one unit seconds).
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(180);

/// Held while this process compiles the image of one key; dropping it releases the lock.
pub(crate) struct CompileLock(#[allow(dead_code)] std::fs::File);

/// Takes the compile lock of `key` in `dir` (an `flock` on a private file beside the entry), so
/// that of several processes of this host that miss the same entry one compiles and the others
/// load its image. `None` (compile without it) when the lock file cannot be made or another
/// process held it past [`LOCK_WAIT`] (a WARN line).
pub(crate) fn lock(dir: &Path, key: &str) -> Option<CompileLock> {
    use std::os::fd::AsRawFd;
    create_private_dir(dir).ok()?;
    let path = dir.join(format!(".{key}.lock"));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .ok()?;
    let start = std::time::Instant::now();
    loop {
        // SAFETY: `file` is an open descriptor for the whole call.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Some(CompileLock(file));
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) || start.elapsed() > LOCK_WAIT {
            crate::warn!(
                "kernel cache: cannot take {} ({}); compiling without waiting for the other process",
                path.display(),
                if start.elapsed() > LOCK_WAIT {
                    format!("held for over {} s", LOCK_WAIT.as_secs())
                } else {
                    e.to_string()
                }
            );
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A number distinct for each temporary file of this process.
fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Creates `dir` (and its parents) with mode 0700 for the directories made here.
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_images_load_back_and_damage_is_refused() {
        let dir = std::env::temp_dir().join(format!("oxccl-kcache-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let k = key((13, 0), "sm_90", &["--std=c++17"], "kernel source");
        assert_eq!(k.len(), 64);
        assert_ne!(k, key((13, 1), "sm_90", &["--std=c++17"], "kernel source"));
        assert_ne!(k, key((13, 0), "sm_100", &["--std=c++17"], "kernel source"));
        assert_ne!(k, key((13, 0), "sm_90", &["--std=c++20"], "kernel source"));
        assert_ne!(k, key((13, 0), "sm_90", &["--std=c++17"], "kernel source "));
        assert_eq!(load(&dir, &k), None);
        store(&dir, &k, b"image bytes");
        assert_eq!(load(&dir, &k).as_deref(), Some(&b"image bytes"[..]));
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        }
        let mut data = std::fs::read(entry(&dir, &k)).unwrap();
        let last = data.len() - 1;
        data[last] ^= 1;
        std::fs::write(entry(&dir, &k), &data).unwrap();
        assert_eq!(load(&dir, &k), None, "a damaged entry must not load");
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "no temporary file left: {names:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
