//! gpulane's activities: what each activity type takes, checks and returns, independent of
//! how Temporal delivers it. The runtime hands a JSON payload and the serving lane's
//! device to [`DeviceActivities::run`] and turns the result or [`ActivityError`] into a
//! Temporal completion.
#![warn(missing_docs)]

mod dataset;
mod embed;
mod error;
mod input;
mod limits;
mod rerank;
mod service;

pub use crate::{
    dataset::{DataRoots, DatasetMemory, DatasetObserver, PartOutcome},
    error::ActivityError,
    limits::Limits,
    service::{Call, DeviceActivities, ModelSet, Ran, Route},
};
