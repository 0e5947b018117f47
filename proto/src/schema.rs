//! The published contract as one JSON Schema document (`gpulane schema`, checked in as
//! `proto/gpulane.schema.json`): every activity's input and result, the failure types and
//! whether each is retried, and the queue naming rules with worked examples that client
//! packages test their own builders against.

use schemars::generate::SchemaSettings;
use serde_json::{json, Map, Value};

use crate::{
    activity, cpu_host_queue, failure, gpu_card_queue, model_queue, sanitize_host,
    valid_model_name, EmbedDatasetRequest, EmbedRequest, EmbedResponse, Manifest, RerankRequest,
    RerankResponse, CPU_TOOLS, GPU_TOOLS, MODEL_NAME_MAX, MODEL_QUEUE_SEPARATOR,
    QUEUE_PREFIX_SEPARATOR,
};

/// The whole contract; the same value whatever the machine (no timestamps, no hosts).
pub fn contract_schema() -> Value {
    let mut generator = SchemaSettings::draft2020_12().into_generator();
    let mut activities = Map::new();
    let mut add = |name: &str, input: Value, result: Value| {
        activities.insert(name.to_owned(), json!({ "input": input, "result": result }));
    };
    add(
        activity::EMBED,
        generator.subschema_for::<EmbedRequest>().to_value(),
        generator.subschema_for::<EmbedResponse>().to_value(),
    );
    add(
        activity::RERANK,
        generator.subschema_for::<RerankRequest>().to_value(),
        generator.subschema_for::<RerankResponse>().to_value(),
    );
    add(
        activity::EMBED_DATASET,
        generator.subschema_for::<EmbedDatasetRequest>().to_value(),
        generator.subschema_for::<Manifest>().to_value(),
    );
    let defs = generator.take_definitions(true);

    let failures: Map<String, Value> = failure::ALL
        .iter()
        .map(|(name, retried)| ((*name).to_owned(), json!({ "retried": retried })))
        .collect();
    let hosts = [
        "box-1",
        "GPU-Box.example.com",
        "  ",
        "gpulane-gpu-7d9f8-x7k2p",
        " Büro_GPU:1 ",
        // Rust's trim() strips Unicode white space (U+0085, U+2003) but not the ASCII
        // separators U+001C..U+001F nor U+FEFF, which Python's strip() would take.
        "\u{85}\u{2003}box\u{1c}\u{feff}",
    ];
    // A Kelvin sign: ASCII lower-casing leaves it, Unicode lower-casing would make it k.
    let uuids = [
        "GPU-8F3A2C1E-0000-1111-2222-333344445555",
        " GPU-AB\u{212a} ",
    ];
    let host_examples: Vec<Value> = hosts
        .iter()
        .zip(uuids.iter().cycle())
        .map(|(h, uuid)| {
            json!({
                "host": h,
                "sanitized": sanitize_host(h),
                "cpu_host_queue": cpu_host_queue(h),
                "gpu_uuid": uuid,
                "gpu_card_queue": gpu_card_queue(h, uuid),
            })
        })
        .collect();
    let long = "m".repeat(MODEL_NAME_MAX + 1);
    let names = [
        "all-MiniLM-L6-v2",
        "bge.v1.5",
        "e5_small",
        "",
        "a b",
        "org/name",
        "a@b",
        &long,
    ];
    let name_examples: Vec<Value> = names
        .iter()
        .map(|n| json!({ "name": n, "valid": valid_model_name(n) }))
        .collect();

    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "gpulane activity contract",
        "description": "Inputs and results of gpulane's activities (JSON payloads), its failure types and its task queue names. Generated from the Rust types in proto/src by `gpulane schema`.",
        "version": env!("CARGO_PKG_VERSION"),
        "activities": activities,
        "failures": failures,
        "queues": {
            "gpu_tools": GPU_TOOLS,
            "cpu_tools": CPU_TOOLS,
            "queue_prefix_separator": QUEUE_PREFIX_SEPARATOR.to_string(),
            "model_queue_separator": MODEL_QUEUE_SEPARATOR.to_string(),
            "model_name_max": MODEL_NAME_MAX,
            "examples": {
                "hosts": host_examples,
                "model_names": name_examples,
                "model_queue": { "shared": GPU_TOOLS, "model": "e5-small",
                                 "queue": model_queue(GPU_TOOLS, "e5-small") },
            },
        },
        "$defs": defs,
    })
}

/// `contract_schema()` as the checked-in file holds it: pretty, with a final newline.
pub fn contract_schema_text() -> String {
    let mut text =
        serde_json::to_string_pretty(&contract_schema()).expect("a JSON value always prints");
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeSet, path::Path};

    use super::*;

    const CHECKED_IN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/gpulane.schema.json");

    /// A payload field changed in Rust without the published schema: the client packages
    /// and everyone reading the file would disagree with the worker. Regenerate with
    /// `GPULANE_BLESS_SCHEMA=1 cargo test --release --workspace schema` (or
    /// `gpulane schema > proto/gpulane.schema.json`).
    #[test]
    fn checked_in_schema_is_current() {
        let want = contract_schema_text();
        if std::env::var_os("GPULANE_BLESS_SCHEMA").is_some() {
            std::fs::write(CHECKED_IN, &want).expect("writing the schema");
        }
        let have = std::fs::read_to_string(CHECKED_IN).unwrap_or_default();
        assert!(
            have == want,
            "proto/gpulane.schema.json is stale: run `GPULANE_BLESS_SCHEMA=1 cargo test \
             --release --workspace schema` and commit it"
        );
    }

    /// `gpulane.proto` names the same fields as the schema, message by message: a field
    /// added to a Rust payload must be added there too.
    #[test]
    fn proto_file_matches_the_schema() {
        let proto =
            std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("gpulane.proto"))
                .expect("reading gpulane.proto");
        let messages = proto_messages(&proto);
        let schema = contract_schema();
        let defs = schema["$defs"].as_object().expect("$defs");
        let mut checked = 0;
        for (name, def) in defs {
            let Some(props) = def.get("properties").and_then(Value::as_object) else {
                continue; // enums and untagged unions: spelled as comments in the proto
            };
            let fields = messages
                .iter()
                .find(|(m, _)| m == name)
                .map(|(_, f)| f)
                .unwrap_or_else(|| panic!("gpulane.proto has no message {name}"));
            let want: BTreeSet<&str> = props.keys().map(String::as_str).collect();
            let have: BTreeSet<&str> = fields.iter().map(String::as_str).collect();
            assert_eq!(have, want, "message {name}: gpulane.proto vs the Rust type");
            checked += 1;
        }
        assert!(checked >= 10, "only {checked} messages compared");
    }

    /// `message Name { ... type field = N; ... }` → (Name, [field, ...]); enough proto
    /// for this file (no nesting, no oneofs).
    fn proto_messages(proto: &str) -> Vec<(String, Vec<String>)> {
        let mut out = Vec::new();
        let mut current: Option<(String, Vec<String>)> = None;
        for line in proto.lines() {
            let code = line.split("//").next().unwrap_or("").trim();
            if let Some(rest) = code.strip_prefix("message ") {
                let name = rest.trim_end_matches('{').trim().to_owned();
                current = Some((name, Vec::new()));
            } else if code == "}" {
                out.extend(current.take());
            } else if let Some((_, fields)) = current.as_mut() {
                if let Some((decl, _)) = code.split_once('=') {
                    if let Some(field) = decl.split_whitespace().last() {
                        fields.push(field.to_owned());
                    }
                }
            }
        }
        out
    }

    #[test]
    fn the_proto_parser_reads_fields() {
        let m = proto_messages(
            "message A {\n  repeated string b = 1; // x = 2\n  optional uint32 c = 2;\n}\n",
        );
        assert_eq!(
            m,
            vec![("A".to_owned(), vec!["b".to_owned(), "c".to_owned()])]
        );
    }
}
