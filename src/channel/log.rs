//! The `log` channel: one log line per message, for trying rules and for the demo.

use std::sync::Arc;

use chrono::{DateTime, Utc};

use crate::outcome::Outcome;
use crate::template::Escape;

use super::fields::Fields;
use super::integration::{Channel, Dispatch, Integration, Kind};
use super::message::Message;

pub const KIND: Kind = Kind {
    name: "log",
    fields: &[],
    default_rate: None,
    example_url: "",
    decode,
};

#[derive(Clone, Debug)]
pub struct Log;

fn decode(_: &mut Fields<'_, '_>) -> Option<Arc<dyn Integration>> {
    Some(Arc::new(Log))
}

impl Integration for Log {
    fn escape(&self) -> Escape {
        Escape::Raw
    }

    fn target(&self) -> String {
        "the log".into()
    }

    fn dispatch(&self, ch: &Channel, msg: &Message, _now: DateTime<Utc>) -> Dispatch {
        tracing::info!(target: "keywatch::alert", channel = %ch.name, rule = %msg.rule, event = %msg.event, count = msg.count, "{}: {}", msg.title, msg.text);
        Dispatch::Done(Outcome::Sent("logged".into()))
    }
}
