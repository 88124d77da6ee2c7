//! Lineage: a copy's disk limit bounds what it keeps alive of the boxes it
//! was copied from, not only what it writes.
//!
//! Under simple quotas an extent stays charged to the subvolume that wrote
//! it for as long as anything holds it, so a copy is charged only for what
//! it writes itself: once its parent is removed, the copy alone may keep the
//! parent's data alive, outside its own limit (five rounds of dup, rm,
//! write 100 MB left one `--disk 128M` box holding 600 MiB; its account's
//! budget held). So a copy notes its parent (`<pool>/lineage/<copy id>`
//! holds the parent's id), and removing a box hands what it is charged for
//! (every member of its box qgroup: its roots, its checkpoints', and what it
//! was handed before) to the box qgroup of each noted copy of it that is
//! left, limited to that copy's disk limit. Each of several copies is
//! charged all of what they share (what it keeps alive, with its siblings);
//! what a copy frees stops counting at once.
//!
//! VM boxes are not noted: a guest's disk is a file no larger than its
//! limit, so it keeps alive about what it could write itself, and a guest
//! must not find its disk failing writes within its own size.

use std::fs;
use std::io;
use std::path::PathBuf;
use std::process::Command;

use moat_core::BoxId;

use crate::pool::{box_qgroup, io_err, Pool, PoolError};
use crate::sys;

impl Pool {
    fn lineage_dir(&self) -> PathBuf {
        self.root().join("lineage")
    }

    /// Notes that box `copy` was copied from box `parent` (its files are a
    /// snapshot of the parent's).
    pub fn note_copy(&self, parent: &BoxId, copy: &BoxId) -> Result<(), PoolError> {
        let dir = self.lineage_dir();
        fs::create_dir_all(&dir).map_err(io_err("create", &dir))?;
        let note = dir.join(copy.as_str());
        fs::write(&note, parent.as_str()).map_err(io_err("write", &note))
    }

    /// Forgets box `id`'s own note (it is being removed).
    pub(crate) fn forget_copy(&self, id: &BoxId) -> Result<(), PoolError> {
        let note = self.lineage_dir().join(id.as_str());
        match fs::remove_file(&note) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err("remove", &note)(e)),
            _ => Ok(()),
        }
    }

    /// Hands what box `id` is charged for to the box qgroup of every noted
    /// copy of it still there; before its subvolumes are deleted (what they
    /// alone hold is freed with them). Repeatable.
    pub(crate) fn bequeath(&self, id: &BoxId) -> Result<(), PoolError> {
        let heirs = self.copies_of(id);
        if heirs.is_empty() || !self.simple_quotas() {
            return Ok(());
        }
        let members = self.charged_to(id)?;
        for heir in heirs {
            let root = self.box_path(&heir);
            let subvolume = sys::subvolume_id(&root).map_err(io_err("look up subvolume", &root))?;
            let Some(limit) = self.qgroup_limit(subvolume) else { continue };
            self.own_box_qgroup(&heir, limit)?;
            for member in &members {
                match sys::qgroup_assign(self.root(), *member, box_qgroup(&heir)) {
                    // Gone meanwhile: it counted nothing any more.
                    Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EINVAL)) => {}
                    other => other.map_err(io_err("charge a copy for", &root))?,
                }
            }
        }
        Ok(())
    }

    /// Charges box `id`, received from the object store as a writable
    /// snapshot of the subvolumes `received` (read-only; deleted, but for the
    /// newest, kept as the parent of the box's next upload until that upload),
    /// for their data as it would be charged had the box written it here:
    /// under simple quotas data stays charged to the subvolume that wrote
    /// it, so those subvolumes join the box's qgroup (limited to
    /// `disk_limit`) and its account's. (Full qgroups move the data onto the
    /// box's own numbers when they are deleted.)
    pub fn charge_received(
        &self,
        id: &BoxId,
        account: &moat_core::AccountId,
        received: &[u64],
        disk_limit: u64,
    ) -> Result<(), PoolError> {
        if !self.simple_quotas() {
            return Ok(());
        }
        self.own_box_qgroup(id, disk_limit)?;
        let account = crate::pool::account_qgroup(account);
        for subvolume in received {
            for group in [box_qgroup(id), account] {
                sys::qgroup_assign(self.root(), *subvolume, group)
                    .map_err(io_err("charge a received box for", &self.box_path(id)))?;
            }
        }
        Ok(())
    }

    /// The boxes noted as copies of `id` that are still there.
    fn copies_of(&self, id: &BoxId) -> Vec<BoxId> {
        let notes = fs::read_dir(self.lineage_dir()).into_iter().flatten().filter_map(Result::ok);
        notes
            .filter(|note| fs::read_to_string(note.path()).is_ok_and(|parent| parent == id.as_str()))
            .filter_map(|note| BoxId::parse(note.file_name().to_str()?))
            .filter(|copy| self.box_path(copy).is_dir())
            .collect()
    }

    /// The level-0 qgroups box `id` is charged for: the members of its box
    /// qgroup if it has one, else its root's.
    fn charged_to(&self, id: &BoxId) -> Result<Vec<u64>, PoolError> {
        let root = self.box_path(id);
        let own = sys::subvolume_id(&root).map_err(io_err("look up subvolume", &root))?;
        let group = box_qgroup(id);
        if self.qgroup_limit(group).is_none() {
            return Ok(vec![own]);
        }
        let out = Command::new("btrfs")
            .args(["qgroup", "show", "-c", "--raw"])
            .arg(self.root())
            .output()
            .map_err(io_err("run btrfs qgroup show on", self.root()))?;
        let mut members = members_of(&String::from_utf8_lossy(&out.stdout), group);
        if !members.contains(&own) {
            members.push(own);
        }
        Ok(members)
    }
}

/// The level-0 members of level-1 qgroup `group` in `btrfs qgroup show -c`'s
/// table (a `Child` column of comma-separated `0/ID`s, `-` for none).
fn members_of(table: &str, group: u64) -> Vec<u64> {
    let mut lines = table.lines();
    let Some(child) = lines.next().and_then(|head| head.split_whitespace().position(|c| c == "Child")) else {
        return Vec::new();
    };
    let name = format!("{}/{}", group >> 48, group & ((1 << 48) - 1));
    let row = lines.map(|l| l.split_whitespace().collect::<Vec<_>>()).find(|cells| cells.first() == Some(&&*name));
    let children = row.and_then(|cells| cells.get(child).map(|c| c.to_string())).unwrap_or_default();
    children.split(',').filter_map(|c| c.strip_prefix("0/")?.parse().ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_read_from_the_child_column() {
        let group = (1u64 << 48) | 281_474_976_710_000;
        let table = "Qgroupid    Referenced    Exclusive Child   Path \n\
                     --------    ----------    --------- -----   ---- \n\
                     0/5              16384        16384 -       <toplevel>\n\
                     0/256         67043328     67043328 -       box\n\
                     1/7           67043328     67043328 0/256   <0 member qgroups>\n\
                     1/281474976710000 9 9 0/257,0/300,1/2 <2 member qgroups>\n";
        assert_eq!(members_of(table, group), [257, 300]);
        assert_eq!(members_of(table, (1 << 48) | 7), [256]);
        assert!(members_of(table, (1 << 48) | 8).is_empty());
        assert!(members_of("", group).is_empty());
    }
}
