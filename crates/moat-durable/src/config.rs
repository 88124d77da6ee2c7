//! Where the object store is (`s3://BUCKET/PREFIX`, an endpoint, a region)
//! and its credentials: from the environment (`AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`) or a file, never the command line, where any
//! user of the host could read them.

use std::sync::Arc;
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::{ClientOptions, ObjectStore, RetryConfig};

use crate::DurableError;

/// An S3-compatible object store's address and credentials.
#[derive(Clone)]
pub struct ObjectStoreConfig {
    /// The bucket.
    pub bucket: String,
    /// The prefix every key starts with (no leading or trailing `/`).
    pub prefix: String,
    /// The endpoint, e.g. `http://127.0.0.1:8333` (default: AWS's).
    pub endpoint: Option<String>,
    /// The region (default `us-east-1`).
    pub region: String,
    access_key: String,
    secret_key: String,
}

impl std::fmt::Debug for ObjectStoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectStoreConfig")
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("credentials", &"[redacted]")
            .finish()
    }
}

/// Splits `s3://BUCKET/PREFIX` into bucket and prefix.
pub fn parse_url(url: &str) -> Result<(String, String), DurableError> {
    let rest = url
        .strip_prefix("s3://")
        .ok_or_else(|| DurableError::Config(format!("--object-store {url}: expected s3://BUCKET/PREFIX")))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(DurableError::Config(format!("--object-store {url}: no bucket")));
    }
    Ok((bucket.to_string(), prefix.trim_matches('/').to_string()))
}

/// The access key and secret in `text`: `KEY=VALUE` lines (shell style, or an
/// AWS credentials file's `aws_access_key_id = ...`).
pub fn parse_credentials(text: &str) -> Option<(String, String)> {
    let (mut id, mut secret) = (None, None);
    for line in text.lines() {
        let Some((k, v)) = line.split_once('=') else { continue };
        let k = k.trim().trim_start_matches("export ").trim().to_ascii_lowercase();
        let v = v.trim().trim_matches('"').trim_matches('\'').to_string();
        match k.as_str() {
            "aws_access_key_id" => id = Some(v),
            "aws_secret_access_key" => secret = Some(v),
            _ => {}
        }
    }
    Some((id?, secret?))
}

impl ObjectStoreConfig {
    /// The object store at `url`, signing in with `credentials_file`'s keys
    /// or else the environment's.
    pub fn new(
        url: &str,
        endpoint: Option<String>,
        region: Option<String>,
        credentials_file: Option<&std::path::Path>,
    ) -> Result<Self, DurableError> {
        let (bucket, prefix) = parse_url(url)?;
        let (access_key, secret_key) = match credentials_file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(crate::io_err(format!("read {}", path.display())))?;
                parse_credentials(&text).ok_or_else(|| {
                    DurableError::Config(format!(
                        "{} holds no aws_access_key_id and aws_secret_access_key",
                        path.display()
                    ))
                })?
            }
            None => match (std::env::var("AWS_ACCESS_KEY_ID"), std::env::var("AWS_SECRET_ACCESS_KEY")) {
                (Ok(id), Ok(secret)) => (id, secret),
                _ => {
                    return Err(DurableError::Config(
                        "--object-store needs credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the \
                         environment, or --s3-credentials FILE"
                            .into(),
                    ))
                }
            },
        };
        Ok(Self {
            bucket,
            prefix,
            endpoint,
            region: region.unwrap_or_else(|| "us-east-1".into()),
            access_key,
            secret_key,
        })
    }

    /// The object store at `url` with these keys (tests; the daemon takes
    /// them only from the environment or a file).
    pub fn new_with_keys(
        url: &str,
        endpoint: Option<String>,
        region: Option<String>,
        access_key: &str,
        secret_key: &str,
    ) -> Result<Self, DurableError> {
        let (bucket, prefix) = parse_url(url)?;
        Ok(Self {
            bucket,
            prefix,
            endpoint,
            region: region.unwrap_or_else(|| "us-east-1".into()),
            access_key: access_key.into(),
            secret_key: secret_key.into(),
        })
    }

    /// A client of the object store. Each request gives up after a minute
    /// (a few retries inside it); the worker retries later.
    pub fn client(&self) -> Result<Arc<dyn ObjectStore>, DurableError> {
        let mut b = AmazonS3Builder::new()
            .with_bucket_name(&self.bucket)
            .with_region(&self.region)
            .with_access_key_id(&self.access_key)
            .with_secret_access_key(&self.secret_key)
            .with_client_options(
                ClientOptions::new()
                    .with_connect_timeout(Duration::from_secs(5))
                    .with_timeout(Duration::from_secs(60))
                    .with_allow_http(true),
            )
            .with_retry(RetryConfig {
                max_retries: 3,
                retry_timeout: Duration::from_secs(30),
                ..RetryConfig::default()
            });
        if let Some(endpoint) = &self.endpoint {
            b = b.with_endpoint(endpoint);
        }
        Ok(Arc::new(b.build()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_credential_files_parse() {
        assert_eq!(parse_url("s3://b/p/q/").unwrap(), ("b".into(), "p/q".into()));
        assert_eq!(parse_url("s3://b").unwrap(), ("b".into(), String::new()));
        assert!(parse_url("http://b/p").is_err());
        assert!(parse_url("s3:///p").is_err());
        let file = "[default]\naws_access_key_id = AK\naws_secret_access_key = SK\n";
        assert_eq!(parse_credentials(file), Some(("AK".into(), "SK".into())));
        let env = "export AWS_ACCESS_KEY_ID=\"AK\"\nAWS_SECRET_ACCESS_KEY='SK'\n";
        assert_eq!(parse_credentials(env), Some(("AK".into(), "SK".into())));
        assert_eq!(parse_credentials("AWS_ACCESS_KEY_ID=AK\n"), None);
    }
}
