//! Checks shared by every activity's input: JSON shape, field types and the limits, each
//! failure naming the field, what was found, the limit and the fix.

use serde_json::{Map, Value};

use crate::{ActivityError, Limits};

pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A value where a number was wanted, as a message shows it: a number as sent (short
/// whatever was sent), anything else by its kind (a string may be megabytes).
pub(crate) fn shown(v: &Value) -> String {
    match v {
        Value::Number(n) => n.to_string(),
        other => kind(other).to_owned(),
    }
}

pub(crate) fn invalid(msg: String) -> ActivityError {
    ActivityError::InvalidInput(msg)
}

/// How many characters of a caller's string a failure message repeats.
const SHOWN_CHARS: usize = 64;

/// A caller's string as failure messages show it: quoted and escaped, and cut to its
/// first [`SHOWN_CHARS`] characters with the full length noted, so a message never grows
/// with what a workflow sends (a 2 MB model name, an unknown field with a newline).
pub(crate) fn quote(s: &str) -> String {
    quote_cut(s, SHOWN_CHARS)
}

/// `s` quoted, cut to its first `shown` characters when longer.
fn quote_cut(s: &str, shown: usize) -> String {
    let n = s.chars().count();
    if n <= shown {
        format!("{s:?}")
    } else {
        let head: String = s.chars().take(shown).collect();
        format!("{head:?}... ({n} characters)")
    }
}

/// A URI from a request, quoted for a message: whole up to 1,024 characters (its file
/// name, at the end, is what a reader needs), else cut like [`quote`] but longer.
pub(crate) fn quote_uri(s: &str) -> String {
    quote_cut(s, 1024)
}

/// Walks a JSON document and fails at the first object with a key twice.
#[derive(Clone, Copy)]
struct NoDuplicateKeys;

impl<'de> serde::de::DeserializeSeed<'de> for NoDuplicateKeys {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for NoDuplicateKeys {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(serde::de::Error::custom(format!(
                    "the key {} twice",
                    quote(&key)
                )));
            }
            map.next_value_seed(self)?;
        }
        Ok(())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(self)?.is_some() {}
        Ok(())
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_none<E>(self) -> Result<(), E> {
        Ok(())
    }
}

pub(crate) fn opt_bool(
    obj: &Map<String, Value>,
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

/// Parses `input` as a JSON object with only `fields`; `shape` shows the caller what to send.
pub(crate) fn object(
    input: &[u8],
    fields: &[&str],
    shape: &str,
) -> Result<Map<String, Value>, ActivityError> {
    let value: Value = serde_json::from_slice(input).map_err(|e| {
        invalid(format!(
            "input is not valid JSON ({e}); pass an object like {shape}"
        ))
    })?;
    // serde_json keeps the last of two equal keys; a caller who sent both meant one of
    // them, and guessing which would run the wrong request.
    serde::de::DeserializeSeed::deserialize(
        NoDuplicateKeys,
        &mut serde_json::Deserializer::from_slice(input),
    )
    .map_err(|e| {
        invalid(format!(
            "input has {e}; send each field once, in an object like {shape}"
        ))
    })?;
    let Value::Object(obj) = value else {
        return Err(invalid(format!(
            "input must be a JSON object like {shape}, got {}",
            kind(&value)
        )));
    };
    if let Some(unknown) = obj.keys().find(|k| !fields.contains(&k.as_str())) {
        return Err(invalid(format!(
            "unknown field {}; this activity takes {fields:?}",
            quote(unknown)
        )));
    }
    Ok(obj)
}

/// An optional positive integer field; `hint` says what omitting it does.
pub(crate) fn opt_positive(
    obj: &Map<String, Value>,
    field: &str,
    hint: &str,
) -> Result<Option<usize>, ActivityError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => Ok(Some(n as usize)),
            _ => Err(invalid(format!(
                "field \"{field}\" must be a positive integer, got {}; {hint}",
                shown(v)
            ))),
        },
    }
}

/// An optional string field (e.g. a model name).
pub(crate) fn opt_string(
    obj: &Map<String, Value>,
    field: &str,
) -> Result<Option<String>, ActivityError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(invalid(format!(
            "field \"{field}\" must be a string, got {}",
            kind(other)
        ))),
    }
}

/// Checks one text against the per-text character limit; returns its character count.
/// `what` names it in the message (`texts[3]`, `field "query"`).
pub(crate) fn text_within(what: &str, s: &str, limits: &Limits) -> Result<usize, ActivityError> {
    let chars = s.chars().count();
    if chars > limits.max_text_chars {
        return Err(invalid(format!(
            "{what} has {chars} characters, over the limit of {} per text: split or shorten it",
            limits.max_text_chars
        )));
    }
    Ok(chars)
}

/// A non-empty array of strings within the count, per-text and total character limits.
pub(crate) fn strings(
    field: &str,
    v: &Value,
    limits: &Limits,
) -> Result<Vec<String>, ActivityError> {
    let Value::Array(items) = v else {
        return Err(invalid(format!(
            "field \"{field}\" must be an array of strings, got {}",
            kind(v)
        )));
    };
    if items.is_empty() {
        return Err(invalid(format!(
            "field \"{field}\" is empty: pass at least one text"
        )));
    }
    if items.len() > limits.max_texts {
        return Err(invalid(format!(
            "field \"{field}\" has {} texts, over the limit of {} per call: split them across several calls",
            items.len(),
            limits.max_texts
        )));
    }
    let mut out = Vec::with_capacity(items.len());
    let mut total = 0usize;
    for (i, t) in items.iter().enumerate() {
        let Value::String(s) = t else {
            return Err(invalid(format!(
                "{field}[{i}] must be a string, got {}",
                kind(t)
            )));
        };
        total += text_within(&format!("{field}[{i}]"), s, limits)?;
        out.push(s.clone());
    }
    if total > limits.max_total_chars {
        return Err(invalid(format!(
            "field \"{field}\" has {total} characters in all, over the limit of {} per call: split them across several calls",
            limits.max_total_chars
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_strings_are_escaped_and_cut() {
        assert_eq!(quote("ab"), "\"ab\"");
        assert_eq!(quote("a\nb\""), "\"a\\nb\\\"\"");
        let long = "x".repeat(2_000_000);
        let q = quote(&long);
        assert!(q.len() < 100, "{q}");
        assert!(q.ends_with("(2000000 characters)"), "{q}");
    }

    #[test]
    fn a_key_twice_is_refused_at_any_depth() {
        let shape = "{\"texts\": [...]}";
        for bad in [
            r#"{"texts": ["a"], "texts": ["b"]}"#,
            r#"{"texts": ["a"], "model": "x", "model": "y"}"#,
            r#"{"texts": ["a"], "options": [{"k": 1, "k": 2}]}"#,
        ] {
            let e = object(bad.as_bytes(), &["texts", "model", "options"], shape)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("twice") && e.contains("send each field once"),
                "{bad}: {e}"
            );
        }
        assert!(object(br#"{"texts": [{"k": 1}, {"k": 2}]}"#, &["texts"], shape).is_ok());
    }
}
