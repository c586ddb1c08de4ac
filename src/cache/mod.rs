//! Paged cache: block allocator, block tables, and a host-side pool that quantizes on append.
