//! One error type for the whole library, and its mapping to `ncclResult_t`.

use std::fmt;

/// Category of an error; each maps to one `ncclResult_t` value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum ErrorKind {
    /// `ncclUnhandledCudaError` (1): a CUDA call failed.
    UnhandledCuda = 1,
    /// `ncclSystemError` (2): a local OS call failed (socket, mmap, ...).
    System = 2,
    /// `ncclInternalError` (3): a bug or an unimplemented path inside oxccl.
    Internal = 3,
    /// `ncclInvalidArgument` (4): a bad pointer, count, type, op, root, ...
    InvalidArgument = 4,
    /// `ncclInvalidUsage` (5): the call is not allowed in this state or mismatches other ranks.
    InvalidUsage = 5,
    /// `ncclRemoteError` (6): a peer died, closed its connection or sent bad bytes.
    Remote = 6,
    /// `ncclInProgress` (7): a nonblocking operation has not completed yet.
    InProgress = 7,
    /// `ncclTimeout` (8): an operation made no progress within its deadline.
    Timeout = 8,
}

/// An oxccl error: a kind (the `ncclResult_t`) and a human-readable message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    msg: String,
}

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Builds an error of the given kind.
    pub fn new(kind: ErrorKind, msg: impl Into<String>) -> Error {
        Error { kind, msg: msg.into() }
    }
    /// `ncclInvalidArgument` with a message.
    pub fn invalid_argument(msg: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidArgument, msg)
    }
    /// `ncclInvalidUsage` with a message.
    pub fn invalid_usage(msg: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidUsage, msg)
    }
    /// `ncclInternalError` with a message.
    pub fn internal(msg: impl Into<String>) -> Error {
        Error::new(ErrorKind::Internal, msg)
    }
    /// `ncclSystemError` with a message.
    pub fn system(msg: impl Into<String>) -> Error {
        Error::new(ErrorKind::System, msg)
    }
    /// `ncclRemoteError` with a message.
    pub fn remote(msg: impl Into<String>) -> Error {
        Error::new(ErrorKind::Remote, msg)
    }
    /// `ncclTimeout` with a message.
    pub fn timeout(msg: impl Into<String>) -> Error {
        Error::new(ErrorKind::Timeout, msg)
    }
    /// Maps an OS error from a local call (`what` says which) to `ncclSystemError`.
    pub fn from_io(what: &str, e: std::io::Error) -> Error {
        Error::system(format!("{what}: {e}"))
    }
    /// The category of this error.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
    /// The detailed message.
    pub fn message(&self) -> &str {
        &self.msg
    }
    /// The `ncclResult_t` value of this error.
    pub fn code(&self) -> i32 {
        self.kind as i32
    }
    /// Returns the same error with `prefix: ` put in front of its message.
    pub fn context(self, prefix: impl fmt::Display) -> Error {
        Error { kind: self.kind, msg: format!("{prefix}: {}", self.msg) }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.msg, result_name(self.code()))
    }
}

impl std::error::Error for Error {}

/// One value of `ncclResult_t`: its number, NCCL name, the static text of
/// `ncclGetErrorString`, and the error kind it stands for (`None` for success).
#[derive(Clone, Copy, Debug)]
pub struct ResultCode {
    /// The `ncclResult_t` value.
    pub code: i32,
    /// The NCCL name, e.g. `ncclRemoteError`.
    pub name: &'static str,
    /// What `ncclGetErrorString` returns for it.
    pub text: &'static std::ffi::CStr,
    /// The error kind (`None` for `ncclSuccess`).
    pub kind: Option<ErrorKind>,
}

/// The `ncclResult_t` table, indexed by value: the one place its names, texts and kinds are
/// written (the C ABI's enum, control-channel abort frames and messages all go through it).
pub const RESULT_CODES: [ResultCode; 9] = {
    const fn row(code: i32, name: &'static str, text: &'static std::ffi::CStr, kind: Option<ErrorKind>) -> ResultCode {
        ResultCode { code, name, text, kind }
    }
    use ErrorKind::*;
    [
        row(0, "ncclSuccess", c"no error", None),
        row(1, "ncclUnhandledCudaError", c"unhandled cuda error", Some(UnhandledCuda)),
        row(2, "ncclSystemError", c"unhandled system error", Some(System)),
        row(
            3,
            "ncclInternalError",
            c"internal error - please report this issue to the oxccl developers",
            Some(Internal),
        ),
        row(4, "ncclInvalidArgument", c"invalid argument", Some(InvalidArgument)),
        row(5, "ncclInvalidUsage", c"invalid usage", Some(InvalidUsage)),
        row(6, "ncclRemoteError", c"remote process exited or there was a network error", Some(Remote)),
        row(7, "ncclInProgress", c"operation in progress", Some(InProgress)),
        row(8, "ncclTimeout", c"operation timed out", Some(Timeout)),
    ]
};

/// The row of `code` in [`RESULT_CODES`], if it is a known `ncclResult_t`.
pub fn result_code(code: i32) -> Option<&'static ResultCode> {
    usize::try_from(code).ok().and_then(|i| RESULT_CODES.get(i))
}

/// The NCCL name of an `ncclResult_t` value, e.g. `ncclRemoteError`.
pub fn result_name(code: i32) -> &'static str {
    result_code(code).map_or("unknown ncclResult_t", |r| r.name)
}

/// The static text of `ncclGetErrorString` for an `ncclResult_t` value.
pub fn result_text(code: i32) -> &'static std::ffi::CStr {
    result_code(code).map_or(c"unknown result code", |r| r.text)
}

impl ErrorKind {
    /// The kind of an `ncclResult_t` value (`None` for success and unknown values).
    pub fn from_code(code: i32) -> Option<ErrorKind> {
        result_code(code).and_then(|r| r.kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_result_table_is_indexed_by_value_and_round_trips_every_kind() {
        for (i, r) in RESULT_CODES.iter().enumerate() {
            assert_eq!(r.code, i as i32, "{}", r.name);
            assert_eq!(r.kind.map(|k| k as i32), (i > 0).then_some(i as i32), "{}", r.name);
            assert!(r.name.starts_with("nccl") && !r.text.to_bytes().is_empty());
        }
        assert_eq!(ErrorKind::from_code(6), Some(ErrorKind::Remote));
        assert_eq!((ErrorKind::from_code(0), ErrorKind::from_code(9), ErrorKind::from_code(-1)), (None, None, None));
        assert_eq!(result_name(8), "ncclTimeout");
        assert_eq!(result_name(42), "unknown ncclResult_t");
        assert_eq!(result_text(-3).to_str(), Ok("unknown result code"));
        assert_eq!(Error::timeout("late").to_string(), "late (ncclTimeout)");
        for code in 0..9 {
            assert_eq!(crate::ffi::types::ncclResult_t::from_code(code) as i32, code);
        }
        assert_eq!(crate::ffi::types::ncclResult_t::from_code(9) as i32, 3, "unknown: internal error");
    }
}
