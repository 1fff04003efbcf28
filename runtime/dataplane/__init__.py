"""The data plane: pool actors, staging, tickets and the synchronous facade; it moves pages and
states between device pools and a store, and knows nothing of the linker."""
