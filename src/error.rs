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

/// The NCCL name of an `ncclResult_t` value, e.g. `ncclRemoteError`.
pub fn result_name(code: i32) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => "unknown ncclResult_t",
    }
}
