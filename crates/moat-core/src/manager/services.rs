//! Boxes' services (`new NAME --image I --run`): the image's Entrypoint and
//! Cmd, kept running inside the box by its agent (started again whenever it
//! exits, its output kept there; see moat-agent's `service`). The store
//! holds each box's; the agent is told at every boot, and a running agent
//! keeps it through a daemon restart, a suspend, or a copy of a running VM.

use std::sync::Arc;

use super::{BoxManager, ManagerError};
use crate::ids::{AccountId, Name};
use crate::record::{BoxRecord, BoxState};
use crate::store::images::StoredImage;

/// Most arguments, and most bytes in all, a service's command may have.
const MAX_ARGS: usize = 256;
const MAX_BYTES: usize = 64 * 1024;

/// What `--run` runs for a box of `image`: its Entrypoint, then its Cmd, as
/// an OCI runtime runs them.
pub(super) fn image_command(image: &StoredImage) -> Result<Vec<String>, ManagerError> {
    let config: serde_json::Value = serde_json::from_str(&image.config).unwrap_or_default();
    let words = |key: &str| -> Vec<String> {
        config["config"][key].as_array().into_iter().flatten().filter_map(|w| w.as_str().map(String::from)).collect()
    };
    let argv: Vec<String> = words("Entrypoint").into_iter().chain(words("Cmd")).collect();
    let fits = argv.len() <= MAX_ARGS && argv.iter().map(String::len).sum::<usize>() <= MAX_BYTES;
    if argv.first().is_none_or(String::is_empty) || !fits || argv.iter().any(|w| w.contains('\0')) {
        return Err(ManagerError::NothingToRun(image.name.clone()));
    }
    Ok(argv)
}

impl BoxManager {
    /// Tells a box that just booted its service, if it has one. A box whose
    /// agent does not take it runs on without it (logged).
    pub(super) async fn tell_service(&self, rec: &BoxRecord) {
        let argv = match self.db(|s| s.service(&rec.id)) {
            Ok(Some(argv)) => argv,
            Ok(None) => return,
            Err(e) => return tracing::warn!(box_id = %rec.id, error = %e, "cannot read the box's service"),
        };
        let r = rec.clone();
        let told = self.blocking(move |b| b.set_service(&r, &argv)).await.and_then(|t| Ok(t?));
        if let Err(e) = told {
            tracing::warn!(box_id = %rec.id, name = %rec.name, error = %e, "the box's service was not started");
        }
    }

    /// The recent output of the account's box `name`'s service (a suspended
    /// box is resumed for it, as for a session).
    pub async fn service_log(self: &Arc<Self>, account: &AccountId, name: &Name) -> Result<Vec<u8>, ManagerError> {
        let rec = self.get(account, name)?;
        if self.db(|s| s.service(&rec.id))?.is_none() {
            return Err(ManagerError::NoService(name.clone()));
        }
        if rec.state == BoxState::Stopped {
            return Err(ManagerError::ServiceStopped(name.clone()));
        }
        let (_handle, _session) = self.open_session(account, name).await?;
        Ok(self.blocking(move |b| b.service_log(&rec)).await??)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(config: &str) -> StoredImage {
        StoredImage {
            account: AccountId("SHA256:a".into()),
            name: Name::new("app").unwrap(),
            key: Name::new("oci-x").unwrap(),
            reference: "r/app:1".into(),
            digest: "sha256:0".into(),
            layers: vec![],
            config: config.into(),
            bytes: 0,
            created_ms: 0,
            base_manifest: String::new(),
            base_source: String::new(),
        }
    }

    #[test]
    fn a_service_is_the_entrypoint_then_the_cmd() {
        let both = image(r#"{"config":{"Entrypoint":["python3","-m"],"Cmd":["http.server","8000"]}}"#);
        assert_eq!(image_command(&both).unwrap(), ["python3", "-m", "http.server", "8000"]);
        let cmd = image(r#"{"config":{"Cmd":["/bin/httpd","-f"]}}"#);
        assert_eq!(image_command(&cmd).unwrap(), ["/bin/httpd", "-f"]);
        for nothing in [r#"{"config":{}}"#, r#"{"config":{"Cmd":[""]}}"#, "not json", r#"{"config":{"Cmd":"sh"}}"#] {
            assert!(matches!(image_command(&image(nothing)), Err(ManagerError::NothingToRun(_))), "{nothing}");
        }
        let huge = format!(r#"{{"config":{{"Cmd":["{}"]}}}}"#, "x".repeat(MAX_BYTES + 1));
        assert!(image_command(&image(&huge)).is_err());
    }
}
