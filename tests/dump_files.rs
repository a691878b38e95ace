//! Files of the flight recorder: the dumps a rank writes are this user's only, and
//! `oxccl-dump merge` refuses hostile input with a message instead of aborting.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

/// A one-rank communicator aborted with `OXCCL_DUMP` set: it writes its dump.
#[test]
fn abort_child() {
    let Some((rank, n, id)) = common::child_role() else { return };
    if std::env::var("DUMP_FILES_CASE").is_err() {
        return;
    }
    let comm = oxccl::Communicator::init_rank(n, &oxccl::UniqueId::from_hex(&id).unwrap(), rank).unwrap();
    comm.abort();
}

/// The dump of an aborted rank is mode 0600 in a directory it made with mode 0700, with no
/// temporary file left (planted symlinks: `flight::tests::dumps_are_private_and_never_follow_a_planted_symlink`).
#[test]
fn a_rank_dump_is_private() {
    if common::child_role().is_some() {
        return;
    }
    let base = std::env::temp_dir().join(format!("oxccl-dump-files-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).unwrap();
    let dir = base.join("dumps");
    let env = [("DUMP_FILES_CASE", "1".to_string()), ("OXCCL_DUMP", dir.display().to_string())];
    common::assert_all_ok(&common::run_ranks("abort_child", 1, &env, std::time::Duration::from_secs(60)));
    let mode = |p: &std::path::Path| std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700, "the dump directory");
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.path()).collect();
    assert_eq!(files.len(), 1, "one dump and no temporary file: {files:?}");
    let dump = &files[0];
    let name = dump.file_name().unwrap().to_str().unwrap().to_string();
    assert!(name.starts_with("oxccl-") && name.ends_with("-rank0.json"), "{name}");
    assert_eq!(mode(dump), 0o600, "the dump");
    let _ = std::fs::remove_dir_all(&base);
}

/// Runs `oxccl-dump merge` on one file holding `text`: (exit code, stderr).
fn merge(text: &str) -> (Option<i32>, String) {
    let f = std::env::temp_dir().join(format!("oxccl-dump-input-{}-{}.json", std::process::id(), text.len()));
    std::fs::write(&f, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_oxccl-dump")).arg("merge").arg(&f).output().expect("run oxccl-dump");
    let _ = std::fs::remove_file(&f);
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// 200,000 nested `[` and `"nranks": 1e300` (which used to abort: stack overflow, then out of
/// memory) end with exit code 1 and a message naming the problem.
#[test]
fn oxccl_dump_refuses_hostile_input_with_a_message() {
    if common::child_role().is_some() {
        return;
    }
    let (code, err) = merge(&"[".repeat(200_000));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("nested deeper than 64"), "{err}");
    let (code, err) = merge(r#"{"rank":0,"nranks":1e300,"comm":"c","ops":[]}"#);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("nranks must be 1 to 1048576"), "{err}");
    let (code, err) = merge(r#"{"rank":5,"nranks":4,"comm":"c","ops":[]}"#);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("rank must be 0 to 3"), "{err}");
    // The largest communicator still gets its verdict, with the silent ranks as one range.
    let (code, err) =
        merge(r#"{"rank":0,"nranks":1048576,"comm":"c","ops":[{"seq":3,"op":"all_reduce","state":"running"}]}"#);
    assert_eq!(code, Some(0), "{err}");
}
