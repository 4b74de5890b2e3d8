//! Where events come from: Redis keyspace notifications ([`notifications`]), checked against
//! what the rules need ([`flags`]), and the deadline ledger that makes expiries punctual and
//! recovers missed ones ([`ledger`]), the scanner that warns before deadlines ([`scanner`]), and, on a Redis Cluster, a
//! subscriber per master that follows failovers and reshards ([`topology`]).

pub mod cluster;
pub mod flags;
pub mod ledger;
pub mod notifications;
pub mod scanner;
