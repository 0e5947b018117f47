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
    // The query is tokenized again with every document, so it counts once per document
    // against the per-call limit (as a prompt does with each text): a long query times
    // many documents must not make the strings the limit exists to bound.
    let q = query.chars().count();
    let total: usize = documents.iter().map(|d| q + d.chars().count()).sum();
    if total > limits.max_total_chars {
        return Err(invalid(format!(
            "the query with each of the {} documents makes {total} characters in all ({q} of \
             query per document), over the limit of {} per call: shorten the query or send \
             fewer documents per call",
            documents.len(),
            limits.max_total_chars
        )));
    }
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

    /// The query counts once per document: it is tokenized with each one.
    #[test]
    fn a_long_query_times_many_documents_is_refused() {
        let limits = Limits {
            max_total_chars: 20,
            ..Limits::default()
        };
        let ok = parse_rerank(
            br#"{"query": "abcd", "documents": ["ab", "cd", "ef"]}"#,
            &limits,
        );
        assert!(ok.is_ok(), "3 x (4 + 2) = 18 characters fit in 20");
        match parse_rerank(
            br#"{"query": "abcde", "documents": ["ab", "cd", "ef"]}"#,
            &limits,
        ) {
            Err(ActivityError::InvalidInput(m)) => {
                assert!(
                    m.contains("21 characters") && m.contains("shorten the query"),
                    "{m}"
                );
            }
            other => panic!("expected InvalidInput, got {other:?}"),
        }
    }
}
