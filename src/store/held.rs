//! Messages held by quiet hours (docs/rules.md#quiet-hours), kept in Redis until their quiet
//! period ends and released once across instances (docs/how-it-works.md#held-messages).
//!
//! A *group* is what one channel holds until one end: `{prefix}held:CHANNEL:END` (a hash, job
//! id → the job's payload) and `{prefix}held:CHANNEL:END:resolved` (a set: the ids whose key
//! exists again), listed in `{prefix}held` (a sorted set: the group's member, `["CHANNEL",END]`,
//! scored with END in unix ms by Redis's clock). Holding a message is two idempotent commands
//! ([`HeldStore::hold_cmds`]: `HSETNX`, `ZADD NX`) that the caller runs in the transaction that
//! takes the job out of its queue, so a crash leaves the job in one place or the other.
//!
//! Releasing is leased as the queue's jobs are: [`HeldStore::take_due`] moves due groups' scores
//! a lease into the future, and that lease end is the taker's token; [`HeldStore::renew`] and
//! [`HeldStore::release`] act only while the score is still that token, so an instance that
//! lost its lease (it stalled, and another took the group over) writes nothing. `release`
//! removes the messages released and writes what replaces them (the jobs of `each` in the
//! queue) in one script; a message held while the group was being released stays, and the
//! group comes due again at once. What one release can send twice is what the queue's jobs
//! can: a message sent by an instance that died before recording it.

use std::collections::HashSet;

use chrono::{DateTime, Utc};

use crate::firing::Job;
use crate::keyspace::Conn;

use super::lease_ms;

const TAKE: &str = include_str!("held/take.lua");
const RESCORE: &str = include_str!("held/rescore.lua");
const RELEASE: &str = include_str!("held/release.lua");

/// Messages read per `HSCAN` page.
const PAGE: usize = 1000;

/// The index of held groups.
pub fn index(prefix: &str) -> String {
    format!("{prefix}held")
}

/// What one channel holds until one end.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Group {
    pub channel: String,
    /// When its quiet period ends (unix ms, Redis's clock).
    pub end_ms: i64,
}

impl Group {
    pub fn new(channel: &str, end: DateTime<Utc>) -> Group {
        Group {
            channel: channel.to_string(),
            end_ms: end.timestamp_millis(),
        }
    }

    pub fn end(&self) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(self.end_ms).unwrap_or_default()
    }

    /// Its member in the index.
    fn member(&self) -> String {
        serde_json::to_string(&(&self.channel, self.end_ms)).unwrap_or_default()
    }

    fn from_member(member: &str) -> Option<Group> {
        let (channel, end_ms): (String, i64) = serde_json::from_str(member).ok()?;
        Some(Group { channel, end_ms })
    }

    /// The hash of its messages (job id → payload).
    pub fn messages_key(&self, prefix: &str) -> String {
        format!("{prefix}held:{}:{}", self.channel, self.end_ms)
    }

    /// The set of its messages whose key exists again.
    pub fn resolved_key(&self, prefix: &str) -> String {
        format!("{prefix}held:{}:{}:resolved", self.channel, self.end_ms)
    }
}

/// A group taken for release by this instance, until `token` (its lease end, ms).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub group: Group,
    pub token: i64,
}

/// What a group holds, as read for its release.
#[derive(Debug, Default)]
pub struct Held {
    /// Its messages, in the order their events were observed.
    pub jobs: Vec<Job>,
    /// Those this version cannot read (id, payload, why), to be dead-lettered by the caller
    /// and released with the others.
    pub unreadable: Vec<(String, String, String)>,
    /// The ids of those whose key exists again.
    pub resolved: HashSet<String>,
}

impl Held {
    /// Every id read: what the release of all of it names.
    pub fn ids(&self) -> Vec<String> {
        self.jobs
            .iter()
            .map(Job::id)
            .chain(self.unreadable.iter().map(|(id, _, _)| id.clone()))
            .collect()
    }
}

/// A job written in the place of released messages: a member of `zset` scored `score`, with
/// its payload in `hash` (the queue's sorted set and hash, for `each`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub zset: String,
    pub hash: String,
    pub id: String,
    pub payload: String,
    pub score: i64,
}

/// What [`HeldStore::release`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Released {
    /// Recorded; this many messages are left in the group (held meanwhile, or not yet part of
    /// a release done in parts).
    Recorded { left: usize },
    /// The lease is another instance's: nothing was written.
    Lost,
}

/// A group as the status page and metrics show it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupState {
    pub group: Group,
    /// Messages it holds.
    pub count: usize,
    /// Being released: an instance holds its lease.
    pub releasing: bool,
}

/// What one channel holds, over all its groups: the status page's "held until 08:00, 14
/// messages" and `keywatch_held{channel}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelHeld {
    pub channel: String,
    pub count: usize,
    /// The soonest end among its groups.
    pub until: DateTime<Utc>,
}

/// `groups` by channel, in channel order.
pub fn by_channel(groups: &[GroupState]) -> Vec<ChannelHeld> {
    let mut out: Vec<ChannelHeld> = Vec::new();
    for s in groups {
        match out.iter_mut().find(|c| c.channel == s.group.channel) {
            Some(c) => {
                c.count += s.count;
                c.until = c.until.min(s.group.end());
            }
            None => out.push(ChannelHeld {
                channel: s.group.channel.clone(),
                count: s.count,
                until: s.group.end(),
            }),
        }
    }
    out.sort_by(|a, b| a.channel.cmp(&b.channel));
    out
}

/// The held groups of one state prefix.
#[derive(Clone)]
pub struct HeldStore {
    conn: Conn,
    prefix: String,
    take: redis::Script,
    rescore: redis::Script,
    release: redis::Script,
}

impl HeldStore {
    pub fn new(conn: Conn, prefix: &str) -> HeldStore {
        HeldStore {
            conn,
            prefix: prefix.to_string(),
            take: redis::Script::new(TAKE),
            rescore: redis::Script::new(RESCORE),
            release: redis::Script::new(RELEASE),
        }
    }

    /// The commands that hold `job` in `group`, for the caller's transaction (the one that
    /// takes the job out of its queue). Holding a job already held changes nothing.
    pub fn hold_cmds(&self, group: &Group, job: &Job) -> [redis::Cmd; 2] {
        let mut hset = redis::cmd("HSETNX");
        hset.arg(group.messages_key(&self.prefix))
            .arg(job.id())
            .arg(job.payload());
        let mut zadd = redis::cmd("ZADD");
        zadd.arg(index(&self.prefix))
            .arg("NX")
            .arg(group.end_ms)
            .arg(group.member());
        [hset, zadd]
    }

    /// The command that marks held messages (by job id) as resolved: their key exists again.
    #[cfg(test)]
    pub fn resolved_cmd(&self, group: &Group, ids: &[String]) -> redis::Cmd {
        let mut sadd = redis::cmd("SADD");
        sadd.arg(group.resolved_key(&self.prefix)).arg(ids);
        sadd
    }

    /// Marks held messages as resolved (see [`HeldStore::resolved_cmd`]).
    #[cfg(test)]
    pub async fn mark_resolved(&self, group: &Group, ids: &[String]) -> redis::RedisResult<()> {
        if ids.is_empty() {
            return Ok(());
        }
        self.resolved_cmd(group, ids)
            .exec_async(&mut self.conn.clone())
            .await
    }

    /// Takes up to `max` groups due at `now_ms` (their end passed, or made due by
    /// [`HeldStore::release_now`], or their releaser's lease ran out), leased to this instance.
    pub async fn take_due(&self, now_ms: i64, max: usize) -> redis::RedisResult<Vec<Lease>> {
        let token = now_ms + lease_ms();
        let members: Vec<String> = self
            .take
            .key(index(&self.prefix))
            .arg(now_ms)
            .arg(token)
            .arg(max)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(members
            .iter()
            .filter_map(|m| Group::from_member(m))
            .map(|group| Lease { group, token })
            .collect())
    }

    /// Extends the lease: the renewed lease, or `None` when it is another instance's now.
    pub async fn renew(&self, lease: &Lease, now_ms: i64) -> redis::RedisResult<Option<Lease>> {
        let token = now_ms + lease_ms();
        let moved = self.rescore(&lease.group, lease.token, token).await?;
        Ok(moved.then(|| Lease {
            group: lease.group.clone(),
            token,
        }))
    }

    /// Makes `lease`'s group come due at `at_ms` (a refused release's retry) instead of when the
    /// lease ends; `false` when it is another instance's now.
    pub async fn postpone(&self, lease: &Lease, at_ms: i64) -> redis::RedisResult<bool> {
        self.rescore(&lease.group, lease.token, at_ms).await
    }

    /// Makes `group` due at `now_ms` unless someone is releasing it: a window a reload edited
    /// or removed releases what it held at once. `false` when it was not waiting for its end.
    pub async fn release_now(&self, group: &Group, now_ms: i64) -> redis::RedisResult<bool> {
        self.rescore(group, group.end_ms, now_ms).await
    }

    async fn rescore(&self, group: &Group, from: i64, to: i64) -> redis::RedisResult<bool> {
        let moved: i64 = self
            .rescore
            .key(index(&self.prefix))
            .arg(group.member())
            .arg(from)
            .arg(to)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(moved == 1)
    }

    /// Everything `group` holds.
    pub async fn read(&self, group: &Group) -> redis::RedisResult<Held> {
        let key = group.messages_key(&self.prefix);
        let mut conn = self.conn.clone();
        let mut held = Held::default();
        let mut cursor: u64 = 0;
        loop {
            let (next, pairs): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
                .arg(&key)
                .arg(cursor)
                .arg("COUNT")
                .arg(PAGE)
                .query_async(&mut conn)
                .await?;
            for (id, payload) in pairs {
                match serde_json::from_str::<Job>(&payload) {
                    Ok(job) => held.jobs.push(job),
                    Err(e) => held.unreadable.push((id, payload, e.to_string())),
                }
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
        // HSCAN may return a field twice.
        held.jobs.sort_by_key(|j| (j.firing.observed_at, j.id()));
        held.jobs.dedup_by_key(|j| j.id());
        held.unreadable.sort();
        held.unreadable.dedup_by(|a, b| a.0 == b.0);
        let resolved: Vec<String> = redis::cmd("SMEMBERS")
            .arg(group.resolved_key(&self.prefix))
            .query_async(&mut conn)
            .await?;
        held.resolved = resolved.into_iter().collect();
        Ok(held)
    }

    /// Records the release of the messages `ids` of the leased group, writing `entries` in
    /// their place in the same step (the jobs of `each`; nothing for a digest or a count, sent
    /// before this is called). `last`: this is the whole release, or its last part; a group
    /// left with messages then (held while it was being released) is due again at once.
    pub async fn release(
        &self,
        lease: &Lease,
        ids: &[String],
        entries: &[Entry],
        last: bool,
        now_ms: i64,
    ) -> redis::RedisResult<Released> {
        let g = &lease.group;
        let mut keys = vec![
            index(&self.prefix),
            g.messages_key(&self.prefix),
            g.resolved_key(&self.prefix),
        ];
        let mut place = |k: &str| match keys.iter().position(|x| x == k) {
            Some(i) => i + 1,
            None => {
                keys.push(k.to_string());
                keys.len()
            }
        };
        let mut args: Vec<String> = vec![
            g.member(),
            lease.token.to_string(),
            now_ms.to_string(),
            if last { "1" } else { "0" }.to_string(),
            ids.len().to_string(),
        ];
        args.extend(ids.iter().cloned());
        for e in entries {
            args.push(place(&e.zset).to_string());
            args.push(place(&e.hash).to_string());
            args.push(e.id.clone());
            args.push(e.payload.clone());
            args.push(e.score.to_string());
        }
        let mut inv = self.release.prepare_invoke();
        for k in &keys {
            inv.key(k);
        }
        for a in &args {
            inv.arg(a);
        }
        let left: i64 = inv.invoke_async(&mut self.conn.clone()).await?;
        Ok(match usize::try_from(left) {
            Ok(left) => Released::Recorded { left },
            Err(_) => Released::Lost,
        })
    }

    /// Every held group, soonest end first: what the status page and `keywatch_held` show.
    pub async fn groups(&self) -> redis::RedisResult<Vec<GroupState>> {
        let mut conn = self.conn.clone();
        let scored: Vec<(String, i64)> = redis::cmd("ZRANGE")
            .arg(index(&self.prefix))
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query_async(&mut conn)
            .await?;
        let groups: Vec<(Group, i64)> = scored
            .into_iter()
            .filter_map(|(m, score)| Some((Group::from_member(&m)?, score)))
            .collect();
        if groups.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for (g, _) in &groups {
            pipe.cmd("HLEN").arg(g.messages_key(&self.prefix));
        }
        let counts: Vec<usize> = pipe.query_async(&mut conn).await?;
        let mut out: Vec<GroupState> = groups
            .into_iter()
            .zip(counts)
            .map(|((group, score), count)| GroupState {
                releasing: score != group.end_ms,
                group,
                count,
            })
            .collect();
        out.sort_by(|a, b| a.group.cmp(&b.group));
        out.sort_by_key(|s| s.group.end_ms);
        Ok(out)
    }
}

crate::keyspace::commands::declare! {
    /// The commands held messages send ([`crate::keyspace::commands`]).
    const WHY = "quiet hours: held messages";
    [
        Use::new(Server::State, "hsetnx", WHY)
            .on(Keys::State("held:*"), Access::Write)
            .args("{key} id job"),
        Use::new(Server::State, "zadd", WHY)
            .on(Keys::State("held"), Access::Write)
            .args("{key} NX 0 g"),
        Use::new(Server::State, "sadd", WHY)
            .on(Keys::State("held:*"), Access::Write)
            .args("{key} id"),
        Use::new(Server::State, "hscan", WHY)
            .on(Keys::State("held:*"), Access::Read)
            .args("{key} 0 COUNT 10"),
        Use::new(Server::State, "smembers", WHY)
            .on(Keys::State("held:*"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "zrange", WHY)
            .on(Keys::State("held"), Access::Read)
            .args("{key} 0 -1 WITHSCORES"),
        Use::new(Server::State, "hlen", WHY)
            .on(Keys::State("held:*"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "script|load", WHY)
            .access(Access::Write)
            .args("return(1)"),
        Use::new(Server::State, "evalsha", WHY)
            .on(Keys::State("held"), Access::ReadWrite)
            .args("{sha} 3 {key} {prefix}held:c:0 {prefix}held:c:0:resolved"),
        // In the scripts.
        Use::new(Server::State, "zscore", WHY)
            .on(Keys::State("held"), Access::Read)
            .args("{key} g"),
        Use::new(Server::State, "hdel", WHY)
            .on(Keys::State("held:*"), Access::Write)
            .args("{key} id"),
        Use::new(Server::State, "srem", WHY)
            .on(Keys::State("held:*"), Access::Write)
            .args("{key} id"),
        Use::new(Server::State, "del", WHY)
            .on(Keys::State("held:*"), Access::Write)
            .args("{key}"),
        Use::new(Server::State, "zrem", WHY)
            .on(Keys::State("held"), Access::Write)
            .args("{key} g"),
    ]
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::firing::Action;
    use crate::local_redis::LocalRedis;

    const END: i64 = 1_765_152_000_000;

    async fn store() -> (LocalRedis, HeldStore, Conn) {
        let (server, conn) = crate::local_redis::throwaway().await;
        (server, HeldStore::new(conn.clone(), "kw:"), conn)
    }

    fn job(rule: &str, key: &str, observed_at: &str) -> Job {
        let firing = crate::firing::expiry(rule, key, observed_at);
        Job::first(
            Arc::new(firing),
            Action::Notify {
                channel: "team".into(),
            },
        )
    }

    fn group() -> Group {
        Group {
            channel: "team".into(),
            end_ms: END,
        }
    }

    /// The job's place in a stand-in queue: a sorted set and a hash, as the caller's own.
    async fn queue_put(conn: &Conn, j: &Job) {
        redis::pipe()
            .cmd("HSET")
            .arg("q:jobs")
            .arg(j.id())
            .arg(j.payload())
            .cmd("ZADD")
            .arg("q")
            .arg(0)
            .arg(j.id())
            .exec_async(&mut conn.clone())
            .await
            .unwrap();
    }

    /// Takes `j` out of the stand-in queue and holds it, in one transaction (what the delivery
    /// does at record time).
    async fn hold(s: &HeldStore, conn: &Conn, g: &Group, j: &Job) {
        let mut p = redis::pipe();
        p.atomic();
        p.cmd("ZREM").arg("q").arg(j.id()).ignore();
        p.cmd("HDEL").arg("q:jobs").arg(j.id()).ignore();
        for c in s.hold_cmds(g, j) {
            p.add_command(c).ignore();
        }
        p.exec_async(&mut conn.clone()).await.unwrap();
    }

    async fn zcard(conn: &Conn, key: &str) -> i64 {
        redis::cmd("ZCARD")
            .arg(key)
            .query_async(&mut conn.clone())
            .await
            .unwrap()
    }

    fn entry(j: &Job) -> Entry {
        Entry {
            zset: "q".into(),
            hash: "q:jobs".into(),
            id: j.id(),
            payload: j.payload(),
            score: 0,
        }
    }

    /// Held in the transaction that takes the job out of its queue, once however often it is
    /// held, listed with its count, and read back in the order the events were observed, with
    /// the resolved ones marked.
    #[tokio::test]
    async fn a_message_is_held_once_and_read_back_in_order() {
        let (_server, s, conn) = store().await;
        let g = group();
        let jobs = [
            job("locks", "lock:2", "2026-12-07T15:02:00Z"),
            job("locks", "lock:1", "2026-12-07T15:01:00Z"),
            job("caches", "cache:1", "2026-12-07T15:03:00Z"),
        ];
        for j in &jobs {
            queue_put(&conn, j).await;
            hold(&s, &conn, &g, j).await;
        }
        // An event run again after a crash holds its job again: nothing changes.
        hold(&s, &conn, &g, &jobs[0]).await;
        assert_eq!(zcard(&conn, "q").await, 0);
        assert_eq!(
            s.groups().await.unwrap(),
            [GroupState {
                group: g.clone(),
                count: 3,
                releasing: false
            }]
        );
        s.mark_resolved(&g, &[jobs[1].id()]).await.unwrap();
        let held = s.read(&g).await.unwrap();
        let keys: Vec<String> = held
            .jobs
            .iter()
            .map(|j| String::from_utf8_lossy(&j.firing.key).into_owned())
            .collect();
        assert_eq!(keys, ["lock:1", "lock:2", "cache:1"]);
        assert_eq!(held.resolved, HashSet::from([jobs[1].id()]));
        assert!(held.unreadable.is_empty());
    }

    /// A group is taken when its end has passed, by one instance of two racing for it, and
    /// nobody takes it while it is being released.
    #[tokio::test]
    async fn two_instances_racing_take_each_group_once() {
        let (_server, a, conn) = store().await;
        let b = HeldStore::new(conn.clone(), "kw:");
        for i in 0..20 {
            let g = Group {
                channel: format!("c{i}"),
                end_ms: END + i,
            };
            hold(
                &a,
                &conn,
                &g,
                &job("r", &format!("k:{i}"), "2026-12-07T15:00:00Z"),
            )
            .await;
        }
        assert!(
            a.take_due(END - 1, 100).await.unwrap().is_empty(),
            "not yet"
        );
        let now = END + 100;
        let (ta, tb) = tokio::join!(a.take_due(now, 100), b.take_due(now, 100));
        let (ta, tb) = (ta.unwrap(), tb.unwrap());
        assert_eq!(ta.len() + tb.len(), 20, "{ta:?} {tb:?}");
        let mut taken: Vec<&Group> = ta.iter().chain(&tb).map(|l| &l.group).collect();
        taken.sort();
        taken.dedup();
        assert_eq!(taken.len(), 20);
        assert!(a.take_due(now + 1, 100).await.unwrap().is_empty(), "leased");
        assert!(a.groups().await.unwrap().iter().all(|s| s.releasing));
    }

    /// An instance dies halfway through releasing a group one message at a time: another takes
    /// it over when the lease runs out and releases only what was left; every message reaches
    /// the queue once, and the first one, come back late, writes nothing.
    #[tokio::test]
    async fn a_release_cut_short_by_a_crash_is_finished_by_another_once() {
        let (_server, a, conn) = store().await;
        let b = HeldStore::new(conn.clone(), "kw:");
        let g = group();
        let jobs: Vec<Job> = (0..4)
            .map(|i| job("r", &format!("k:{i}"), &format!("2026-12-07T15:0{i}:00Z")))
            .collect();
        for j in &jobs {
            hold(&a, &conn, &g, j).await;
        }
        let now = END + 10;
        let [lease] = &a.take_due(now, 10).await.unwrap()[..] else {
            panic!("one group due");
        };
        let held = a.read(&g).await.unwrap();
        // The first two, then a crash.
        for j in &held.jobs[..2] {
            let r = a
                .release(lease, &[j.id()], &[entry(j)], false, now)
                .await
                .unwrap();
            assert!(matches!(r, Released::Recorded { .. }), "{r:?}");
        }
        assert!(
            b.take_due(now + 1, 10).await.unwrap().is_empty(),
            "still leased"
        );
        let later = now + lease_ms() + 1;
        let [taken] = &b.take_due(later, 10).await.unwrap()[..] else {
            panic!("the lease ran out: taken over");
        };
        assert!(taken.token > lease.token);
        let rest = b.read(&g).await.unwrap();
        assert_eq!(rest.ids(), [jobs[2].id(), jobs[3].id()]);
        // The first instance, back: its lease is gone, so nothing it says is written.
        let late = a
            .release(lease, &[jobs[2].id()], &[entry(&jobs[2])], true, later)
            .await
            .unwrap();
        assert_eq!(late, Released::Lost);
        assert!(a.renew(lease, later).await.unwrap().is_none());
        assert_eq!(zcard(&conn, "q").await, 2);
        let entries: Vec<Entry> = rest.jobs.iter().map(entry).collect();
        let done = b
            .release(taken, &rest.ids(), &entries, true, later)
            .await
            .unwrap();
        assert_eq!(done, Released::Recorded { left: 0 });
        assert_eq!(zcard(&conn, "q").await, 4);
        let payloads: i64 = redis::cmd("HLEN")
            .arg("q:jobs")
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        assert_eq!(payloads, 4);
        assert!(b.groups().await.unwrap().is_empty());
        let left: i64 = redis::cmd("EXISTS")
            .arg(g.messages_key("kw:"))
            .arg(g.resolved_key("kw:"))
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        assert_eq!(left, 0, "nothing of the group is left behind");
    }

    /// A message held while its group is being released (an instance still on the old
    /// window, a hold that reached Redis late) is not lost: the group stays, due again at once.
    #[tokio::test]
    async fn a_message_held_during_the_release_is_released_next() {
        let (_server, s, conn) = store().await;
        let g = group();
        let first = job("r", "k:1", "2026-12-07T15:00:00Z");
        hold(&s, &conn, &g, &first).await;
        let now = END + 10;
        let [lease] = &s.take_due(now, 10).await.unwrap()[..] else {
            panic!("due");
        };
        let held = s.read(&g).await.unwrap();
        let late = job("r", "k:2", "2026-12-07T23:59:59Z");
        hold(&s, &conn, &g, &late).await;
        let r = s.release(lease, &held.ids(), &[], true, now).await.unwrap();
        assert_eq!(r, Released::Recorded { left: 1 });
        let [again] = &s.take_due(now, 10).await.unwrap()[..] else {
            panic!("due again at once");
        };
        assert_eq!(s.read(&again.group).await.unwrap().ids(), [late.id()]);
    }

    /// A renewed lease keeps the group; a group made due at once by a reload is taken at once,
    /// unless it is being released already.
    #[tokio::test]
    async fn renewing_and_releasing_early() {
        let (_server, s, conn) = store().await;
        let g = group();
        hold(&s, &conn, &g, &job("r", "k:1", "2026-12-07T15:00:00Z")).await;
        let early = END - 3_600_000;
        assert!(s.take_due(early, 10).await.unwrap().is_empty());
        assert!(s.release_now(&g, early).await.unwrap());
        let [lease] = &s.take_due(early, 10).await.unwrap()[..] else {
            panic!("due at once");
        };
        assert!(!s.release_now(&g, early).await.unwrap(), "being released");
        let renewed = s
            .renew(lease, early + lease_ms() / 2)
            .await
            .unwrap()
            .expect("still ours");
        assert!(renewed.token > lease.token);
        assert!(s.take_due(lease.token + 1, 10).await.unwrap().is_empty());
        assert_eq!(
            s.release(lease, &[], &[], true, early).await.unwrap(),
            Released::Lost,
            "the old token"
        );
        assert_eq!(
            s.release(&renewed, &s.read(&g).await.unwrap().ids(), &[], true, early)
                .await
                .unwrap(),
            Released::Recorded { left: 0 }
        );
    }

    #[test]
    fn groups_add_up_by_channel() {
        let state = |channel: &str, end_ms: i64, count: usize| GroupState {
            group: Group {
                channel: channel.into(),
                end_ms,
            },
            count,
            releasing: false,
        };
        let held = by_channel(&[
            state("b", END, 2),
            state("a", END + 5, 1),
            state("b", END - 5, 3),
        ]);
        let shown: Vec<(&str, usize, i64)> = held
            .iter()
            .map(|c| (c.channel.as_str(), c.count, c.until.timestamp_millis()))
            .collect();
        assert_eq!(shown, [("a", 1, END + 5), ("b", 5, END - 5)]);
    }

    /// A payload this version cannot read is handed back to be dead-lettered, and released
    /// with the rest.
    #[tokio::test]
    async fn an_unreadable_message_is_read_as_such() {
        let (_server, s, conn) = store().await;
        let g = group();
        hold(&s, &conn, &g, &job("r", "k:1", "2026-12-07T15:00:00Z")).await;
        redis::cmd("HSET")
            .arg(g.messages_key("kw:"))
            .arg("x:notify:team")
            .arg("{not a job")
            .exec_async(&mut conn.clone())
            .await
            .unwrap();
        let held = s.read(&g).await.unwrap();
        assert_eq!(held.jobs.len(), 1);
        assert_eq!(held.unreadable.len(), 1);
        assert_eq!(held.unreadable[0].0, "x:notify:team");
        assert_eq!(held.ids().len(), 2);
    }
}
