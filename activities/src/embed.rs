//! Parsing and validating `embed` input. Checks a `serde_json::Value` by hand rather than
//! deriving, so each failure names the exact field, what was found, the limit and the fix.

use gpulane_proto::EmbedRequest;
use serde_json::Value;

use crate::{ActivityError, Limits};

const FIELDS: &[&str] = &["texts", "model", "normalize", "truncate"];
const SHAPE: &str =
    r#"{"texts": ["..."], "model"?: string, "normalize"?: bool, "truncate"?: bool}"#;

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn invalid(msg: String) -> ActivityError {
    ActivityError::InvalidInput(msg)
}

fn opt_bool(
    obj: &serde_json::Map<String, Value>,
    field: &str,
) -> Result<Option<bool>, ActivityError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(invalid(format!(
            "field \"{field}\" must be true or false, got {}",
            kind(other)
        ))),
    }
}

/// Parses and checks an `embed` input against `limits`.
pub(crate) fn parse_embed(input: &[u8], limits: &Limits) -> Result<EmbedRequest, ActivityError> {
    let value: Value = serde_json::from_slice(input).map_err(|e| {
        invalid(format!(
            "input is not valid JSON ({e}); pass an object like {SHAPE}"
        ))
    })?;
    let Value::Object(obj) = value else {
        return Err(invalid(format!(
            "input must be a JSON object like {SHAPE}, got {}",
            kind(&value)
        )));
    };
    if let Some(unknown) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(invalid(format!(
            "unknown field \"{unknown}\"; embed takes {FIELDS:?}"
        )));
    }
    let texts =
        match obj.get("texts") {
            None | Some(Value::Null) => {
                return Err(invalid(format!(
                    "field \"texts\" is required: pass {SHAPE}"
                )))
            }
            Some(Value::Array(a)) => a,
            Some(Value::String(_)) => return Err(invalid(
                "field \"texts\" must be an array of strings, got a string: wrap it as [\"...\"]"
                    .to_owned(),
            )),
            Some(other) => {
                return Err(invalid(format!(
                    "field \"texts\" must be an array of strings, got {}",
                    kind(other)
                )))
            }
        };
    if texts.is_empty() {
        return Err(invalid(
            "field \"texts\" is empty: pass at least one text".to_owned(),
        ));
    }
    if texts.len() > limits.max_texts {
        return Err(invalid(format!(
            "field \"texts\" has {} texts, over the limit of {} per call: split them across several calls",
            texts.len(),
            limits.max_texts
        )));
    }
    let mut out = Vec::with_capacity(texts.len());
    let mut total = 0usize;
    for (i, t) in texts.iter().enumerate() {
        let Value::String(s) = t else {
            return Err(invalid(format!(
                "texts[{i}] must be a string, got {}",
                kind(t)
            )));
        };
        let chars = s.chars().count();
        if chars > limits.max_text_chars {
            return Err(invalid(format!(
                "texts[{i}] has {chars} characters, over the limit of {} per text: split or shorten it",
                limits.max_text_chars
            )));
        }
        total += chars;
        out.push(s.clone());
    }
    if total > limits.max_total_chars {
        return Err(invalid(format!(
            "field \"texts\" has {total} characters in all, over the limit of {} per call: split them across several calls",
            limits.max_total_chars
        )));
    }
    let model = match obj.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => {
            return Err(invalid(format!(
                "field \"model\" must be a model name (a string), got {}",
                kind(other)
            )))
        }
    };
    Ok(EmbedRequest {
        texts: out,
        model,
        normalize: opt_bool(&obj, "normalize")?,
        truncate: opt_bool(&obj, "truncate")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(input: &str) -> String {
        let limits = Limits {
            max_texts: 3,
            max_text_chars: 10,
            max_total_chars: 15,
        };
        match parse_embed(input.as_bytes(), &limits) {
            Err(ActivityError::InvalidInput(m)) => m,
            other => panic!("expected InvalidInput for {input}, got {other:?}"),
        }
    }

    #[test]
    fn accepts_a_minimal_request() {
        let r = parse_embed(br#"{"texts": ["a", "b"]}"#, &Limits::default()).unwrap();
        assert_eq!(r.texts, vec!["a", "b"]);
        assert_eq!((r.model, r.normalize, r.truncate), (None, None, None));
    }

    #[test]
    fn accepts_all_fields() {
        let r = parse_embed(
            br#"{"texts": ["a"], "model": "m", "normalize": false, "truncate": true}"#,
            &Limits::default(),
        )
        .unwrap();
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!((r.normalize, r.truncate), (Some(false), Some(true)));
    }

    #[test]
    fn names_the_field_and_the_fix() {
        assert!(err("[1]").contains("must be a JSON object"));
        assert!(err("not json").contains("not valid JSON"));
        assert!(err("{}").contains("\"texts\" is required"));
        assert!(err(r#"{"texts": []}"#).contains("is empty"));
        assert!(err(r#"{"texts": "hi"}"#).contains("wrap it as"));
        assert!(err(r#"{"texts": ["a", 3]}"#).contains("texts[1] must be a string, got a number"));
        assert!(err(r#"{"texts": ["a"], "text": 1}"#).contains("unknown field \"text\""));
        assert!(err(r#"{"texts": ["a"], "model": 5}"#).contains("\"model\" must be"));
        assert!(err(r#"{"texts": ["a"], "normalize": "yes"}"#)
            .contains("\"normalize\" must be true or false"));
    }

    #[test]
    fn limits_name_the_count_and_the_limit() {
        let m = err(r#"{"texts": ["a","b","c","d"]}"#);
        assert!(
            m.contains("4 texts") && m.contains("limit of 3") && m.contains("split"),
            "{m}"
        );
        let m = err(r#"{"texts": ["0123456789x"]}"#);
        assert!(
            m.contains("texts[0] has 11 characters") && m.contains("limit of 10"),
            "{m}"
        );
        let m = err(r#"{"texts": ["0123456789", "0123456789"]}"#);
        assert!(
            m.contains("20 characters in all") && m.contains("limit of 15"),
            "{m}"
        );
    }

    #[test]
    fn counts_characters_not_bytes() {
        let limits = Limits {
            max_texts: 3,
            max_text_chars: 3,
            max_total_chars: 10,
        };
        assert!(parse_embed("{\"texts\": [\"ééé\"]}".as_bytes(), &limits).is_ok());
    }
}
