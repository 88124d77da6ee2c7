//! `moat fleet ...`: making a fleet and its members, and the SSH keys that
//! are its accounts. The work is `moat_fleet::join`'s; this is the surface.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use moat_fleet::join::{self, Token};
use moat_fleet::pki::Role;
use russh::keys::PublicKey;

use crate::paths;

/// `moat fleet` subcommands.
#[derive(Subcommand)]
pub enum FleetCmd {
    /// Make a fleet in the store: its CA (the key stays in --state-dir), its
    /// SSH host key and the fleet key.
    Init {
        /// The store's DSN (postgres://USER:PASSWORD@HOST:PORT/DB; also
        /// `$MOAT_STORE`, which keeps the password off the command line).
        #[arg(long, env = "MOAT_STORE", hide_env_values = true)]
        store: String,
        /// Where the CA's key is kept (the operator's, not a node's).
        #[arg(long, default_value = paths::DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
    },
    /// Issue a certificate for a node or front door, and print the one-time
    /// token that joins it.
    Token {
        /// node or front.
        #[arg(long, value_parser = moat_fleet::pki::parse_role)]
        role: Role,
        /// Its name (lowercase letters, digits and '-'; a node's boxes name it).
        #[arg(long)]
        name: String,
        /// The dir `moat fleet init` used.
        #[arg(long, default_value = paths::DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
    },
    /// Join the fleet with a token, writing this member's files into --state-dir.
    Join {
        /// What `moat fleet token` printed.
        token: String,
        /// This member's state dir.
        #[arg(long, default_value = paths::DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
    },
    /// Revoke a member's certificate (`join` and `token` print its serial):
    /// every peer refuses it within seconds.
    Revoke {
        /// The certificate's serial (hex).
        serial: String,
        #[command(flatten)]
        at: StoreAt,
    },
    /// The SSH keys that are accounts, fleet-wide.
    Keys {
        #[command(subcommand)]
        command: KeysCmd,
    },
}

/// `moat fleet keys` subcommands.
#[derive(Subcommand)]
pub enum KeysCmd {
    /// Import the keys of an authorized_keys file (`-`: stdin); each key is an account.
    Add {
        /// The file.
        file: PathBuf,
        #[command(flatten)]
        at: StoreAt,
    },
    /// Remove a key: its `TYPE BASE64` text or its account (`SHA256:...`).
    Rm {
        /// The key or account.
        key: String,
        #[command(flatten)]
        at: StoreAt,
    },
    /// List the imported keys.
    Ls {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        at: StoreAt,
    },
}

/// Which store: given, or the one a fleet dir names.
#[derive(clap::Args)]
pub struct StoreAt {
    /// The store's DSN (also `$MOAT_STORE`, which keeps its password off the
    /// command line) [default: the one in STATE_DIR/fleet.json].
    #[arg(long, env = "MOAT_STORE", hide_env_values = true)]
    store: Option<String>,
    /// A dir `moat fleet init` or `join` wrote.
    #[arg(long, default_value = paths::DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
}

impl StoreAt {
    /// Connects to the store.
    pub fn open(&self) -> Result<moat_core::Store> {
        moat_core::Store::connect(&self.dsn()?).context("open the fleet's store")
    }

    fn dsn(&self) -> Result<String> {
        match &self.store {
            Some(dsn) => Ok(dsn.clone()),
            None => Ok(join::admin_store(&self.state_dir)?),
        }
    }
}

fn connect(dsn: &str) -> Result<moat_core::Store> {
    Ok(moat_core::Store::connect(dsn)?)
}

/// Runs a `moat fleet` subcommand.
pub fn run(cmd: FleetCmd) -> Result<()> {
    match cmd {
        FleetCmd::Init { store, state_dir } => {
            paths::private_dir(&state_dir)?;
            let db = connect(&store)?;
            join::init(&db, &store, &state_dir, &new_host_key(&state_dir)?)?;
            println!("fleet made; its CA's key is {}", state_dir.join("fleet-ca.key").display());
            println!("next: `moat fleet token --role node --name NAME` for each node and front door");
            Ok(())
        }
        FleetCmd::Token { role, name, state_dir } => {
            let db = connect(&join::admin_store(&state_dir)?)?;
            let token = join::token(&db, &state_dir, role, &name)?;
            eprintln!("issued {} {name}, certificate {}", role.as_str(), Token::decode(&token)?.member.serial);
            println!("{token}");
            Ok(())
        }
        FleetCmd::Revoke { serial, at } => {
            if !connect(&at.dsn()?)?.revoke_member(serial.trim())? {
                bail!("no member has certificate {serial}");
            }
            println!("revoked {serial}; peers refuse it within 5 s");
            Ok(())
        }
        FleetCmd::Join { token, state_dir } => {
            let token = Token::decode(&token)?;
            paths::private_dir(&state_dir)?;
            let db = connect(&token.store)?;
            join::join(&db, &token, &state_dir)?;
            let next = match token.member.role {
                Role::Node => "moat serve --state-dir DIR --advertise ADDR",
                Role::Front => "moat front --state-dir DIR --listen ADDR",
            };
            let member = &token.member;
            println!(
                "joined as {} {} (certificate {}); next: {next}",
                member.role.as_str(),
                member.name,
                member.serial
            );
            Ok(())
        }
        FleetCmd::Keys { command } => keys(command),
    }
}

/// A new Ed25519 host key, as OpenSSH text (made by ssh-keygen beside the
/// CA's key, read, and removed: only its sealed copy in the store remains).
fn new_host_key(dir: &Path) -> Result<String> {
    let path = dir.join("fleet-host-key.tmp");
    let made = moat_sshd::auth::load_or_create_host_key(&path);
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(path.with_extension("tmp.pub"));
    let key = made?.to_openssh(russh::keys::ssh_key::LineEnding::LF).context("encode the host key")?;
    Ok(key.to_string())
}

fn keys(cmd: KeysCmd) -> Result<()> {
    match cmd {
        KeysCmd::Add { file, at } => {
            let text = match file.as_os_str() == "-" {
                true => {
                    let mut text = String::new();
                    std::io::stdin().read_to_string(&mut text).context("read stdin")?;
                    text
                }
                false => std::fs::read_to_string(&file).with_context(|| format!("read {}", file.display()))?,
            };
            let keys = public_keys(&text)?;
            let db = connect(&at.dsn()?)?;
            for key in &keys {
                let account = moat_sshd::auth::account_id(key);
                let text = moat_sshd::auth::key_text(key).context("encode a key")?;
                match db.add_fleet_key(&account, &text)? {
                    true => println!("{account}"),
                    false => println!("{account} (already there)"),
                }
            }
            Ok(())
        }
        KeysCmd::Rm { key, at } => {
            let db = connect(&at.dsn()?)?;
            let key = key.trim();
            // An account's keys, or the one key given.
            let keys: Vec<String> = match key.starts_with("SHA256:") {
                true => db.fleet_keys()?.into_iter().filter(|k| k.account.0 == key).map(|k| k.key).collect(),
                // (`TYPE BASE64 [COMMENT]`: the comment is not kept.)
                false => vec![key.split_whitespace().take(2).collect::<Vec<_>>().join(" ")],
            };
            let mut removed = 0;
            for k in &keys {
                removed += usize::from(db.remove_fleet_key(k)?);
            }
            if removed == 0 {
                bail!("no such key or account: {key}");
            }
            Ok(())
        }
        KeysCmd::Ls { json, at } => {
            let db = connect(&at.dsn()?)?;
            let keys = db.fleet_keys()?;
            if json {
                let rows: Vec<_> = keys
                    .iter()
                    .map(|k| serde_json::json!({ "account": k.account.0, "key": k.key, "added_at": k.added_at }))
                    .collect();
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                for k in keys {
                    println!("{}  {}", k.account.0, k.key);
                }
            }
            Ok(())
        }
    }
}

/// The keys of an authorized_keys text: one `TYPE BASE64 [COMMENT]` a line
/// (blank lines and `#` comments skipped). A line with options is refused:
/// the fleet keeps keys, not what OpenSSH would do with them.
fn public_keys(text: &str) -> Result<Vec<PublicKey>> {
    let mut keys = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match PublicKey::from_openssh(line) {
            Ok(key) => keys.push(key),
            Err(e) => bail!("line {}: not a public key `TYPE BASE64 [COMMENT]` ({e})", n + 1),
        }
    }
    if keys.is_empty() {
        bail!("no keys in the input");
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authorized_keys_lines_are_keys_or_refused() {
        let key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl alice";
        let keys = public_keys(&format!("# team\n\n{key}\n")).unwrap();
        assert_eq!(keys.len(), 1);
        assert!(public_keys(&format!("no-pty {key}\n")).unwrap_err().to_string().starts_with("line 1:"));
        assert!(public_keys("# nothing\n").is_err());
    }
}
