//! Parsing and validating `embed` input. Checks a `serde_json::Value` by hand rather than
//! deriving, so each failure names the exact field, what was found, the limit and the fix.

use gpulane_proto::EmbedRequest;
use serde_json::Value;

use crate::{
    input::{invalid, object, opt_bool, opt_positive, opt_string, quote, strings, text_within},
    ActivityError, Limits,
};

const FIELDS: &[&str] = &[
    "texts",
    "model",
    "normalize",
    "truncate",
    "dimensions",
    "prompt",
    "prompt_name",
    "encoding",
];
const SHAPE: &str = r#"{"texts": ["..."], "model"?: string, "normalize"?: bool, "truncate"?: bool, "dimensions"?: int, "prompt"?: string, "prompt_name"?: string, "encoding"?: "float"|"base64"}"#;

/// Parses and checks an `embed` input against `limits`.
pub(crate) fn parse_embed(input: &[u8], limits: &Limits) -> Result<EmbedRequest, ActivityError> {
    let obj = object(input, FIELDS, SHAPE)?;
    let texts =
        match obj.get("texts") {
            Some(Value::String(_)) => return Err(invalid(
                "field \"texts\" must be an array of strings, got a string: wrap it as [\"...\"]"
                    .to_owned(),
            )),
            Some(v) if !v.is_null() => strings("texts", v, limits)?,
            _ => {
                return Err(invalid(format!(
                    "field \"texts\" is required: pass {SHAPE}"
                )))
            }
        };
    let model = opt_string(&obj, "model")?;
    let dimensions = opt_positive(&obj, "dimensions", "omit it for the model's full width")?;
    let encoding = opt_string(&obj, "encoding")?;
    if let Some(e) = &encoding {
        if e != "float" && e != "base64" {
            return Err(invalid(format!(
                "field \"encoding\" is {}; use \"float\" (default) or \"base64\" (little-endian float32)",
                quote(e)
            )));
        }
    }
    let prompt = opt_string(&obj, "prompt")?;
    if let Some(p) = &prompt {
        // The prompt is put before every text, so it counts against the per-text limit
        // with each of them (checked again, with its texts, once the model is known).
        text_within("field \"prompt\"", p, limits)?;
    }
    let prompt_name = opt_string(&obj, "prompt_name")?;
    if prompt.is_some() && prompt_name.is_some() {
        return Err(invalid(
            "fields \"prompt\" and \"prompt_name\" exclude each other: pass one".to_owned(),
        ));
    }
    Ok(EmbedRequest {
        texts,
        model,
        normalize: opt_bool(&obj, "normalize")?,
        truncate: opt_bool(&obj, "truncate")?,
        dimensions,
        prompt,
        prompt_name,
        encoding,
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
            ..Limits::default()
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
        assert!(err(r#"{"texts": ["a"], "dimensions": 0}"#)
            .contains("\"dimensions\" must be a positive integer"));
        assert!(err(r#"{"texts": ["a"], "encoding": "hex"}"#).contains("\"base64\""));
        assert!(
            err(r#"{"texts": ["a"], "prompt": "q: ", "prompt_name": "query"}"#)
                .contains("exclude each other")
        );
        assert!(err(r#"{"texts": ["a"], "normalize": "yes"}"#)
            .contains("\"normalize\" must be true or false"));
    }

    #[test]
    fn an_oversized_prompt_is_refused_naming_the_limit() {
        let m = err(r#"{"texts": ["a"], "prompt": "0123456789x"}"#);
        assert!(
            m.contains("field \"prompt\" has 11 characters") && m.contains("limit of 10"),
            "{m}"
        );
    }

    #[test]
    fn echoed_strings_are_cut() {
        let name = "k".repeat(10_000);
        let m = err(&format!(r#"{{"texts": ["a"], "{name}": 1}}"#));
        assert!(m.len() < 300 && m.contains("10000 characters"), "{m}");
        let m = err(&format!(r#"{{"texts": ["a"], "encoding": "{name}"}}"#));
        assert!(m.len() < 300, "{m}");
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
            ..Limits::default()
        };
        assert!(parse_embed("{\"texts\": [\"ééé\"]}".as_bytes(), &limits).is_ok());
    }
}
