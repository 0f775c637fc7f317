"""Memory layer: paged pools, reservation sizing, allocation, release and retraction."""
