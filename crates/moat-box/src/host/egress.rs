//! The privileged half of a box's egress: the gateway's sockets, made inside
//! the box's network namespace (a socket belongs to the namespace it was made
//! in, wherever it is used later) and handed to the unprivileged gateway,
//! which could not make them there itself.

use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::{Duration, Instant};

use moat_core::egress::{Role, DNS_PORT, PROXY_PORT};

/// As [`listeners_in`], waiting up to a second for the ports to be let go
/// of: by the gateway of a daemon that just exited, or by the gateway still
/// closing what the box had before it was suspended a moment ago.
pub fn listeners_when_free(netns: &Path) -> io::Result<Vec<(Role, OwnedFd)>> {
    let deadline = Instant::now() + Duration::from_secs(1);
    let mut pause = Duration::from_millis(1);
    loop {
        match listeners_in(netns) {
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                tracing::debug!(error = %e, "a gateway port is still held");
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            other => return other,
        }
    }
}

/// The gateway's listeners in the box's network namespace at `netns`: DNS
/// over UDP and TCP and the proxy, on `127.0.0.1` and (where the namespace
/// has IPv6) `::1`, and the netlink socket its dropped packets are logged to.
pub fn listeners_in(netns: &Path) -> io::Result<Vec<(Role, OwnedFd)>> {
    briefly_in_netns(netns, || {
        let mut out = Vec::new();
        for (host, required) in [("127.0.0.1", true), ("::1", false)] {
            let made = (|| -> io::Result<[(Role, OwnedFd); 3]> {
                let ip: std::net::IpAddr = host.parse().map_err(io::Error::other)?;
                Ok([
                    (Role::DnsUdp, std::net::UdpSocket::bind((ip, DNS_PORT))?.into()),
                    (Role::DnsTcp, std::net::TcpListener::bind((ip, DNS_PORT))?.into()),
                    (Role::Proxy, std::net::TcpListener::bind((ip, PROXY_PORT))?.into()),
                ])
            })();
            match made {
                Ok(sockets) => out.extend(sockets),
                // A namespace without IPv6 has no IPv6 to serve (a port
                // still held is waited for, as on IPv4).
                Err(e) if !required && e.kind() != io::ErrorKind::AddrInUse => {}
                Err(e) => return Err(io::Error::new(e.kind(), format!("listen on {host} in the box: {e}"))),
            }
        }
        // Without it, dropped UDP and ICMP are still dropped, just not logged.
        match super::nflog::dropped_packets() {
            Ok(fd) => out.push((Role::Dropped, fd)),
            // The log group is still bound by the socket being let go of
            // (a suspended box's, the gateway closing it): waited for.
            Err(e) if e.kind() == io::ErrorKind::ResourceBusy => {
                return Err(io::Error::new(io::ErrorKind::AddrInUse, format!("dropped packets' log: {e}")))
            }
            Err(e) => tracing::warn!(error = %e, "dropped UDP and ICMP will not be logged"),
        }
        Ok(out)
    })
}

/// Runs `work` on this thread in the network namespace at `netns`, and
/// brings the thread back to its own after. For short work that does not
/// block (a resume's sockets, ~50 us): handed to a thread of its own, the
/// same work waited for a core up to milliseconds on a busy host. Refuses
/// the namespace the thread is in already: callers mean a box's, and a
/// box's `/proc/PID/ns/net` whose process is gone and whose pid a host
/// process took would name the host's.
pub fn briefly_in_netns<T>(netns: &Path, work: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
    let target =
        std::fs::File::open(netns).map_err(|e| io::Error::new(e.kind(), format!("open {}: {e}", netns.display())))?;
    briefly_in_open_netns(&target, work)
}

/// [`briefly_in_netns`], for a namespace already open as `target`.
pub fn briefly_in_open_netns<T>(target: &std::fs::File, work: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
    use std::os::unix::fs::MetadataExt;
    let own = std::fs::File::open("/proc/thread-self/ns/net")
        .map_err(|e| io::Error::new(e.kind(), format!("open our own namespace to return from: {e}")))?;
    let (ours, theirs) = (own.metadata()?, target.metadata()?);
    if (ours.dev(), ours.ino()) == (theirs.dev(), theirs.ino()) {
        let why = "enter a box's network namespace: it is the host's own";
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, why));
    }
    nix::sched::setns(target, nix::sched::CloneFlags::CLONE_NEWNET)
        .map_err(|e| io::Error::new(io::Error::from(e).kind(), format!("enter a box's network namespace: {e}")))?;
    let _back = Return(own);
    work()
}

/// Takes this thread back to its own network namespace when dropped (a
/// panic included). A thread that cannot go back would make every later
/// socket of its process in a box's namespace, so the process ends.
struct Return(std::fs::File);

impl Drop for Return {
    fn drop(&mut self) {
        if let Err(e) = nix::sched::setns(&self.0, nix::sched::CloneFlags::CLONE_NEWNET) {
            eprintln!("moat: a thread cannot leave a box's network namespace ({e}); ending the process");
            std::process::abort();
        }
    }
}

/// Runs `work` on a thread of its own that has entered the network namespace
/// at `netns` (this thread stays where it is).
pub fn in_netns<T: Send, E: From<io::Error> + Send>(
    netns: &Path,
    work: impl FnOnce() -> Result<T, E> + Send,
) -> Result<T, E> {
    let fail = |what: &str, e: io::Error| E::from(io::Error::new(e.kind(), format!("{what} {}: {e}", netns.display())));
    let ns = std::fs::File::open(netns).map_err(|e| fail("open", e))?;
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| fail("enter", e.into()))?;
            work()
        })
        .join()
        .map_err(|_| fail("a thread in", io::Error::other("panicked")))?
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    fn namespace_here() -> u64 {
        std::fs::metadata("/proc/thread-self/ns/net").unwrap().ino()
    }

    #[test]
    fn briefly_in_netns_comes_back_whatever_the_work_does() {
        // A namespace of its own, held by a thread that waits.
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            tx.send((format!("/proc/self/task/{}/ns/net", nix::unistd::gettid()), namespace_here())).unwrap();
            let _ = done_rx.recv();
        });
        let (path, theirs) = rx.recv().unwrap();
        let ours = namespace_here();
        assert_ne!(ours, theirs);
        let seen = briefly_in_netns(Path::new(&path), || Ok(namespace_here())).unwrap();
        assert_eq!((seen, namespace_here()), (theirs, ours));
        let failed: io::Result<()> = briefly_in_netns(Path::new(&path), || Err(io::Error::other("no")));
        assert!(failed.is_err());
        assert_eq!(namespace_here(), ours);
        let panicked =
            std::panic::catch_unwind(|| briefly_in_netns(Path::new(&path), || -> io::Result<()> { panic!() }));
        assert!(panicked.is_err());
        assert_eq!(namespace_here(), ours, "back after a panic");
        // Not a namespace, or this thread's own: refused, and it stays.
        assert!(briefly_in_netns(Path::new("/dev/null"), || Ok(())).is_err());
        let own = briefly_in_netns(Path::new("/proc/self/ns/net"), || Ok(())).unwrap_err();
        assert!(own.to_string().contains("the host's own"), "{own}");
        assert_eq!(namespace_here(), ours);
        done_tx.send(()).unwrap();
        holder.join().unwrap();
    }
}
