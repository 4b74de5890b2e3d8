//! The `log` channel: one log line per message, for trying rules and for the demo.

use std::sync::Arc;

use chrono::{DateTime, Utc};

use crate::event::printable_whole;
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
        // Raw text (the log escapes nothing): key text's controls written out, so that a key
        // cannot forge a log line or repaint the terminal reading it.
        let (title, text) = (
            printable_whole(msg.title.as_bytes()),
            printable_whole(msg.text.as_bytes()),
        );
        tracing::info!(target: "keywatch::alert", channel = %ch.name, rule = %msg.rule, event = %msg.event, count = msg.count, "{title}: {text}");
        Dispatch::Done(Outcome::Sent("logged".into()))
    }
}
