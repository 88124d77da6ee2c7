//! What a VM box takes along when it moves to another node, besides its
//! disk: its saved machine and its memory (so its processes go on there) and its TLS CA's
//! key (which its running guest trusts). Both are put beside the disk in the
//! box's subvolume, which `btrfs send` carries and the guest never sees (it
//! sees only its disk), and are taken out again on the node that received it.
//! Never for a namespace box: its subvolume is its own root, which it writes.

use std::fs;
use std::io;
use std::path::PathBuf;

use moat_core::BoxId;

use crate::pool::Pool;

/// The directory in a VM box's subvolume that travels with it.
const TRAVEL: &str = "travel";

fn dir(pool: &Pool, id: &BoxId) -> PathBuf {
    pool.box_path(id).join(TRAVEL)
}

/// Puts box `id`'s saved machine and CA key where they travel, if it has a
/// saved machine (a running box was just parked); whether it does.
pub fn pack(pool: &Pool, id: &BoxId) -> io::Result<bool> {
    let travel = dir(pool, id);
    if travel.exists() {
        fs::remove_dir_all(&travel)?;
    }
    let saved = pool.saved_machine(id);
    if !saved.exists() {
        return Ok(false);
    }
    let memory = pool.vm_memory(id);
    // Copies within the pool are reflinks (`copy_file_range`), holes kept.
    let packed = fs::create_dir(&travel)
        .and_then(|()| fs::copy(&saved, travel.join("machine.state")))
        .and_then(|_| if memory.exists() { fs::copy(&memory, travel.join("machine.mem")).map(drop) } else { Ok(()) })
        .and_then(|()| fs::copy(pool.ca_key_path(id), travel.join("ca.pem")));
    if let Err(e) = packed {
        let _ = fs::remove_dir_all(&travel);
        return Err(io::Error::new(
            e.kind(),
            format!("{e} (a saved machine must fit in the box's disk limit to move; stop the box to move it without)"),
        ));
    }
    Ok(true)
}

/// Takes what travelled with received box `id` out of its subvolume: its
/// saved machine back where a start resumes it; its CA key, returned.
/// `None` if nothing travelled (the box moved stopped).
pub fn unpack(pool: &Pool, id: &BoxId) -> io::Result<Option<String>> {
    let travel = dir(pool, id);
    if !travel.is_dir() {
        return Ok(None);
    }
    let key = fs::read_to_string(travel.join("ca.pem"))?;
    fs::create_dir_all(pool.vm_states_dir())?;
    // The memory first: a saved state is what says there is a machine.
    let memory = travel.join("machine.mem");
    if memory.exists() {
        fs::copy(&memory, pool.vm_memory(id))?;
    }
    fs::copy(travel.join("machine.state"), pool.saved_machine(id))?;
    fs::remove_dir_all(&travel)?;
    Ok(Some(key))
}
