//! Prepared-statement caching for statements Diesel will not cache.
//!
//! Diesel marks every `ON CONFLICT … DO UPDATE`, every `UPDATE` and every
//! `sql_query` unsafe to cache, because some statements of those kinds change their
//! SQL text with their values, and a cache keyed by the Rust type would then hand
//! out the wrong statement. Uncached, each call costs a Parse round trip before its
//! Execute. `Cached` keys the cache by the SQL text and bind types instead (diesel's
//! `StatementCacheKey::Sql`): a statement whose text changed is simply another
//! entry, so this is correct for any statement; it is only worth it for statements
//! whose text is fixed, which ours (claim, fence, scope, queue) are.

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::QueryResult;

/// `Q`, rendered and run unchanged, but kept in the connection's prepared-statement
/// cache under its SQL text and bind types. Each distinct text is one more entry on
/// every connection that runs it, for the connection's lifetime: wrap only
/// statements whose text does not change from call to call.
pub struct Cached<Q>(pub Q);

impl<Q> QueryId for Cached<Q> {
    type QueryId = ();
    // No static id: the cache key is the SQL text plus the bind types.
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Q: QueryFragment<Pg>> QueryFragment<Pg> for Cached<Q> {
    fn walk_ast<'b>(&'b self, pass: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        self.0.walk_ast(pass)
    }

    fn is_safe_to_cache_prepared(&self, _backend: &Pg) -> QueryResult<bool> {
        Ok(true)
    }
}

impl<Q: Query> Query for Cached<Q> {
    type SqlType = Q::SqlType;
}

/// `query.cached()` for any statement.
pub trait CachedExt: Sized {
    /// `Cached(self)`: this statement is prepared once per connection (see
    /// [`Cached`]).
    fn cached(self) -> Cached<Self> {
        Cached(self)
    }
}

impl<T> CachedExt for T {}
