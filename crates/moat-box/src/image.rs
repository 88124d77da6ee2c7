//! Building the read-only images boxes are made from.
//!
//! An image is built in a scratch subvolume and only a finished one is
//! snapshotted, read-only, under its real name; a build that fails or is
//! interrupted leaves nothing an `ls` would show.

use std::fs;
use std::io::{self, BufRead, BufReader};
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};

use moat_core::backend::Progress;
use moat_core::Name;

use crate::pool::{Pool, PoolError};
use crate::sys;

/// Packages the `debian` image adds to a minimal bookworm: what a coding
/// agent reaches for first (a Python with pip and venv, Node with npm, a C
/// toolchain for native extensions, git, curl, ripgrep), what moat's own
/// sessions use (sftp, rsync), and sudo (Ansible's `become`, and scripts
/// written for servers, run it; a box's user is root already).
pub const DEBIAN_PACKAGES: &[&str] = &[
    "bash",
    "coreutils",
    "git",
    "curl",
    "ca-certificates",
    "python3",
    "python3-pip",
    "python3-venv",
    "nodejs",
    "build-essential",
    "ripgrep",
    "rsync",
    "procps",
    "openssh-sftp-server",
    "less",
    "xz-utils",
    "sudo",
];

/// Packages installed with apt inside the new root once debootstrap is done:
/// debootstrap cannot resolve npm's dependencies (virtual packages provided
/// by packages it does not pick), and leaves it unconfigured.
pub const DEBIAN_APT_PACKAGES: &[&str] = &["npm"];

/// Package tools' settings for a box, where the tools look for them. A box is
/// a machine of its own, so pip may install into its Python (Debian refuses
/// that by default: PEP 668), as its root (without a warning); npm does not post audits or ask for funding
/// (the `registries` preset is read-only, so each would be a refusal in the
/// log and a warning on screen).
const TOOL_SETTINGS: &[(&str, &str)] = &[
    ("etc/pip.conf", "[global]\nbreak-system-packages = true\nroot-user-action = ignore\n"),
    ("etc/npmrc", "audit=false\nfund=false\nupdate-notifier=false\n"),
];

/// The mirror `debootstrap` uses unless `MOAT_DEBIAN_MIRROR` says otherwise.
pub const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";

/// Where Debian's busybox-static installs its binary.
const BUSYBOX: &str = "/bin/busybox";

/// An image build failure.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// moat does not know how to build an image of this name.
    #[error("no recipe for image {0} (known: busybox, debian)")]
    UnknownRecipe(Name),
    /// A tool the recipe needs is missing.
    #[error("{0} is not installed (apt-get install {1})")]
    MissingTool(&'static str, &'static str),
    /// The pool failed.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// Writing the image failed.
    #[error("writing image {image}")]
    Io {
        /// The image.
        image: Name,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// Builds `image` into `pool`, reporting progress lines.
pub fn build(pool: &Pool, image: &Name, progress: Progress<'_>) -> Result<(), ImageError> {
    let scratch_name = format!(".build-{image}");
    let scratch = pool.images_dir().join(&scratch_name);
    let io_err = |source| ImageError::Io { image: image.clone(), source };
    if scratch.exists() {
        // Left by an interrupted build.
        sys::subvolume_delete(&pool.images_dir(), &scratch_name).map_err(io_err)?;
    }
    sys::subvolume_create(&pool.images_dir(), &scratch_name).map_err(io_err)?;
    let result = match image.as_str() {
        moat_core::images::BUSYBOX => busybox(&scratch, progress).map_err(io_err),
        moat_core::images::DEBIAN => debian(&scratch, progress).map_err(|e| match e {
            DebianError::Io(source) => io_err(source),
            DebianError::Image(e) => e,
        }),
        _ => Err(ImageError::UnknownRecipe(image.clone())),
    };
    let result = result.and_then(|()| {
        progress(&format!("image {image}: sealing"));
        sys::subvolume_snapshot(&scratch, &pool.images_dir(), image.as_str(), true).map_err(io_err)
    });
    let _ = sys::subvolume_delete(&pool.images_dir(), &scratch_name);
    // Dropping the scratch copy must leave box disk limits enforced.
    let result = result.and_then(|()| Ok(pool.ensure_quotas()?));
    if result.is_ok() {
        progress(&format!("image {image}: ready"));
    }
    result
}

/// The directories every image has: the box setup mounts over some of them.
fn skeleton(root: &Path) -> io::Result<()> {
    for dir in
        ["bin", "sbin", "usr/bin", "usr/sbin", "etc", "root", "proc", "sys", "dev", "run", "tmp", "var/tmp", "home"]
    {
        fs::create_dir_all(root.join(dir))?;
    }
    for tmp in ["tmp", "var/tmp"] {
        fs::set_permissions(root.join(tmp), fs::Permissions::from_mode(0o1777))?;
    }
    fs::set_permissions(root.join("root"), fs::Permissions::from_mode(0o700))
}

/// A tiny image: Debian's static busybox and its applets. Seconds to build; for
/// tests and for boxes that need nothing else.
fn busybox(root: &Path, progress: Progress<'_>) -> io::Result<()> {
    if !Path::new(BUSYBOX).exists() {
        return Err(io::Error::new(io::ErrorKind::NotFound, "/bin/busybox missing (apt-get install busybox-static)"));
    }
    progress("image busybox: installing busybox");
    skeleton(root)?;
    fs::copy(BUSYBOX, root.join("bin/busybox"))?;
    let list = Command::new(BUSYBOX).arg("--list-full").output()?;
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        let link = root.join(applet.trim_start_matches('/'));
        if applet.is_empty() || applet.contains("..") || link.exists() {
            continue;
        }
        if let Some(parent) = link.parent() {
            fs::create_dir_all(parent)?;
        }
        symlink("/bin/busybox", &link)?;
    }
    fs::write(
        root.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
    )?;
    fs::write(root.join("etc/group"), "root:x:0:\ntty:x:5:\nnogroup:x:65534:\n")?;
    fs::write(root.join("etc/os-release"), "NAME=\"moat busybox\"\nID=busybox\n")?;
    Ok(())
}

enum DebianError {
    Io(io::Error),
    Image(ImageError),
}

impl From<io::Error> for DebianError {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

impl From<PoolError> for DebianError {
    fn from(e: PoolError) -> Self {
        Self::Image(e.into())
    }
}

/// Debian bookworm (minbase plus [`DEBIAN_PACKAGES`]) via debootstrap.
fn debian(root: &Path, progress: Progress<'_>) -> Result<(), DebianError> {
    if which("debootstrap").is_none() {
        return Err(DebianError::Image(ImageError::MissingTool("debootstrap", "debootstrap")));
    }
    let mirror = std::env::var("MOAT_DEBIAN_MIRROR").unwrap_or_else(|_| DEFAULT_MIRROR.to_string());
    progress(&format!("image debian: debootstrap bookworm from {mirror} (a few minutes)"));
    let mut child = Command::new("debootstrap")
        .arg("--variant=minbase")
        .arg(format!("--include={}", DEBIAN_PACKAGES.join(",")))
        .arg("bookworm")
        .arg(root)
        .arg(&mirror)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| PoolError::Tool { tool: "debootstrap", stderr: e.to_string() })?;
    let stderr = child.stderr.take();
    let errors = std::thread::spawn(move || {
        stderr
            .map(|s| BufReader::new(s).lines().map_while(Result::ok).collect::<Vec<_>>().join("\n"))
            .unwrap_or_default()
    });
    if let Some(stdout) = child.stdout.take() {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(step) = line.strip_prefix("I: ").filter(|s| is_phase(s)) {
                progress(&format!("image debian: {step}"));
            }
        }
    }
    let status = child.wait().map_err(|e| PoolError::Tool { tool: "debootstrap", stderr: e.to_string() })?;
    let stderr = errors.join().unwrap_or_default();
    if !status.success() {
        return Err(PoolError::Tool { tool: "debootstrap", stderr: last_lines(&stderr, 5) }.into());
    }
    progress(&format!("image debian: apt-get install {}", DEBIAN_APT_PACKAGES.join(" ")));
    apt_install(root, DEBIAN_APT_PACKAGES)?;
    progress("image debian: cleaning up");
    for dir in ["var/cache/apt/archives", "var/lib/apt/lists"] {
        clear_dir_files(&root.join(dir))?;
    }
    for (path, text) in TOOL_SETTINGS {
        fs::write(root.join(path), text)?;
    }
    // Identity is minted per box; the image carries none.
    fs::write(root.join("etc/machine-id"), "")?;
    let _ = fs::remove_file(root.join("etc/hostname"));
    skeleton(root)?;
    Ok(())
}

/// Installs `packages` with apt-get run inside `root` (from the mirror
/// debootstrap wrote into its sources).
fn apt_install(root: &Path, packages: &[&str]) -> Result<(), PoolError> {
    let script = format!("apt-get update -qq && apt-get install -y -qq --no-install-recommends {}", packages.join(" "));
    let out = Command::new("chroot")
        .arg(root)
        .args(["/usr/bin/env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND=noninteractive"])
        .args(["sh", "-c", &script])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| PoolError::Tool { tool: "apt-get", stderr: e.to_string() })?;
    if out.status.success() {
        return Ok(());
    }
    Err(PoolError::Tool { tool: "apt-get", stderr: last_lines(&String::from_utf8_lossy(&out.stderr), 5) })
}

/// The last `n` lines of a tool's `stderr`: why it failed.
fn last_lines(stderr: &str, n: usize) -> String {
    let lines: Vec<&str> = stderr.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Whether a debootstrap info line starts a phase, rather than naming one of
/// the hundreds of packages it retrieves, validates, unpacks and configures.
fn is_phase(line: &str) -> bool {
    let Some((verb, rest)) = line.split_once(' ') else {
        return true;
    };
    let per_package = ["Retrieving", "Validating", "Extracting", "Unpacking", "Configuring"];
    let words: Vec<&str> = rest.trim_end_matches("...").split_whitespace().collect();
    // "bash..." or "bash 5.2.15-2": a package, and maybe its version.
    let names_package = match words.as_slice() {
        [_] => true,
        [_, version] => version.bytes().any(|b| b.is_ascii_digit()),
        _ => false,
    };
    !(per_package.contains(&verb) && names_package)
}

fn clear_dir_files(dir: &Path) -> io::Result<()> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            fs::remove_file(entry.path())?;
        }
    }
    Ok(())
}

/// The path of `tool` on `PATH`, if any.
pub fn which(tool: &str) -> Option<std::path::PathBuf> {
    // Then the system directories: a daemon's PATH may lack the sbin ones.
    let path = std::env::var_os("PATH").and_then(|p| p.into_string().ok()).unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"])
        .filter(|dir| !dir.is_empty())
        .map(|dir| Path::new(dir).join(tool))
        .find(|p| p.is_file());
    found
}

/// The names of the built images.
pub fn list(pool: &Pool) -> io::Result<Vec<String>> {
    let mut names: Vec<String> = fs::read_dir(pool.images_dir())?
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| !n.starts_with('.'))
        .collect();
    names.sort();
    Ok(names)
}

/// Deletes an image. Boxes made from it keep their snapshots.
pub fn remove(pool: &Pool, image: &Name) -> io::Result<()> {
    sys::subvolume_delete(&pool.images_dir(), image.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debootstrap_progress_keeps_phases_only() {
        for phase in [
            "Resolving dependencies of required packages...",
            "Unpacking required packages...",
            "Configuring the base system...",
            "Base system installed successfully.",
        ] {
            assert!(is_phase(phase), "{phase}");
        }
        for noise in [
            "Retrieving bash 5.2.15-2+b13",
            "Validating libc6 2.36-9",
            "Unpacking bash...",
            "Configuring libc6:amd64...",
            "Extracting zlib1g...",
        ] {
            assert!(!is_phase(noise), "{noise}");
        }
    }
}
