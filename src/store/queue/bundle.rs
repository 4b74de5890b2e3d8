//! Bundles: the jobs of one batch that wait for the same target, stored as one record.
//!
//! In a storm almost every job waits for its target's free places, and a job stored, leased and
//! acknowledged on its own cost the state server six element writes (its payload and place in
//! the waiting set; the move into the queue when taken back; the removal of both when done).
//! A bundle of up to [`MAX`] such jobs is one payload field and one member: waiting, taken back
//! (leased whole, as one member of the queue) and removed as one. What it needs per job is a
//! completion mark (one field of a small hash, `{prefix}queue:done:BUNDLE`), so that whoever
//! takes the bundle over after a crash attempts only the jobs nobody acknowledged — what a
//! crash re-sends stays what it was: the jobs in flight at the kill.
//!
//! A bundle is never bigger than its target takes at once (its concurrency and line, or the
//! line of a rate-limited channel), so taking one back never takes more than the target has
//! places for, and an instance does not hoard work other instances could do.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// Most jobs in one bundle: past this, the per-bundle writes are already a small share, and a
/// bigger bundle only makes a taken-over bundle a bigger unit of work.
pub const MAX: usize = 64;

/// A bundle's member name: its size first, so the scripts that take bundles back know how many
/// jobs one holds without reading it. Job ids start with a firing id (hex), never with `#`.
pub fn id(first_job: &str, size: usize) -> String {
    format!("#{size}#{first_job}")
}

/// How many jobs the member holds when it is a bundle.
pub fn size(member: &str) -> Option<usize> {
    let (n, _) = member.strip_prefix('#')?.split_once('#')?;
    n.parse().ok()
}

/// A bundle's payload: its jobs' payloads as one JSON array.
pub fn payload<'a>(jobs: impl Iterator<Item = &'a str>) -> String {
    let mut out = String::from("[");
    for (i, p) in jobs.enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(p);
    }
    out.push(']');
    out
}

/// The payloads of a bundle's jobs, as stored: each element's own text.
pub fn elements(payload: &str) -> Result<Vec<&serde_json::value::RawValue>, serde_json::Error> {
    serde_json::from_str(payload)
}

/// One job this instance took from a bundle.
#[derive(Clone, Debug)]
pub struct Member {
    pub bundle: Arc<str>,
    pub index: usize,
    /// Its payload as the bundle holds it, for moving it out on its own (to wait for its target
    /// again).
    pub payload: Arc<str>,
}

/// What acknowledging a bundled job comes to.
#[derive(Debug, PartialEq, Eq)]
pub enum Settled {
    /// Other jobs of the bundle are still this instance's: mark this one done.
    Mark { bundle: Arc<str>, index: usize },
    /// It was the last: the bundle goes, marks and all.
    Finished { bundle: Arc<str> },
}

/// The bundles this instance holds (leased) and which of their jobs it has not settled.
#[derive(Default)]
pub struct Held {
    jobs: HashMap<String, Member>,
    left: HashMap<Arc<str>, usize>,
}

impl Held {
    /// The bundle is this instance's now, with these of its jobs (id, index, payload) to do.
    /// Taken again (its lease ran out meanwhile), it starts over from what Redis said.
    pub fn hold(&mut self, bundle: Arc<str>, jobs: Vec<(String, usize, Arc<str>)>) {
        self.jobs.retain(|_, m| m.bundle != bundle);
        self.left.insert(bundle.clone(), jobs.len());
        for (id, index, payload) in jobs {
            self.jobs.insert(
                id,
                Member {
                    bundle: bundle.clone(),
                    index,
                    payload,
                },
            );
        }
    }

    pub fn get(&self, id: &str) -> Option<Member> {
        self.jobs.get(id).cloned()
    }

    /// The job is finished (or moved out of its bundle); `None` when it is no bundle's.
    pub fn settle(&mut self, id: &str) -> Option<Settled> {
        let m = self.jobs.remove(id)?;
        let left = self.left.get_mut(&m.bundle)?;
        *left = left.saturating_sub(1);
        if *left > 0 {
            return Some(Settled::Mark {
                bundle: m.bundle,
                index: m.index,
            });
        }
        self.left.remove(&m.bundle);
        Some(Settled::Finished { bundle: m.bundle })
    }

    /// The queue members `ids` stand for: their own, or their bundle's (once each).
    pub fn members(&self, ids: &[String]) -> Vec<String> {
        let mut bundles = BTreeSet::new();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            match self.jobs.get(id) {
                Some(m) => {
                    if bundles.insert(m.bundle.clone()) {
                        out.push(m.bundle.to_string());
                    }
                }
                None => out.push(id.clone()),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bundle_names_its_size_and_job_ids_are_no_bundles() {
        let b = id("ab12:notify:team", 17);
        assert_eq!(b, "#17#ab12:notify:team");
        assert_eq!(size(&b), Some(17));
        assert_eq!(size("ab12:reload"), None);
        assert_eq!(size("#x#y"), None);
    }

    #[test]
    fn a_payload_reads_back_as_its_elements_byte_for_byte() {
        let jobs = [r#"{"a": [1, 2]}"#, "{\"b\":\n\"x,y]\"}"];
        let p = payload(jobs.iter().copied());
        let back: Vec<&str> = elements(&p).unwrap().iter().map(|r| r.get()).collect();
        assert_eq!(back, jobs);
    }

    #[test]
    fn the_last_job_settled_finishes_its_bundle() {
        let mut h = Held::default();
        let b: Arc<str> = "#2#a".into();
        h.hold(
            b.clone(),
            vec![("a".into(), 0, "{}".into()), ("c".into(), 2, "{}".into())],
        );
        assert_eq!(
            h.members(&["a".into(), "c".into(), "z".into()]),
            ["#2#a", "z"]
        );
        assert_eq!(
            h.settle("c"),
            Some(Settled::Mark {
                bundle: b.clone(),
                index: 2
            })
        );
        assert_eq!(h.settle("c"), None, "settled once");
        assert_eq!(h.settle("a"), Some(Settled::Finished { bundle: b }));
        assert_eq!(h.members(&["a".into()]), ["a"]);
    }
}
