//! What a session channel is given before its program starts: the
//! environment variables the client passed and whether a program (exec, shell,
//! subsystem) has been chosen. The connection's handler decides each request
//! as it arrives (its answer must go out in order); the channel's task reads the
//! outcome when the program starts.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

/// Most environment variables a channel may set (sshd's 128), and the size of each.
const MAX_ENV: usize = 128;
const MAX_ENV_BYTES: usize = 4096;

/// Environment variables a client may pass: Debian's sshd `AcceptEnv` (LANG,
/// LC_*, COLORTERM, NO_COLOR) and git's GIT_PROTOCOL, which selects protocol v2.
pub fn env_allowed(name: &str) -> bool {
    matches!(name, "LANG" | "COLORTERM" | "NO_COLOR" | "GIT_PROTOCOL") || name.starts_with("LC_")
}

/// One session channel's setup.
#[derive(Debug, Default)]
pub struct ChannelSetup {
    env: Mutex<Vec<(String, String)>>,
    started: AtomicBool,
    terminal: AtomicBool,
}

impl ChannelSetup {
    /// Takes `name=value` if it is allowed and fits; returns whether it did.
    /// Refused variables are dropped, as sshd drops what AcceptEnv does not name.
    pub fn offer_env(&self, name: &str, value: &str) -> bool {
        let nul = name.contains('\0') || value.contains('\0');
        if self.started() || nul || !env_allowed(name) || name.len() + value.len() > MAX_ENV_BYTES {
            return false;
        }
        let mut env = self.env.lock().unwrap_or_else(PoisonError::into_inner);
        if env.len() >= MAX_ENV {
            return false;
        }
        env.push((name.to_string(), value.to_string()));
        true
    }

    /// Takes a terminal for the channel; false once the program is chosen,
    /// or if it has one already (sshd refuses a second `pty-req`).
    pub fn take_terminal(&self) -> bool {
        !self.started() && !self.terminal.swap(true, Ordering::AcqRel)
    }

    /// Marks the program chosen; false if one already was (a second `exec` on
    /// a channel is refused, as sshd does).
    pub fn start(&self) -> bool {
        !self.started.swap(true, Ordering::AcqRel)
    }

    /// Whether a program has been chosen.
    pub fn started(&self) -> bool {
        self.started.load(Ordering::Acquire)
    }

    /// The accepted environment, for the program.
    pub fn take_env(&self) -> Vec<(String, String)> {
        std::mem::take(&mut *self.env.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn env_is_filtered_bounded_and_closed_at_start() {
        let setup = ChannelSetup::default();
        assert!(setup.offer_env("LC_ALL", "C") && setup.offer_env("GIT_PROTOCOL", "version=2"));
        assert!(!setup.offer_env("LD_PRELOAD", "/x.so") && !setup.offer_env("PATH", "/evil"));
        assert!(!setup.offer_env("LANG", &"x".repeat(MAX_ENV_BYTES)));
        assert!(!setup.offer_env("LANG", "C\0.UTF-8") && !setup.offer_env("LC_\0X", "C"));
        for i in 0..200 {
            setup.offer_env(&format!("LC_{i}"), "x");
        }
        assert!(setup.start() && !setup.start());
        assert!(!setup.offer_env("LANG", "C"), "env after the program started");
        let env = setup.take_env();
        assert_eq!(env.len(), MAX_ENV);
        assert_eq!(env.first().unwrap(), &("LC_ALL".to_string(), "C".to_string()));
    }

    #[test]
    fn one_terminal_before_the_program() {
        let setup = ChannelSetup::default();
        assert!(setup.take_terminal() && !setup.take_terminal(), "a second pty-req");
        let late = ChannelSetup::default();
        assert!(late.start() && !late.take_terminal(), "a pty-req after exec");
    }
}
