//! Where events come from: Redis keyspace notifications ([`notifications`]), checked against
//! what the rules need ([`flags`]), and the deadline ledger that makes expiries punctual and
//! recovers missed ones ([`ledger`]), and the scanner that warns before deadlines ([`scanner`]).

pub mod flags;
pub mod ledger;
pub mod notifications;
pub mod scanner;
