//! Digest windows: notifications of a rule with `group` wait in a sorted set per (rule,
//! channel), `{prefix}group:RULE:CHANNEL`, due when the window ends (`…:window` holds that end),
//! listed in `{prefix}groups`; whichever instance sees a window due first takes its jobs,
//! leased, and sends them as one digest.

use super::*;

impl Queue {
    /// The command that puts notification jobs into the open window of `w`, opening one of
    /// `length` if none is open (the first event of a window starts it, for every instance
    /// alike): for the caller's transaction, so the notifications are in their window exactly
    /// when the caller's own writes (the record of their events) take effect. An `EVAL` with the
    /// script's text, not `EVALSHA`: inside `MULTI`, a script Redis does not know (restarted,
    /// failed over) would fail alone while the rest of the transaction took effect.
    pub fn window_put_cmd(&self, w: &Window, length: Duration, jobs: &[Job]) -> redis::Cmd {
        let zset = self.window_zset(w);
        let mut eval = redis::cmd("EVAL");
        eval.arg(GROUP_PUT)
            .arg(4)
            .arg(keys::window_end(&zset))
            .arg(&zset)
            .arg(&self.jobs)
            .arg(self.windows_key())
            .arg(now_ms())
            .arg(u64::try_from(length.as_millis()).unwrap_or(u64::MAX).max(1))
            .arg(w.member());
        // A batch's notifications go in as one member: one payload and one place in the
        // window, not one per notification (a digest needs no job of its own per event).
        for e in Entry::window(&self.prefix, w, jobs) {
            eval.arg(e.id).arg(e.payload);
        }
        eval
    }

    /// Puts notification jobs into their window now, on their own (tests); returns when it ends.
    #[cfg(test)]
    pub async fn window_put(
        &self,
        w: &Window,
        length: Duration,
        jobs: &[Job],
    ) -> redis::RedisResult<i64> {
        self.window_put_cmd(w, length, jobs)
            .query_async(&mut self.conn.clone())
            .await
    }

    /// The windows that hold jobs.
    pub async fn windows(&self) -> redis::RedisResult<Vec<Window>> {
        let members: Vec<String> = redis::cmd("SMEMBERS")
            .arg(self.windows_key())
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(members
            .iter()
            .filter_map(|m| Window::of_member(m))
            .collect())
    }

    /// Takes about `max` notifications of `w` whose window has ended (or whose retry is due),
    /// leased: whole members until `max` is reached, so the last may bring it past `max` by
    /// less than one bundle (a digest of 5,000 or of 5,900 reads the same; splitting a bundle
    /// would cost a rewrite of it).
    pub async fn window_take(&self, w: &Window, max: usize) -> redis::RedisResult<WindowTaken> {
        let zset = self.window_zset(w);
        let now = now_ms();
        let triples: Vec<Option<String>> = self
            .window_take
            .key(&zset)
            .key(&self.jobs)
            .key(&self.takeovers)
            .arg(now)
            .arg(max)
            .arg(lease_end(now))
            .invoke_async(&mut self.conn.clone())
            .await?;
        let mut taken = WindowTaken::default();
        let mut pairs = Vec::with_capacity(triples.len() / 3 * 2);
        for t in triples.chunks(3) {
            if let [id, payload, over] = t {
                let over: u32 = over.as_deref().and_then(|o| o.parse().ok()).unwrap_or(0);
                taken.died |= over >= MAX_TAKEOVERS;
                pairs.push(id.clone());
                pairs.push(payload.clone());
            }
        }
        let mut seen = std::collections::HashSet::new();
        let mut aside: Vec<(String, String)> = Vec::new();
        let mut bad_elements = Vec::new();
        for pair in pairs.chunks(2) {
            let [Some(id), payload] = pair else { continue };
            let Some(payload) = payload else {
                taken.unreadable.push(Unreadable::new(
                    id,
                    "",
                    "its payload is missing".to_string(),
                ));
                aside.push((id.clone(), String::new()));
                continue;
            };
            let mut jobs = Vec::new();
            let read = if bundle::size(id).is_some() {
                bundle::elements(payload).map(|elements| {
                    for (index, element) in elements.iter().enumerate() {
                        match serde_json::from_str::<Job>(element.get()) {
                            Ok(job) => jobs.push(job),
                            Err(e) => {
                                // Kept for a person; the rest of the bundle goes on.
                                let at = format!("{id}@{index}");
                                taken.unreadable.push(Unreadable::new(
                                    &at,
                                    element.get(),
                                    e.to_string(),
                                ));
                                bad_elements.push((at, element.get().to_string()));
                            }
                        }
                    }
                })
            } else {
                serde_json::from_str::<Job>(payload).map(|job| jobs.push(job))
            };
            if let Err(e) = read {
                taken
                    .unreadable
                    .push(Unreadable::new(id, payload, e.to_string()));
                aside.push((id.clone(), payload.clone()));
                continue;
            }
            // A notification already in an earlier member of this take is left out here.
            jobs.retain(|j| seen.insert(j.id()));
            taken.members.push(WindowMember {
                id: id.clone(),
                jobs,
            });
        }
        if !aside.is_empty() {
            self.set_aside(&zset, &aside).await?;
        }
        if !bad_elements.is_empty() {
            let mut hset = redis::cmd("HSET");
            hset.arg(&self.unreadable);
            for (at, text) in &bad_elements {
                hset.arg(at).arg(text);
            }
            hset.exec_async(&mut self.conn.clone()).await?;
        }
        Ok(taken)
    }

    /// The digest of these jobs of `w` was sent or dead-lettered.
    /// Written again while Redis cannot take it, as [`Queue::done`] is: dropped, the window's
    /// digest was sent again when its lease ended.
    pub async fn window_done(&self, w: &Window, ids: &[String]) -> redis::RedisResult<()> {
        self.window_done_with(w, ids, &[], &|_| {}).await
    }

    /// [`Queue::window_done`], and `also` in the same transaction (a dead letter kept);
    /// `refused` as for [`Queue::done_with`].
    pub async fn window_done_with(
        &self,
        w: &Window,
        ids: &[String],
        also: &[redis::Cmd],
        refused: super::Refused<'_>,
    ) -> redis::RedisResult<()> {
        let mut pipe = redis::pipe();
        pipe.atomic();
        // EVAL inside MULTI, as `window_put_cmd` explains.
        pipe.cmd("EVAL")
            .arg(GROUP_DONE)
            .arg(4)
            .arg(self.window_zset(w))
            .arg(&self.jobs)
            .arg(self.windows_key())
            .arg(&self.takeovers)
            .arg(w.member())
            .arg(ids)
            .ignore();
        for cmd in also {
            pipe.add_command(cmd.clone()).ignore();
        }
        super::written_again(
            refused,
            || {
                let pipe = &pipe;
                async move { pipe.exec_async(&mut self.conn.clone()).await }
            },
            |_| true,
        )
        .await
    }

    /// The digest of these jobs of `w` failed: they come due again at `due_ms` with their
    /// attempts counted, for whichever instance takes them; those no longer in the window
    /// (another instance sent their digest after this one lost its lease) stay gone.
    ///
    /// `members` are the members the digest was made of (see [`WindowMember`]), each with its
    /// notifications as they go back (their attempts counted): a member goes back whole, so a
    /// bundle stays one.
    pub async fn window_retry(
        &self,
        w: &Window,
        members: &[(String, Vec<Job>)],
        due_ms: i64,
    ) -> redis::RedisResult<()> {
        // A member left with nothing (all of it stood twice in this digest) is done.
        let empty: Vec<String> = members
            .iter()
            .filter(|(_, jobs)| jobs.is_empty())
            .map(|(id, _)| id.clone())
            .collect();
        if !empty.is_empty() {
            self.window_done(w, &empty).await?;
        }
        let mut inv = self.reschedule.prepare_invoke();
        inv.key(self.window_zset(w))
            .key(&self.jobs)
            .key(&self.takeovers)
            .arg(due_ms);
        let mut any = false;
        for (id, jobs) in members {
            let payload = match jobs.as_slice() {
                [] => continue,
                [job] if bundle::size(id).is_none() => job.payload(),
                _ => {
                    let payloads: Vec<String> = jobs.iter().map(Job::payload).collect();
                    bundle::payload(payloads.iter().map(String::as_str))
                }
            };
            inv.arg(id).arg(payload);
            any = true;
        }
        if any {
            inv.invoke_async::<()>(&mut self.conn.clone()).await?;
        }
        Ok(())
    }

    /// Extends the leases of window jobs whose digest is being attempted.
    pub async fn window_renew(&self, w: &Window, ids: &[String]) -> redis::RedisResult<()> {
        self.set_due(&self.window_zset(w), ids, lease_end(now_ms()))
            .await
    }

    /// Hands window jobs back at shutdown: due now.
    pub async fn window_hand_back(&self, w: &Window, ids: &[String]) -> redis::RedisResult<()> {
        self.set_due(&self.window_zset(w), ids, now_ms() as f64)
            .await
    }
}
