"""Tools for testing specstate and the workers written for it (see `device_audit`)."""
