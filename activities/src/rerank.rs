//! Parsing and validating `rerank` input.

use gpulane_proto::RerankRequest;
use serde_json::Value;

use crate::{
    input::{invalid, kind, object, opt_bool, opt_positive, opt_string, strings, text_within},
    ActivityError, Limits,
};

const FIELDS: &[&str] = &[
    "query",
    "documents",
    "model",
    "top_n",
    "return_documents",
    "raw_scores",
];
const SHAPE: &str = r#"{"query": "...", "documents": ["..."], "model"?: string, "top_n"?: int, "return_documents"?: bool, "raw_scores"?: bool}"#;

/// Parses and checks a `rerank` input against `limits` (documents count as texts).
pub(crate) fn parse_rerank(input: &[u8], limits: &Limits) -> Result<RerankRequest, ActivityError> {
    let obj = object(input, FIELDS, SHAPE)?;
    let query = match obj.get("query") {
        Some(Value::String(q)) => q.clone(),
        None | Some(Value::Null) => {
            return Err(invalid(format!(
                "field \"query\" is required: pass {SHAPE}"
            )))
        }
        Some(other) => {
            return Err(invalid(format!(
                "field \"query\" must be a string, got {}",
                kind(other)
            )))
        }
    };
    text_within("field \"query\"", &query, limits)?;
    let documents = match obj.get("documents") {
        Some(v) if !v.is_null() => strings("documents", v, limits)?,
        _ => {
            return Err(invalid(format!(
                "field \"documents\" is required: pass {SHAPE}"
            )))
        }
    };
    let top_n = opt_positive(&obj, "top_n", "omit it to return every document")?;
    Ok(RerankRequest {
        query,
        documents,
        model: opt_string(&obj, "model")?,
        top_n,
        return_documents: opt_bool(&obj, "return_documents")?,
        raw_scores: opt_bool(&obj, "raw_scores")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(input: &str) -> String {
        match parse_rerank(input.as_bytes(), &Limits::default()) {
            Err(ActivityError::InvalidInput(m)) => m,
            other => panic!("expected InvalidInput for {input}, got {other:?}"),
        }
    }

    #[test]
    fn accepts_a_full_request() {
        let r = parse_rerank(
            br#"{"query": "q", "documents": ["a", "b"], "top_n": 1, "return_documents": true, "raw_scores": false, "model": "m"}"#,
            &Limits::default(),
        )
        .unwrap();
        assert_eq!(
            (r.top_n, r.return_documents, r.raw_scores),
            (Some(1), Some(true), Some(false))
        );
        assert_eq!(r.documents, vec!["a", "b"]);
    }

    #[test]
    fn names_the_field() {
        assert!(err(r#"{"documents": ["a"]}"#).contains("\"query\" is required"));
        assert!(err(r#"{"query": 1, "documents": ["a"]}"#).contains("\"query\" must be a string"));
        assert!(err(r#"{"query": "q"}"#).contains("\"documents\" is required"));
        assert!(err(r#"{"query": "q", "documents": []}"#).contains("\"documents\" is empty"));
        assert!(err(r#"{"query": "q", "documents": ["a"], "top_n": 0}"#)
            .contains("\"top_n\" must be a positive integer"));
        assert!(err(r#"{"query": "q", "documents": ["a", 2]}"#)
            .contains("documents[1] must be a string"));
    }
}
