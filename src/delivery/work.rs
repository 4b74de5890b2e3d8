//! What the delivery stage attempts: one job of a firing, or one digest of many firings'
//! notifications.

use std::collections::HashMap;
use std::sync::Arc;

use crate::channel::Message;
use crate::firing::{Action, Firing, Job, Released};

use crate::store::queue::Window;

/// A unit of delivery: one action of one firing, or one digest message.
#[derive(Clone)]
pub(super) enum Work {
    /// One job of one firing; its attempts are counted by the loop that makes them.
    Job {
        firing: Arc<Firing>,
        action: Action,
        /// Released by quiet hours as itself (see [`Job::released`]).
        released: Option<Released>,
    },
    Digest {
        rule: String,
        channel: String,
        message: Arc<Message>,
        firings: Vec<Arc<Firing>>,
        /// Queued jobs the digest stands for, acknowledged when it is sent or dead-lettered: a
        /// merged backlog's jobs, or a window's members (a notification, or a batch's bundle).
        jobs: Vec<String>,
        /// For a window's digest: how many of `firings`, in order, each of `jobs` holds (a
        /// failed digest goes back to its window member by member). Empty otherwise.
        sizes: Vec<usize>,
        /// The `group` window the jobs wait in; `None` for a merged backlog (whose jobs are in
        /// the queue itself).
        window: Option<Window>,
    },
}

impl Work {
    /// A job as work: its attempts and when it first failed are the caller's to carry.
    pub(super) fn of(job: Job) -> Work {
        Work::Job {
            firing: job.firing,
            action: job.action,
            released: job.released,
        }
    }

    pub(super) fn rule(&self) -> &str {
        match self {
            Work::Job { firing, .. } => &firing.rule,
            Work::Digest { rule, .. } => rule,
        }
    }

    pub(super) fn action_name(&self) -> &'static str {
        match self {
            Work::Job { action, .. } => action.name(),
            Work::Digest { .. } => "notify",
        }
    }

    /// The channel of a notification (an alert's included): whose rate and line it waits in,
    /// and which the status page names it by. `None` for other actions, follow-ups included.
    pub(super) fn notify_channel(&self) -> Option<&str> {
        match self {
            Work::Job {
                action: Action::Notify { channel } | Action::Alert { channel, .. },
                ..
            } => Some(channel),
            Work::Job { .. } => None,
            Work::Digest { channel, .. } => Some(channel),
        }
    }

    /// The channel the work goes to, whatever the action (a follow-up's included): what the log
    /// lines name.
    pub(super) fn channel(&self) -> Option<&str> {
        match self {
            Work::Job { action, .. } => action.channel(),
            Work::Digest { channel, .. } => Some(channel),
        }
    }

    /// What the log line names: the key, or how many keys a digest stands for.
    pub(super) fn subject(&self) -> String {
        match self {
            Work::Job { firing, .. } => String::from_utf8_lossy(&firing.key).into_owned(),
            Work::Digest { message, .. } => format!("{} keys (digest)", message.count),
        }
    }

    /// [`Work::subject`] for log lines: a job's key by its bytes, escaped as keys are shown to
    /// people ([`crate::event::printable`]), so a key that is not UTF-8 reads as the one it is.
    pub(super) fn subject_shown(&self) -> String {
        match self {
            Work::Job { firing, .. } => crate::event::printable(&firing.key).into_owned(),
            Work::Digest { .. } => self.subject(),
        }
    }

    /// The job's id in the queue and in-flight set.
    pub(super) fn job_id(&self) -> String {
        match self {
            Work::Job { firing, action, .. } => action.idempotency_key(&firing.id),
            Work::Digest { message, .. } => message.idempotency_key.clone(),
        }
    }

    pub(super) fn id(&self) -> &str {
        match self {
            Work::Job { firing, .. } => &firing.id,
            Work::Digest { message, .. } => &message.idempotency_key,
        }
    }

    /// The firing this work belongs to; a digest stands for many.
    pub(super) fn firing_id(&self) -> Option<&str> {
        match self {
            Work::Job { firing, .. } => Some(&firing.id),
            Work::Digest { .. } => None,
        }
    }

    /// The action, as history records it (a digest's is its channel's notification).
    pub(super) fn action(&self) -> Action {
        match self {
            Work::Job { action, .. } => action.clone(),
            Work::Digest { channel, .. } => Action::Notify {
                channel: channel.clone(),
            },
        }
    }

    /// Every firing this work stands for.
    pub(super) fn firings(&self) -> Vec<&Firing> {
        match self {
            Work::Job { firing, .. } => vec![firing],
            Work::Digest { firings, .. } => firings.iter().map(|f| f.as_ref()).collect(),
        }
    }

    /// The ids of the queued jobs (or a window's members) this work stands for, which its
    /// outcome acknowledges or reschedules.
    pub(super) fn queued(&self) -> Vec<String> {
        match self {
            Work::Job { .. } => vec![self.job_id()],
            Work::Digest { jobs, .. } => jobs.clone(),
        }
    }

    /// The digest window it was taken from.
    pub(super) fn window(&self) -> Option<&Window> {
        match self {
            Work::Digest { window, .. } => window.as_ref(),
            Work::Job { .. } => None,
        }
    }

    /// Its jobs as they go back to the queue for their `attempt`-th attempt, failing since
    /// `since`: a job, or each notification of a digest merged from a pace's backlog.
    pub(super) fn jobs(&self, attempt: u32, since: Option<i64>) -> Vec<Job> {
        match self {
            Work::Job {
                firing,
                action,
                released,
            } => vec![Job {
                firing: firing.clone(),
                action: action.clone(),
                attempt,
                failing_since: since,
                released: released.clone(),
            }],
            Work::Digest {
                firings, channel, ..
            } => window_jobs(firings, channel, attempt, since),
        }
    }

    /// The action as the status page names it: `notify:CHANNEL` for notifications.
    pub(super) fn status_label(&self) -> String {
        match self.notify_channel() {
            Some(c) => format!("notify:{c}"),
            None => self.action_name().to_string(),
        }
    }
}

/// Jobs taken from the queue, gathered per firing (in the order first seen) and put in the
/// order of docs/rules.md within each.
pub(super) fn by_firing(jobs: Vec<Job>) -> Vec<Vec<Job>> {
    let mut out: Vec<Vec<Job>> = Vec::new();
    let mut at: HashMap<String, usize> = HashMap::new();
    for job in jobs {
        match at.get(&job.firing.id) {
            Some(&i) => out[i].push(job),
            None => {
                at.insert(job.firing.id.clone(), out.len());
                out.push(vec![job]);
            }
        }
    }
    for jobs in &mut out {
        jobs.sort_by_key(|j| j.action.order());
    }
    out
}

/// The notification jobs of `firings` for `channel`, as a digest window keeps them.
pub(super) fn window_jobs(
    firings: &[Arc<Firing>],
    channel: &str,
    attempt: u32,
    failing_since: Option<i64>,
) -> Vec<Job> {
    firings
        .iter()
        .map(|f| Job {
            firing: f.clone(),
            action: Action::Notify {
                channel: channel.to_string(),
            },
            attempt,
            failing_since,
            released: None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key that is not UTF-8 read `k:\u{fffd}` in each attempt's log line: another key's
    /// spelling, one `explain` cannot be given back.
    #[test]
    fn the_log_line_names_a_key_by_its_bytes() {
        let mut firing = crate::delivery::testkit::firing("r", "k");
        firing.key = bytes::Bytes::from(b"k:\xff\x1b".to_vec());
        let work = Work::Job {
            firing: Arc::new(firing),
            action: Action::Exec,
            released: None,
        };
        assert_eq!(work.subject_shown(), r"k:\xff\u{1b}");
    }
}
