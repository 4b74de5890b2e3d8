//! A message as every channel receives it: rendered and escaped for that channel already.

/// One event of a message (a digest has several).
#[derive(Clone, Debug)]
pub struct Item {
    /// The event JSON of SPEC §4.
    pub event: serde_json::Value,
    /// Its rendered `notify.message`, escaped for the channel.
    pub text: String,
}

/// What a channel sends: already rendered and escaped for that channel.
#[derive(Clone, Debug)]
pub struct Message {
    pub rule: String,
    pub event: String,
    pub title: String,
    /// The body: one event's message, or a digest's lines.
    pub text: String,
    pub items: Vec<Item>,
    /// Events the message stands for (more than `items` when a digest was cut).
    pub count: usize,
    pub digest: bool,
    pub idempotency_key: String,
    /// A webhook's custom `body`, rendered.
    pub custom_body: Option<Vec<u8>>,
    /// Who the rule mentions (`notify.mention`, rendered and checked), on top of the channel's.
    pub mention: Mention,
    /// The acknowledge and silence links (label, URL) of a rule with `escalate` when the files
    /// configure `links`: chat formats with link syntax have them at the end of `text` too,
    /// channels with buttons ([`super::Integration::links_as_buttons`]) only here.
    pub links: Vec<(String, String)>,
    /// The values of the channel's own templates ([`super::Channel::templates`]), rendered for
    /// this message, by field name.
    pub channel_fields: Vec<(&'static str, String)>,
    /// Set on an escalation or a resolved notice: what kind, and which alert it follows (a
    /// PagerDuty `resolve` needs that alert's id as its `dedup_key`).
    pub followup: Option<Followup>,
}

/// Which follow-up of an alert a message is (SPEC §4's `"followup"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FollowupKind {
    /// `escalate`: the alert was not handled in time.
    Escalation,
    /// `resolved`: the key exists again.
    Resolved,
}

impl FollowupKind {
    /// The value of `"followup"` in the event JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            FollowupKind::Escalation => "escalation",
            FollowupKind::Resolved => "resolved",
        }
    }
}

/// What a follow-up message follows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Followup {
    pub kind: FollowupKind,
    /// The id of the alert's event (SPEC §4), the same in the alert and its follow-ups.
    pub alert_id: String,
}

impl Message {
    /// Stands in for a digest that could not be composed (its rule or channel is gone), so its
    /// dead letter still says how many events it held, under the key it would have had.
    pub fn uncomposed_digest(rule: &str, first_id: &str, channel: &str, count: usize) -> Message {
        Message {
            rule: rule.to_string(),
            event: String::new(),
            title: String::new(),
            text: String::new(),
            items: Vec::new(),
            count,
            digest: true,
            idempotency_key: digest_key(first_id, channel, count),
            custom_body: None,
            mention: Default::default(),
            links: Vec::new(),
            channel_fields: Vec::new(),
            followup: None,
        }
    }

    /// The rendered value of the channel's template `field`, if it has one.
    pub fn channel_field(&self, field: &str) -> Option<&str> {
        self.channel_fields
            .iter()
            .find(|(f, _)| *f == field)
            .map(|(_, v)| v.as_str())
    }

    pub fn omitted(&self) -> usize {
        self.count.saturating_sub(self.items.len())
    }
}

/// The `Idempotency-Key` of a digest: the same firings for the same channel give the same key,
/// so a retried digest is recognisably the same message.
pub fn digest_key(first_id: &str, channel: &str, count: usize) -> String {
    format!("{first_id}:digest:{channel}:{count}")
}

/// Who a robot's messages mention.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Mention {
    pub mobiles: Vec<String>,
    pub user_ids: Vec<String>,
    pub all: bool,
}

impl Mention {
    pub fn is_empty(&self) -> bool {
        self.mobiles.is_empty() && self.user_ids.is_empty() && !self.all
    }

    /// The channel's mentions and a rule's (`notify.mention`) together, each person once, the
    /// channel's first.
    pub fn merged(&self, rule: &Mention) -> Mention {
        let union = |a: &[String], b: &[String]| {
            let mut out = a.to_vec();
            for x in b {
                if !out.contains(x) {
                    out.push(x.clone());
                }
            }
            out
        };
        Mention {
            mobiles: union(&self.mobiles, &rule.mobiles),
            user_ids: union(&self.user_ids, &rule.user_ids),
            all: self.all || rule.all,
        }
    }
}
