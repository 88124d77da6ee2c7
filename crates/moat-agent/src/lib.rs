//! moat-agent: the process that is PID 1 in every box, and the wire protocol the host
//! uses to talk to it.
//!
//! One protocol for both backends: the namespace backend carries it over a unix
//! socket, the VM backend will carry it over a virtio-serial port. Each connection
//! carries exactly one operation (an exec, a TCP connection into the box, or a
//! ping), so a transport only has to provide independent byte streams.

pub mod hangup;
pub mod mux;
pub mod protocol;
pub mod walk;

/// How long each try to connect to a port in a box waits, doubling, about
/// 5 s in all. A listener whose accept queue is full (`busybox httpd` listens
/// with a backlog of 9) drops the SYN, and the kernel sends it again only
/// after a second: a new try sooner gets in as soon as the server accepts
/// again.
pub const CONNECT_TRIES_MS: [u64; 10] = [5, 10, 20, 40, 80, 160, 320, 640, 1280, 2560];

/// What the agent, as PID 1 of a microVM guest, prints on the console once
/// the guest is up, followed by the kernel release it runs on.
pub const GUEST_UP: &str = "moat-agent: guest up, kernel";

/// The kernel command line word that asks the guest to power off once up
/// (a boot probe).
pub const PROBE_ARG: &str = "moat.probe";

/// Where a guest's initramfs keeps the kernel modules its agent loads, in
/// the order of their file names.
pub const GUEST_MODULES_DIR: &str = "/lib/moat/modules";

/// What the guest agent prints before [`GUEST_UP`], followed by the virtio
/// devices it found (by kind).
pub const GUEST_DEVICES: &str = "moat-agent: virtio devices:";

/// The name of the virtio-serial port the host reaches a guest's agent on
/// (streams multiplexed over it: see [`mux`]).
pub const AGENT_PORT: &str = "moat.agent";

/// What the guest agent prints before [`GUEST_UP`] when it has a disk,
/// followed by what it found on it (it then runs on it as its root).
pub const GUEST_DISK: &str = "moat-agent: root disk:";

/// Where a guest's initramfs carries the host's files for its root (a
/// mini-root: `etc/hostname`, keys, ...), which the agent writes onto the
/// root disk at boot (see `HostMsg::PutFile` for a running guest).
pub const GUEST_FILES_DIR: &str = "/moat/files";

/// A guest's own address on its network device (the same address a
/// namespace box's connections come from).
pub const GUEST_ADDR: std::net::Ipv4Addr = std::net::Ipv4Addr::new(198, 18, 0, 1);

/// The host end of a guest's network device: its one router, reached on
/// the link (the host's box namespace turns every connection through it
/// to the egress gateway).
pub const GUEST_ROUTER: std::net::Ipv4Addr = std::net::Ipv4Addr::new(169, 254, 0, 1);

#[cfg(feature = "client")]
pub mod client;
