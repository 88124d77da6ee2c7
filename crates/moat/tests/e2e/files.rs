//! scp, sftp and rsync to and from a box.

use std::process::Command;

use crate::fixture::{run, unique};
use crate::Env;

fn payload(env: &Env, name: &str, len: usize) -> std::path::PathBuf {
    let path = env.dir.join(name);
    let data: Vec<u8> = (0..len).map(|i| (i * 7919 % 251) as u8).collect();
    std::fs::write(&path, data).unwrap();
    path
}

fn scp(env: &Env) -> Command {
    let mut cmd = Command::new("timeout");
    cmd.arg("300").arg("scp").args(env.daemon.ssh_opts(&env.alice)).arg("-P").arg(env.daemon.port.to_string());
    cmd
}

pub fn scp_both_ways(env: &Env) {
    let name = unique("scp");
    env.new_box(&name, &[]);
    let src = payload(env, &format!("{name}.bin"), 5 << 20);
    run(scp(env).arg(&src).arg(format!("{name}@127.0.0.1:/root/in.bin"))).ok();
    let back = env.dir.join(format!("{name}.back"));
    run(scp(env).arg(format!("{name}@127.0.0.1:/root/in.bin")).arg(&back)).ok();
    assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&back).unwrap());
    // Recursive, into a relative path (the box user's home).
    let tree = env.dir.join(format!("{name}-tree"));
    std::fs::create_dir_all(tree.join("sub")).unwrap();
    std::fs::write(tree.join("sub/a.txt"), "a\n").unwrap();
    run(scp(env).arg("-r").arg(&tree).arg(format!("{name}@127.0.0.1:work"))).ok();
    let out = env.alice(Some(&name), &["cat /root/work/sub/a.txt"]).ok();
    assert_eq!(out.stdout, "a\n");
}

pub fn sftp_batch(env: &Env) {
    let name = unique("sftp");
    env.new_box(&name, &[]);
    let src = payload(env, &format!("{name}.bin"), 1 << 20);
    let back = env.dir.join(format!("{name}.back"));
    let batch = env.dir.join(format!("{name}.batch"));
    std::fs::write(
        &batch,
        format!(
            "mkdir /srv/x\ncd /srv/x\nput {}\nls -l\nrename {name}.bin renamed.bin\nget renamed.bin {}\n",
            src.display(),
            back.display()
        ),
    )
    .unwrap();
    let mut cmd = Command::new("timeout");
    cmd.arg("300").arg("sftp").args(env.daemon.ssh_opts(&env.alice)).arg("-P").arg(env.daemon.port.to_string());
    cmd.arg("-b").arg(&batch).arg(format!("{name}@127.0.0.1"));
    let out = run(&mut cmd).ok();
    assert!(out.stdout.contains(&format!("{name}.bin")), "{}", out.stdout);
    assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&back).unwrap());
}

/// An image without `sftp-server` (busybox's) still serves sftp and scp
/// (SFTP since OpenSSH 9): the agent's own server answers, as the session's
/// user, and OpenSSH's client gets what it would from OpenSSH's server.
pub fn sftp_and_scp_without_the_images_sftp_server(env: &Env) {
    let name = unique("sftp-own");
    env.new_box(&name, &["--image", "busybox"]);
    let listed = env.alice(Some(&name), &["ls /usr/lib/openssh /usr/libexec 2>&1 | grep -c sftp-server"]);
    assert_eq!(listed.stdout.trim(), "0", "the image has an sftp-server of its own");
    let src = payload(env, &format!("{name}.bin"), 3 << 20);
    let back = env.dir.join(format!("{name}.back"));
    let batch = env.dir.join(format!("{name}.batch"));
    // A leading `-` lets the batch go on past a command's expected failure.
    let script = format!(
        "mkdir d\nput {} d/in.bin\nrename d/in.bin d/r.bin\nsymlink d/r.bin ln\nchmod 640 d/r.bin\n\
         cp d/r.bin d/copy.bin\nls -l d\nget ln {}\ndf\n-mkdir d\n-rm nothing-here\n",
        src.display(),
        back.display()
    );
    std::fs::write(&batch, script).unwrap();
    let mut cmd = Command::new("timeout");
    cmd.arg("300").arg("sftp").args(env.daemon.ssh_opts(&env.alice)).arg("-P").arg(env.daemon.port.to_string());
    cmd.arg("-b").arg(&batch).arg(format!("{name}@127.0.0.1"));
    let out = run(&mut cmd).ok();
    assert!(out.stdout.contains("-rw-r-----") && out.stdout.contains("r.bin"), "{}", out.stdout);
    assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&back).unwrap());
    assert!(out.stderr.contains("remote mkdir") && out.stderr.contains("No such file"), "{}", out.stderr);
    // `cp` copied in the box (copy-data), byte for byte.
    let inside =
        env.alice(Some(&name), &["readlink ln; stat -c '%a %s' d/r.bin; cmp d/r.bin d/copy.bin && echo same"]).ok();
    assert_eq!(inside.stdout, format!("d/r.bin\n640 {}\nsame\n", 3 << 20));

    run(scp(env).arg(&src).arg(format!("{name}@127.0.0.1:/tmp/scp.bin"))).ok();
    let scp_back = env.dir.join(format!("{name}.scp-back"));
    run(scp(env).arg(format!("{name}@127.0.0.1:/tmp/scp.bin")).arg(&scp_back)).ok();
    assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&scp_back).unwrap());
    // The server ends with its session: nothing of it is left in the box.
    let left = env.alice(Some(&name), &["ps -o comm | grep -c moat-sftp"]);
    assert_eq!(left.stdout.trim(), "0", "{}", left.stdout);
}

/// sshfs (a box's tree mounted over SFTP, as editors use a remote tree) on a
/// busybox box, whose SFTP is the agent's: what is made, copied, renamed
/// over, linked, cut, chmod-ed, timed and removed through the mount is what
/// the box sees.
pub fn sshfs_mount_is_the_boxs_tree(env: &Env) {
    use std::os::unix::fs::{symlink, PermissionsExt};
    let name = unique("sshfs");
    env.new_box(&name, &["--image", "busybox"]);
    let mnt = env.dir.join(format!("{name}-mnt"));
    std::fs::create_dir_all(&mnt).unwrap();
    let mut sshfs = Command::new("timeout");
    sshfs.args(["60", "sshfs", "-F", "/dev/null", "-p", &env.daemon.port.to_string()]);
    for opt in ["IdentitiesOnly=yes", "StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "BatchMode=yes"] {
        sshfs.args(["-o", opt]);
    }
    sshfs.arg("-o").arg(format!("IdentityFile={}", env.alice.path.display()));
    run(sshfs.arg(format!("{name}@127.0.0.1:/root")).arg(&mnt)).ok();
    let _mounted = Unmount(mnt.clone());

    std::fs::write(mnt.join("f.txt"), "hello\n").unwrap();
    assert_eq!(std::fs::read_to_string(mnt.join("f.txt")).unwrap(), "hello\n");
    std::fs::create_dir_all(mnt.join("x/y")).unwrap();
    let data: Vec<u8> = (0..(3u32 << 20)).map(|i| (i % 241) as u8).collect();
    std::fs::write(mnt.join("x/y/blob"), &data).unwrap();
    std::fs::rename(mnt.join("x/y/blob"), mnt.join("x/y/blob2")).unwrap();
    assert_eq!(std::fs::read(mnt.join("x/y/blob2")).unwrap(), data);
    std::fs::write(mnt.join("o.txt"), "other\n").unwrap();
    std::fs::rename(mnt.join("o.txt"), mnt.join("f.txt")).unwrap();
    symlink("x/y/blob2", mnt.join("l")).unwrap();
    std::fs::hard_link(mnt.join("x/y/blob2"), mnt.join("hard")).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(mnt.join("f.txt")).unwrap();
    f.set_len(3).unwrap();
    f.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_600_000_000)).unwrap();
    drop(f);
    std::fs::set_permissions(mnt.join("f.txt"), std::fs::Permissions::from_mode(0o640)).unwrap();
    let seen = env
        .alice(Some(&name), &["cd /root && readlink l && cat f.txt && echo && stat -c '%s %a %h %Y' f.txt x/y/blob2"]);
    assert_eq!(
        seen.ok().stdout,
        format!("x/y/blob2\noth\n3 640 1 1600000000\n{} 644 2 {}\n", 3 << 20, {
            let m = std::fs::metadata(mnt.join("x/y/blob2")).unwrap();
            std::os::unix::fs::MetadataExt::mtime(&m)
        })
    );
    std::fs::remove_dir_all(mnt.join("x")).unwrap();
    for gone in ["l", "hard", "f.txt"] {
        std::fs::remove_file(mnt.join(gone)).unwrap();
    }
    let left = env.alice(Some(&name), &["ls -A /root"]).ok();
    assert_eq!(left.stdout, "", "the box still holds: {}", left.stdout);
}

/// Unmounts a FUSE mount when dropped (a failed test's too).
struct Unmount(std::path::PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = Command::new("fusermount").arg("-u").arg("-z").arg(&self.0).status();
    }
}

pub fn rsync_both_ways(env: &Env) {
    let name = unique("rsync");
    env.new_box(&name, &[]);
    let src = env.dir.join(format!("{name}-src"));
    std::fs::create_dir_all(src.join("d")).unwrap();
    for i in 0..20 {
        std::fs::write(src.join(format!("d/f{i}")), format!("file {i}\n").repeat(1000)).unwrap();
    }
    let ssh = format!("ssh {} -p {}", env.daemon.ssh_opts(&env.alice).join(" "), env.daemon.port);
    let rsync = |from: String, to: String| {
        let mut cmd = Command::new("timeout");
        cmd.args(["300", "rsync", "-a", "--stats", "-e", &ssh, &from, &to]);
        run(&mut cmd).ok()
    };
    rsync(format!("{}/", src.display()), format!("{name}@127.0.0.1:/srv/copy/"));
    env.alice(Some(&name), &["echo changed > /srv/copy/d/f3; echo new > /srv/copy/d/new"]).ok();
    let back = env.dir.join(format!("{name}-back"));
    let stats = rsync(format!("{name}@127.0.0.1:/srv/copy/"), format!("{}/", back.display()));
    assert!(stats.stdout.contains("Number of files"), "{}", stats.stdout);
    assert_eq!(std::fs::read_to_string(back.join("d/f3")).unwrap(), "changed\n");
    assert_eq!(std::fs::read_to_string(back.join("d/new")).unwrap(), "new\n");
    assert_eq!(std::fs::read(back.join("d/f7")).unwrap(), std::fs::read(src.join("d/f7")).unwrap());
    // A second sync of unchanged files transfers none of them.
    let again = rsync(format!("{name}@127.0.0.1:/srv/copy/"), format!("{}/", back.display()));
    assert!(again.stdout.contains("Number of regular files transferred: 0"), "{}", again.stdout);
}
