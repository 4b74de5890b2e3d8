//! Where events come from: Redis keyspace notifications (and, later, the deadline ledger and the
//! TTL scanner).

pub mod flags;
pub mod notifications;
