//! The `listen_unix` socket file: binding it, and removing it at exit.
//!
//! A file left at the path by a sidecar that did not exit cleanly (SIGKILL, OOM) would make
//! `bind` fail with "address in use" forever. So at bind, a socket file that nothing answers on
//! is removed first; a socket something answers on, and anything that is not a socket (a
//! regular file, a directory), is left alone and refused as a config error naming
//! `listen_unix`. At exit the file is removed, unless another process has replaced it meanwhile
//! (a new sidecar of a rolling restart): only the file this process created goes.
//!
//! Permissions: the socket file gets the process umask's mode (0777 & !umask; 0755 under the
//! usual 022, and connecting needs write permission). To limit who may connect, put it in a
//! directory only the intended users can traverse.
//!
//! # Race window
//! Between finding a stale socket and binding, another process could bind the same path; the
//! later `bind` then fails with "address in use", which is reported like any other bind error.

use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};

/// How long a connect to an existing socket file may take before it counts as in use (a live
/// listener with a full backlog makes `connect` wait).
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// The bound `listen_unix` socket; the file is removed when this is dropped.
#[derive(Debug)]
pub struct UnixSocket {
    /// The listening socket.
    pub listener: UnixListener,
    /// Removes the file on drop.
    pub file: SocketFile,
}

/// The socket file this process created: removed on drop if it is still that file.
#[derive(Debug)]
pub struct SocketFile {
    path: PathBuf,
    /// Device and inode at bind.
    identity: (u64, u64),
}

impl SocketFile {
    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        let ours = std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.identity);
        if ours {
            if let Err(e) = std::fs::remove_file(&self.path) {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot remove listen_unix socket file");
            }
        }
    }
}

/// Binds `path`, replacing a stale socket file; errors name `listen_unix`.
pub async fn bind(path: &Path) -> io::Result<UnixSocket> {
    let error = |kind: io::ErrorKind, why: String| {
        io::Error::new(kind, format!("binding listen_unix {}: {why}", path.display()))
    };
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            match answers(path).await {
                Ok(false) => {}
                Ok(true) => {
                    return Err(error(
                        io::ErrorKind::AddrInUse,
                        "another process is listening on this socket".into(),
                    ))
                }
                Err(e) => return Err(error(e.kind(), format!("probing the existing socket: {e}"))),
            }
            std::fs::remove_file(path)
                .map_err(|e| error(e.kind(), format!("removing the stale socket: {e}")))?;
            tracing::info!(path = %path.display(), "removed a stale listen_unix socket file");
        }
        Ok(_) => {
            return Err(error(
                io::ErrorKind::AlreadyExists,
                "the path exists and is not a socket; remove it or choose another path".into(),
            ))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(error(e.kind(), e.to_string())),
    }
    let listener = UnixListener::bind(path).map_err(|e| error(e.kind(), e.to_string()))?;
    let meta = std::fs::symlink_metadata(path).map_err(|e| error(e.kind(), e.to_string()))?;
    Ok(UnixSocket {
        listener,
        file: SocketFile {
            path: path.to_owned(),
            identity: (meta.dev(), meta.ino()),
        },
    })
}

/// Whether something accepts connections on the socket file at `path`.
async fn answers(path: &Path) -> io::Result<bool> {
    match tokio::time::timeout(PROBE_TIMEOUT, UnixStream::connect(path)).await {
        // A full backlog answers a non-blocking connect with EAGAIN: someone listens.
        Ok(Ok(_)) | Err(_) => Ok(true),
        Ok(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => Ok(true),
        // Refused: no listener (the stale file of an exited process).
        Ok(Err(e)) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(false),
        Ok(Err(e)) => Err(e),
    }
}
