//! Generates the admin API's messages, client and server from `admin.proto` (needs
//! `protoc`, as Temporal's own crates do). The messages derive `serde::Serialize` so that
//! `gpulane status --json` prints them with the proto's field names.

fn main() -> std::io::Result<()> {
    tonic_prost_build::configure()
        .type_attribute(".gpulane.admin.v1", "#[derive(serde::Serialize)]")
        .btree_map(".gpulane.admin.v1")
        .compile_protos(&["admin.proto"], &["."])
}
