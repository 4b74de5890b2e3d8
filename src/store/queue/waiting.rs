//! Targets' waiting lines: jobs whose target (a channel, a rule's reload or exec) has no free place
//! wait for it in a sorted set of their own, `{prefix}queue:wait:TARGET` (listed in
//! `{prefix}queue:waits`), oldest first, for whichever instance has free places for that target.

use super::*;

impl Queue {
    /// Jobs this instance took but whose target (a channel, a rule's reload or exec) has no free
    /// place go to wait for it in Redis, in the target's own waiting set, oldest first: whichever
    /// instance has free places for that target takes them from there ([`Queue::take_waiting`]),
    /// while the jobs of other targets behind them in the queue are taken meanwhile. Only jobs
    /// still queued: one another instance finished after this one lost its lease stays finished.
    pub async fn wait_for_target(&self, target: &str, ids: &[String]) -> redis::RedisResult<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let now = now_ms();
        let (bundled, ids): (Vec<(String, bundle::Member)>, Vec<String>) = {
            let held = self.held();
            let mut bundled = Vec::new();
            let mut own = Vec::new();
            for id in ids {
                match held.get(id) {
                    Some(m) => bundled.push((id.clone(), m)),
                    None => own.push(id.clone()),
                }
            }
            (bundled, own)
        };
        // Rare (a bundle is never bigger than its target's free places): one call each.
        let wait = self.waiting_zset(target);
        for (id, m) in &bundled {
            self.detach(m, id, &m.payload, &wait, now, Some(target))
                .await?;
        }
        if ids.is_empty() {
            return Ok(());
        }
        let mut inv = self.wait.prepare_invoke();
        inv.key(&self.zset)
            .key(wait)
            .key(self.waiting_key())
            .key(&self.takeovers)
            .arg(target)
            .arg(now)
            .arg(ids);
        inv.invoke_async::<()>(&mut self.conn.clone()).await
    }

    /// Takes up to `free` of the oldest jobs waiting for `target`, leased to this instance
    /// (a bundle bigger than `free` when `idle`: `free` is all the target ever has).
    pub async fn take_waiting(
        &self,
        target: &str,
        free: usize,
        idle: bool,
    ) -> redis::RedisResult<Taken> {
        let mut inv = self.take_waiting.prepare_invoke();
        inv.key(self.waiting_zset(target))
            .key(&self.zset)
            .key(self.waiting_key())
            .arg(free)
            .arg(lease_end(now_ms()))
            .arg(target)
            .arg(if idle { "1" } else { "0" });
        let (left, ids, need): (i64, Vec<String>, usize) =
            inv.invoke_async(&mut self.conn.clone()).await?;
        if ids.is_empty() {
            return Ok(Taken {
                more: left > 0,
                need,
                ..Taken::default()
            });
        }
        let payloads: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(&self.jobs)
            .arg(&ids)
            .query_async(&mut self.conn.clone())
            .await?;
        let pairs = ids
            .into_iter()
            .zip(payloads)
            .flat_map(|(id, payload)| [Some(id), payload])
            .collect();
        let mut taken = self.decode(&self.zset, pairs).await?;
        taken.more = left > 0;
        taken.need = need;
        Ok(taken)
    }

    /// The targets that have jobs waiting for them.
    pub async fn waiting_targets(&self) -> redis::RedisResult<Vec<String>> {
        redis::cmd("SMEMBERS")
            .arg(self.waiting_key())
            .query_async(&mut self.conn.clone())
            .await
    }
}
