//! The `log` channel: one log line per message, for trying rules and for the demo.

use crate::config::Channel;

use super::Message;
use crate::action::Outcome;

pub fn send(ch: &Channel, msg: &Message) -> Outcome {
    tracing::info!(target: "keywatch::alert", channel = %ch.name, rule = %msg.rule, event = %msg.event, count = msg.count, "{}: {}", msg.title, msg.text);
    Outcome::Sent("logged".into())
}
