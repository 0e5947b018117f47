//! The thin edge between gpulane and Temporal's official crates: the client connection,
//! payload encoding, and activity errors turned into typed application failures.

use std::time::Duration;

use gpulane_activities::ActivityError;
use temporalio_client::{ClientTlsOptions, Connection, ConnectionOptions, TlsOptions, Url};
use temporalio_common::protos::{
    temporal::api::{
        common::v1::Payload,
        failure::v1::{failure::FailureInfo, ApplicationFailureInfo, Failure},
    },
    ENCODING_PAYLOAD_KEY, JSON_ENCODING_VAL,
};

use crate::{config::RunArgs, RuntimeError};

fn read_pem(path: &std::path::Path) -> Result<Vec<u8>, RuntimeError> {
    std::fs::read(path).map_err(|source| RuntimeError::File {
        path: path.to_owned(),
        source,
    })
}

/// Connects to the Temporal frontend named by the run arguments. TLS is on when asked for,
/// when any certificate is given, or with an API key (Temporal Cloud needs it; the client
/// crate does not turn it on by itself).
pub(crate) async fn connect(args: &RunArgs, identity: &str) -> Result<Connection, RuntimeError> {
    let tls = args.uses_tls();
    let address = args.address.trim();
    let url_text = if address.contains("://") {
        address.to_owned()
    } else {
        format!("{}://{address}", if tls { "https" } else { "http" })
    };
    let url = Url::parse(&url_text).map_err(|e| {
        RuntimeError::Config(format!("--address {address:?} is not host:port ({e})"))
    })?;
    let tls_options = if tls {
        let client = match (&args.tls_client_cert_path, &args.tls_client_key_path) {
            (Some(cert), Some(key)) => Some(
                ClientTlsOptions::builder()
                    .client_cert(read_pem(cert)?)
                    .client_private_key(read_pem(key)?)
                    .build(),
            ),
            _ => None,
        };
        let ca = args
            .tls_server_ca_cert_path
            .as_deref()
            .map(read_pem)
            .transpose()?;
        Some(
            TlsOptions::builder()
                .maybe_server_root_ca_cert(ca)
                .maybe_client_tls_options(client)
                .maybe_domain(args.tls_server_name.clone())
                .build(),
        )
    } else {
        None
    };
    let opts = ConnectionOptions::new(url)
        .identity(identity.to_owned())
        .maybe_api_key(args.api_key.as_ref().map(|k| k.expose().to_owned()))
        .maybe_tls_options(tls_options)
        .connect_timeout(Duration::from_secs(10))
        .build();
    Connection::connect(opts)
        .await
        .map_err(|source| RuntimeError::Connect {
            address: address.to_owned(),
            source: Box::new(source),
        })
}

/// A `json/plain` payload, what every SDK's default data converter reads.
pub(crate) fn json_payload(data: Vec<u8>) -> Payload {
    let mut p = Payload {
        data,
        ..Default::default()
    };
    p.metadata.insert(
        ENCODING_PAYLOAD_KEY.to_owned(),
        JSON_ENCODING_VAL.as_bytes().to_vec(),
    );
    p
}

/// The JSON bytes of an activity's first argument, or an input error that says what to
/// send instead.
pub(crate) fn input_json(input: &[Payload]) -> Result<&[u8], ActivityError> {
    let Some(p) = input.first() else {
        return Err(ActivityError::InvalidInput(
            "no input: pass one argument, a JSON object like {\"texts\": [\"...\"]}".to_owned(),
        ));
    };
    let encoding = p
        .metadata
        .get(ENCODING_PAYLOAD_KEY)
        .map(|e| String::from_utf8_lossy(e).into_owned())
        .unwrap_or_default();
    if encoding == JSON_ENCODING_VAL {
        Ok(&p.data)
    } else if encoding == "binary/null" {
        Err(ActivityError::InvalidInput(
            "input is null: pass a JSON object like {\"texts\": [\"...\"]}".to_owned(),
        ))
    } else {
        Err(ActivityError::InvalidInput(format!(
            "input payload is encoded as {encoding:?}; gpulane takes json/plain, the default of every SDK's data converter"
        )))
    }
}

/// An application failure a workflow can match on by type, retryable as the error says.
pub(crate) fn failure(err: &ActivityError) -> Failure {
    Failure {
        message: err.to_string(),
        source: "gpulane".to_owned(),
        failure_info: Some(FailureInfo::ApplicationFailureInfo(
            ApplicationFailureInfo {
                r#type: err.failure_type().to_owned(),
                non_retryable: !err.is_retryable(),
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_must_be_json() {
        assert!(input_json(&[]).is_err());
        let mut p = json_payload(b"{}".to_vec());
        assert_eq!(input_json(std::slice::from_ref(&p)).unwrap(), b"{}");
        p.metadata
            .insert(ENCODING_PAYLOAD_KEY.to_owned(), b"binary/plain".to_vec());
        let e = input_json(&[p]).unwrap_err().to_string();
        assert!(
            e.contains("binary/plain") && e.contains("json/plain"),
            "{e}"
        );
    }

    #[test]
    fn failures_carry_type_and_retryability() {
        let f = failure(&ActivityError::InvalidInput(
            "field \"texts\" is empty".into(),
        ));
        let Some(FailureInfo::ApplicationFailureInfo(info)) = f.failure_info else {
            panic!("not an application failure")
        };
        assert_eq!(info.r#type, "InvalidInput");
        assert!(info.non_retryable);
        assert!(f.message.contains("texts"));
        let f = failure(&ActivityError::Model(
            gpulane_models::ModelError::EngineStopped,
        ));
        let Some(FailureInfo::ApplicationFailureInfo(info)) = f.failure_info else {
            panic!("not an application failure")
        };
        assert!(!info.non_retryable);
    }
}
