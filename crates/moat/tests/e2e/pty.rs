//! An interactive shell on a real terminal: `ssh -tt` on a pty we control, so
//! that we can resize it and type Ctrl-C.

use std::fs::File;
use std::io::{Read, Write};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use rustix::termios::{tcsetwinsize, Winsize};

use crate::fixture::unique;
use crate::Env;

struct Screen {
    text: Arc<Mutex<String>>,
}

impl Screen {
    /// Waits until what the terminal printed since `from` contains `needle`.
    fn wait_for(&self, from: usize, needle: &str) -> usize {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            {
                let text = self.text.lock().unwrap();
                if let Some(i) = text.get(from..).and_then(|t| t.find(needle)) {
                    return from + i + needle.len();
                }
                assert!(Instant::now() < deadline, "timed out waiting for {needle:?}; screen:\n{}", &*text);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

pub fn shell_resize_and_ctrl_c(env: &Env) {
    let name = unique("pty");
    env.new_box(&name, &[]);
    let size = |rows, cols| Winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
    let pty = nix::pty::openpty(None, None).unwrap();
    tcsetwinsize(&pty.master, size(24, 80)).unwrap();
    let slave = File::from(pty.slave);
    let mut ssh = env.daemon.ssh_with(&env.alice, Some(&name), &["-tt"], &[]);
    ssh.stdin(Stdio::from(slave.try_clone().unwrap()))
        .stdout(Stdio::from(slave.try_clone().unwrap()))
        .stderr(Stdio::from(slave));
    let mut child = ssh.spawn().unwrap();
    let mut master = File::from(pty.master);
    let text = Arc::new(Mutex::new(String::new()));
    {
        let (mut reader, text) = (master.try_clone().unwrap(), Arc::clone(&text));
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                text.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
    }
    let screen = Screen { text };
    // The ssh binary is `timeout`'s child; SIGWINCH must reach ssh itself.
    let ssh_pid = || {
        let out = std::process::Command::new("pgrep").arg("-P").arg(child.id().to_string()).output().unwrap();
        Pid::from_raw(String::from_utf8_lossy(&out.stdout).trim().parse().expect("ssh pid"))
    };

    master.write_all(b"echo TTY=$(tty); echo SIZE=$(stty size)\n").unwrap();
    let at = screen.wait_for(0, "TTY=/dev/pts/");
    let at = screen.wait_for(at, "SIZE=24 80");

    // The box's shell waits for the new size itself (no sleep guessing
    // how long the window change takes to arrive).
    tcsetwinsize(&master, size(50, 132)).unwrap();
    kill(ssh_pid(), Signal::SIGWINCH).unwrap();
    master.write_all(b"until [ \"$(stty size)\" = '50 132' ]; do sleep 0.1; done; echo SIZE=$(stty size)\n").unwrap();
    let at = screen.wait_for(at, "SIZE=50 132");

    // Ctrl-C once the job runs (it says so first; as its name is typed,
    // `START$((1+1))`, only its output reads START2).
    master.write_all(b"sh -c 'echo START$((1+1)); exec sleep 100'; echo after-sleep\n").unwrap();
    let at = screen.wait_for(at, "START2");
    master.write_all(b"\x03").unwrap();
    master.write_all(b"echo RC=$?\n").unwrap();
    let at = screen.wait_for(at, "RC=130");
    assert!(!screen.text.lock().unwrap()[at..].contains("after-sleep"));

    master.write_all(b"exit 3\n").unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(3));
}
